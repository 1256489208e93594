"""The LLM workload's generation: a group of responses per prompt, scored by the task.

* :class:`RolloutWorker` — generates a group per prompt with the engine,
  scores each response with the task's verifier (or the remote reward
  service) and returns ``Sample``s; the inline modes' generator.
* :func:`make_samples`, :func:`reward_scores`, :func:`batch_seed` — shared with
  the rollout instance of the async mode (:mod:`runtime.workloads.llm.instance`).

Sampling randomness is a pure function of (run seed, issue index): a batch
draws the same tokens whichever process generates it, so a resumed run needs
no rollout RNG state, and a sync run is deterministic by construction.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from runtime.samples import Prompt, Sample
from runtime.spec import RunSpec
from runtime.workloads.llm.data import WorkItem


def batch_seed(seed: int, index: int) -> int:
    """A 63-bit seed for the generation batch that starts at issue ``index``."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def make_samples(
    item: WorkItem, prompt_ids: list[int], completions: list[Any], scores: list[tuple[float, bool]]
) -> list[Sample]:
    """The group's ``Sample``s: one per completion (in sample order), ids derived from the issue index."""
    group_size = len(completions)
    return [
        Sample(
            sample_id=item.index * group_size + j,
            prompt_id=item.prompt.prompt_id,
            group_id=item.index,
            prompt_ids=prompt_ids,
            response_ids=list(c.token_ids),
            logprobs=[float(x) for x in c.logprobs],
            versions=[int(v) for v in c.versions],
            finish_reason=c.finish_reason,
            reward=float(reward),
            correct=bool(correct),
        )
        for j, (c, (reward, correct)) in enumerate(zip(completions, scores, strict=True))
    ]


def reward_scores(task: Any, prompt: Prompt, texts: list[str], results: list[Any]) -> list[tuple[float, bool]] | None:
    """Scores from the reward service's ``results`` for one group, or None when one is missing (the
    group is dropped whole: GRPO normalises over all its samples). Correctness comes from the
    service when it says, else from the task's verifier."""
    if any(r.dropped for r in results):
        return None
    return [
        (r.reward, r.correct if r.correct is not None else bool(task.score(prompt, t)[1]))
        for r, t in zip(results, texts, strict=True)
    ]


class RolloutWorker:
    """Generation and reward for a list of work items (one engine, one task), in the caller's process.

    Rewards come from the task's verifier, or from the remote reward service when ``reward.url``
    is set; a group that lost a reward there is left out and its issue index added to ``dropped``.
    """

    def __init__(self, spec: RunSpec, engine: Any, tokenizer: Any, task: Any, device: torch.device):
        from runtime.rollout import sampling_params

        self.spec = spec
        self.engine = engine
        self.tokenizer = tokenizer
        self.task = task
        self.device = device
        self.group_size = spec.algorithm.group_size
        self.params = sampling_params(spec.rollout, n=self.group_size, stop_ids=tokenizer.stop_ids)
        # prompts per engine call: a whole number of groups within the engine's batch size
        self.prompts_per_batch = max(1, spec.rollout.max_batch_size // self.group_size)
        self.reward = None
        if spec.reward.url:
            from runtime.tasks.reward_service import RewardClient

            self.reward = RewardClient.from_spec(spec.reward)
        self.dropped: list[int] = []  # issue indices of groups whose reward the service did not give

    def generate(self, items: list[WorkItem]) -> tuple[list[Sample], int]:
        """Samples for ``items`` (``group_size`` per prompt, ids from the issue index); also the tokens generated."""
        samples: list[Sample] = []
        tokens = 0
        for start in range(0, len(items), self.prompts_per_batch):
            chunk = items[start : start + self.prompts_per_batch]
            prompt_ids = [self.tokenizer.encode_prompt(it.prompt.text) for it in chunk]
            gen = torch.Generator(device=self.device)
            gen.manual_seed(batch_seed(self.spec.seed, chunk[0].index))
            completions = self.engine.generate(prompt_ids, self.params, generator=gen)
            groups: list[list[Any]] = [[] for _ in chunk]
            for c in completions:  # in prompt order, each prompt's samples in order
                groups[c.prompt_index].append(c)
                tokens += len(c.token_ids)
            texts = [[self.tokenizer.decode(list(c.token_ids)) for c in group] for group in groups]
            for item, ids, group, scores in zip(chunk, prompt_ids, groups, self.score(chunk, texts), strict=True):
                if scores is None:
                    self.dropped.append(item.index)
                    continue
                samples.extend(make_samples(item, ids, group, scores))
        samples.sort(key=lambda s: s.sample_id)  # groups contiguous, in issue order
        return samples, tokens

    def score(self, items: list[WorkItem], texts: list[list[str]]) -> list[list[tuple[float, bool]] | None]:
        """Each group's scores (None: a reward missing); the remote service gets the whole chunk at once."""
        if self.reward is None:
            return [[self.task.score(it.prompt, t) for t in group] for it, group in zip(items, texts, strict=True)]
        flat = [(it.prompt.text, t, it.prompt.answer) for it, group in zip(items, texts, strict=True) for t in group]
        results = iter(self.reward.score_many(flat))
        return [
            reward_scores(self.task, it.prompt, group, [next(results) for _ in group])
            for it, group in zip(items, texts, strict=True)
        ]
