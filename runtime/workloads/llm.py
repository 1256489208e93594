"""The LLM workload's roles: where prompts come from, how a rollout turns them into samples.

``pipeline.py`` schedules roles and never looks inside a sample; everything
specific to language-model generation lives here:

* :class:`WorkItem` — one prompt issued for generation, with its unique issue
  index (the data cursor position) from which group and sample ids derive, and
  the oldest weight version allowed to generate it (throttling).
* :class:`PromptSource` — the data cursor over the task's training prompts
  (cycling), with a re-issue list served first (in-flight prompts after a
  resume, prompts of stale samples under ``throttle`` / ``sync``).
* :class:`RolloutWorker` — generates a group per prompt with the engine,
  scores each response with the task's verifier and returns ``Sample``s.
* :func:`build_models` — policy, tokenizer, reference and critic for a spec.

Sampling randomness is a pure function of (run seed, issue index): a batch
draws the same tokens whichever process generates it, so a resumed run needs
no rollout RNG state, and a sync run is deterministic by construction.
"""

from __future__ import annotations

import copy
import hashlib
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from runtime.samples import Prompt, Sample
from runtime.spec import RunSpec


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

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "reissue": [w.pack() for w in self.reissue]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = int(state["cursor"])
        self.reissue = deque(WorkItem.unpack(d) for d in state["reissue"])


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
        self.params = sampling_params(spec.rollout, n=self.group_size, stop_ids=(tokenizer.eos_id,))
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


@dataclass
class Models:
    policy: Any
    tokenizer: Any
    ref_policy: Any = None
    critic: Any = None


def build_models(spec: RunSpec, device: torch.device) -> Models:
    """The trainer's models: policy + tokenizer, a frozen reference when the KL penalty needs it, a critic for PPO."""
    from runtime.models import ValueModel, build_policy
    from runtime.train.algos import get_algorithm

    policy, tokenizer = build_policy(spec.model, device, seed=spec.seed)
    ref = None
    if spec.model.reference and spec.algorithm.kl_coef > 0:
        ref = copy.deepcopy(policy).eval().requires_grad_(False)
    critic = None
    if get_algorithm(spec.algorithm.name).needs_critic:
        critic = ValueModel.from_policy(policy).to(device)
    return Models(policy=policy, tokenizer=tokenizer, ref_policy=ref, critic=critic)


def build_engine(model: Any, tokenizer: Any, device: torch.device, spec: RunSpec) -> Any:
    from runtime.rollout.engine import Engine

    r = spec.rollout
    return Engine(model, tokenizer, device, max_batch_size=r.max_batch_size, max_batch_tokens=r.max_batch_tokens)


def build_task(spec: RunSpec) -> Any:
    from runtime.tasks import build_task as _build

    return _build(spec.task)


# ---- the rollout process (async mode) ----------------------------------------


def to_bytes(obj: Any) -> bytes:
    """Serialise a packed batch by value: a tensor sent through a queue would live in the sender's
    shared memory, which vanishes when a rollout process exits before the trainer reads it."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(blob: bytes) -> Any:
    import io

    return torch.load(io.BytesIO(blob), weights_only=False)


STOP, EPOCH = 0, 1  # indices into the shared flags of the rollout processes (a lock-free RawArray)
# the rollout process itself: runtime.rollout.instance


class ConsistencyProbe:
    """Engine vs trainer log-probabilities on samples older than the trainer's weights.

    The trainer can compare its log-probs with the engine's only on samples generated by its
    current weights; in async mode nearly every sample is a version or more behind, so that
    comparison would mix numerical mismatch with policy drift. The probe re-scores up to
    ``max_samples`` samples of one version with *that version's* weights (kept by the weight
    service) in a model of its own, using the trainer's scoring function.

    A sample whose generation straddled a weight update has a prefix of tokens from its first
    version and the rest from newer ones (whose attention read cache entries the older weights
    wrote, which no single forward reproduces); only that prefix is compared — it was computed,
    prompt included, entirely by the first version.
    """

    def __init__(self, spec: RunSpec, device: torch.device, max_samples: int):
        from runtime.models import build_policy

        self.model, _ = build_policy(spec.model, device, seed=spec.seed)
        self.model.eval().requires_grad_(False)
        self.device = device
        self.max_samples = max_samples
        self.temperature = spec.rollout.temperature if spec.rollout.temperature > 0 else 1.0
        self._loaded: int | None = None

    @torch.no_grad()
    def measure(self, samples: list[Sample], weights: Any) -> dict[str, float]:
        from runtime.metrics import consistency_metrics
        from runtime.models import token_logprobs

        kept = set(weights.versions())
        usable = [s for s in samples if s.versions and s.version in kept]
        if not usable:
            return {}
        version = max(s.version for s in usable)
        picked = [s for s in usable if s.version == version][: self.max_samples]
        # the first version's prefix of each response (versions never decrease along a response)
        prefix = [next((t for t, v in enumerate(s.versions) if v != version), len(s.versions)) for s in picked]
        if self._loaded != version:
            params = self.model.state_dict()
            for name, tensor in weights.state(version).items():
                params[name].copy_(tensor)
            self._loaded = version
        # one right-padded forward; positions count real tokens, as in the trainer's scoring
        rows = [s.prompt_ids + s.response_ids[:n] for s, n in zip(picked, prefix, strict=True)]
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        logp = token_logprobs(self.model, ids.to(self.device), mask.to(self.device), temperature=self.temperature)
        engine, trainer = [], []
        for i, (s, n) in enumerate(zip(picked, prefix, strict=True)):
            start = len(s.prompt_ids) - 1
            trainer.append(logp[i, start : start + n].tolist())
            engine.append(s.logprobs[:n])
        return consistency_metrics(engine, trainer)
