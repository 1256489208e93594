"""Rollout: the built-in generation engine and the vLLM / vllm-ascend adapter.

The engine a run uses is built by :func:`runtime.workloads.llm.models.build_engine` (the one builder every
path calls); this package holds the engines themselves.
"""

from __future__ import annotations

from typing import Any

from runtime.rollout.batcher import BatchStats, ContinuousBatcher
from runtime.rollout.engine import Engine
from runtime.rollout.sampling import Completion, SamplingParams, sample_tokens


def sampling_params(rollout_spec: Any, n: int = 1, stop_ids: tuple[int, ...] = ()) -> SamplingParams:
    """SamplingParams from a runtime.spec.RolloutSpec (n: samples per prompt, e.g. the GRPO group size)."""
    return SamplingParams(
        max_new_tokens=rollout_spec.max_new_tokens,
        temperature=rollout_spec.temperature,
        top_p=rollout_spec.top_p,
        top_k=rollout_spec.top_k,
        stop_ids=tuple(stop_ids),
        n=n,
    )


__all__ = [
    "BatchStats",
    "Completion",
    "ContinuousBatcher",
    "Engine",
    "SamplingParams",
    "sample_tokens",
    "sampling_params",
]
