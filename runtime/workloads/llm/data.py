"""The LLM workload's data: work items (one prompt each) and the data cursor that issues them.

* :class:`WorkItem` — one prompt issued for generation, with its unique issue
  index (the data cursor position) from which group and sample ids derive, and
  the oldest weight version allowed to generate it (throttling).
* :class:`PromptSource` — the data cursor over the task's training prompts
  (cycling), with a re-issue list served first (in-flight prompts after a
  resume, prompts of stale samples under ``throttle`` / ``sync``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from runtime.rollout.scheduling import LengthPredictor
from runtime.samples import Prompt, Sample


@dataclass
class WorkItem:
    index: int  # issue index: unique over the run; the group id of the prompt's samples
    prompt: Prompt
    min_version: int = 0  # generation waits until weights at least this new are available
    # issued again at its old place in line (a dead rollout process's work): keep its min_version,
    # which was computed for that place, rather than raising it to the bound of the end of the line
    pinned: bool = False

    def pack(self) -> dict[str, Any]:
        p = self.prompt
        return {"index": self.index, "min_version": self.min_version, "prompt": [p.prompt_id, p.text, p.answer, p.size]}

    @staticmethod
    def unpack(d: dict[str, Any]) -> WorkItem:
        pid, text, answer, size = d["prompt"]
        return WorkItem(index=d["index"], min_version=d["min_version"], prompt=Prompt(pid, text, answer, size))


class PromptSource:
    """The data cursor: hands out the task's training prompts in order, cycling over epochs."""

    def __init__(self, prompts: list[Prompt]):
        if not prompts:
            raise ValueError("task.train_size: the task produced no training prompts")
        self.prompts = prompts
        self.prompt_by_id = {p.prompt_id: p for p in prompts}
        self.cursor = 0  # prompts issued from the data so far (= next fresh issue index)
        self.reissue: deque[WorkItem] = deque()

    def next(self, n: int, min_version: int = 0) -> list[WorkItem]:
        out: list[WorkItem] = []
        while self.reissue and len(out) < n:
            item = self.reissue.popleft()
            if not item.pinned:
                item.min_version = max(item.min_version, min_version)
            out.append(item)
        while len(out) < n:
            prompt = self.prompts[self.cursor % len(self.prompts)]
            out.append(WorkItem(index=self.cursor, prompt=prompt, min_version=min_version))
            self.cursor += 1
        return out

    def give_back(self, items: list[WorkItem], min_version: int = 0) -> None:
        """Re-issue ``items`` before any fresh prompt, generated with weights >= ``min_version``.

        The re-issue list stays in issue order (oldest index first), however many times work
        is given back (several dead rollout processes, stale groups): the oldest work is
        consumed first, as it would have been."""
        for item in items:
            item.min_version = max(item.min_version, min_version)
        self.reissue = deque(sorted([*self.reissue, *items], key=lambda w: w.index))

    def regenerate(self, stale: list[Sample], min_version: int) -> None:
        """Re-issue the prompts of ``stale`` samples' groups (at their issue indices, so the regenerated
        groups reuse the sample ids), generated with weights >= ``min_version``."""
        groups = sorted({s.group_id: s.prompt_id for s in stale}.items())
        self.give_back([WorkItem(index=g, prompt=self.prompt_by_id[pid]) for g, pid in groups], min_version)

    def unpack_item(self, packed: dict[str, Any]) -> WorkItem:
        """A work item from :meth:`WorkItem.pack` (a checkpoint's work in flight)."""
        return WorkItem.unpack(packed)

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "reissue": [w.pack() for w in self.reissue]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = int(state["cursor"])
        self.reissue = deque(WorkItem.unpack(d) for d in state["reissue"])


class TokenCost:
    """A group's predicted generation work: group size x its prompt's predicted response length
    (:class:`~runtime.rollout.scheduling.LengthPredictor`, learning from every finished sample)."""

    def __init__(self, spec: Any):
        self.group_size = spec.algorithm.group_size
        self.task_name = spec.task.name
        self.predictor = LengthPredictor(spec.rollout.max_new_tokens, spec.rollout.length_prediction)

    def predict(self, item: WorkItem) -> float:
        p = item.prompt
        return self.group_size * self.predictor.predict(p.prompt_id, self.task_name, len(p.text))

    def observe(self, samples: list[Any]) -> None:
        for s in samples:
            self.predictor.observe(s.prompt_id, self.task_name, len(s.prompt_ids), len(s.response_ids))
