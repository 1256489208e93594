"""Shared by the gym workload's tests: a hand-made segment with episode ends in known places, the sync
loop in miniature, and a bit-for-bit comparison of states."""

from __future__ import annotations

import torch

from runtime.workloads.gym.sampler import FixedPolicy
from runtime.workloads.gym.segments import Segment


def make_segment(sample_id: int, t: int = 3, e: int = 2, d: int = 2, box: bool = False, seed: int = 0) -> Segment:
    gen = torch.Generator().manual_seed(seed)
    terminated = torch.zeros(t, e, dtype=torch.bool)
    truncated = torch.zeros(t, e, dtype=torch.bool)
    terminated[0, 1] = True
    truncated[1, 0] = True
    return Segment(
        sample_id=sample_id,
        group_id=sample_id + 100,
        obs=torch.rand(t, e, d, generator=gen),
        actions=torch.rand(t, e, 1, generator=gen) if box else torch.randint(3, (t, e), generator=gen),
        logprobs=torch.rand(t, e, generator=gen),
        rewards=torch.rand(t, e, generator=gen),
        terminated=terminated,
        truncated=truncated,
        versions=torch.tensor([5, 6, 6][:t]),
        next_obs=torch.rand(e, d, generator=gen),
        final_obs=torch.rand(2, d, generator=gen),
        episode_returns=torch.tensor([1.5, 2.0], dtype=torch.float64)[: sample_id % 3],
        episode_lengths=torch.tensor([3, 4])[: sample_id % 3],
    )


def sync_loop(learner, sampler, policy, steps: range, segments_per_step: int = 1) -> list[dict[str, float]]:
    """The sync pipeline in miniature: sample with the published weights, train, publish; metrics per step."""
    metrics = []
    for step in steps:
        policy.load_state_dict(learner.publish_state())
        segments = [
            sampler.sample(FixedPolicy(policy, learner.version), sample_id=step * segments_per_step + i, group_id=step)
            for i in range(segments_per_step)
        ]
        metrics.append(learner.train_step(segments, step))
    return metrics


def assert_same_state(a, b, where: str = "state") -> None:
    """Nested dicts / lists of tensors and scalars are equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            assert_same_state(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, where
