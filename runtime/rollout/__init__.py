"""Rollout: the built-in generation engine and the vLLM / vllm-ascend adapter."""

from __future__ import annotations

from typing import Any

import torch

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


def build_engine(
    rollout_spec: Any,
    model: Any,
    tokenizer: Any,
    device: torch.device | str,
    model_path: str | None = None,
    version: int = 0,
) -> Any:
    """The engine named by ``rollout_spec.engine``: the built-in one over ``model``, or vLLM over ``model_path``
    (an HF directory, e.g. from save_hf; vLLM loads its own copy of the weights)."""
    if rollout_spec.engine == "vllm":
        from runtime.rollout.vllm_adapter import VLLMEngine

        if model_path is None:
            raise ValueError("rollout.engine=vllm needs an HF model directory (model.path or a saved checkpoint)")
        return VLLMEngine(model_path, tokenizer, device, version=version)
    return Engine(
        model,
        tokenizer,
        device,
        max_batch_size=rollout_spec.max_batch_size,
        max_batch_tokens=rollout_spec.max_batch_tokens,
        version=version,
    )


__all__ = [
    "BatchStats",
    "Completion",
    "ContinuousBatcher",
    "Engine",
    "SamplingParams",
    "build_engine",
    "sample_tokens",
    "sampling_params",
]
