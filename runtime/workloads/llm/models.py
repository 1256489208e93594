"""The LLM workload's models: the trainer's policy, tokenizer, reference and critic; the engine builder; the task."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from runtime.models import DTYPES, CharTokenizer, ModelError, build_policy, check_model_path, load_tokenizer
from runtime.rollout.engine import Engine
from runtime.rollout.vllm_adapter import VLLMEngine, import_vllm  # vllm itself is imported only for a vllm engine
from runtime.spec import VLLM_CPU_KV_CACHE_GIB, RunSpec


@dataclass
class Models:
    policy: Any
    tokenizer: Any
    ref_policy: Any = None
    critic: Any = None


def build_models(spec: RunSpec, device: torch.device) -> Models:
    """The trainer's models: policy + tokenizer, a frozen reference when the KL penalty needs it, a critic for PPO."""
    from runtime.models import ValueModel
    from runtime.train.algos import get_algorithm

    policy, tokenizer = build_policy(spec.model, device, seed=spec.seed)
    ref = None
    # with LoRA the reference is the policy with its adapters off (Trainer): no copy
    if spec.model.reference and spec.algorithm.kl_coef > 0 and spec.model.lora is None:
        ref = copy.deepcopy(policy).eval().requires_grad_(False)
    critic = None
    if get_algorithm(spec.algorithm.name).needs_critic:
        critic = ValueModel.from_policy(policy).to(device)
    return Models(policy=policy, tokenizer=tokenizer, ref_policy=ref, critic=critic)


def build_engine(
    model: Any | None, tokenizer: Any | None, device: torch.device, spec: RunSpec, *, colocated: bool = False
) -> Any:
    """The generation engine ``rollout.engine`` names: the one builder of every path (inline modes, async and
    remote rollout instances, the evaluator, ``python -m runtime eval``).

    builtin: an :class:`~runtime.rollout.engine.Engine` over ``model`` (the trainer's own module when the
    engine shares it, ``RunSpec.engine_shares_policy``), or over a copy of the policy built here when
    ``model`` is None. vllm: a :class:`~runtime.rollout.vllm_adapter.VLLMEngine` that loads its own weights
    from ``model.path``, so no torch copy of the policy is built (``model`` must be None); ``colocated``
    turns on vLLM's sleep mode on an accelerator (the engine sleeps while the trainer trains on the same
    device; vLLM's CPU build has none, and host memory holds both). The
    tokenizer defaults to the model directory's (``model.tokenizer``). vllm not importable:
    ``VLLMUnavailable`` (bad input), never a fallback to the built-in engine.
    """
    r = spec.rollout
    if r.engine == "vllm":
        if model is not None:
            raise ValueError("rollout.engine vllm loads its own weights from model.path: pass no torch model")
        assert spec.model.path is not None  # RunSpec refuses vllm without model.path
        import_vllm()  # the package before anything is loaded: without it nothing here can run
        return VLLMEngine(
            spec.model.path,
            tokenizer if tokenizer is not None else engine_tokenizer(spec),
            device,
            dtype=vllm_dtype(spec),
            seed=spec.seed,
            gpu_memory_utilization=r.gpu_memory_utilization,
            kv_cache_bytes=vllm_kv_cache_bytes(spec),
            max_batch_size=r.max_batch_size,
            sleep_mode=colocated and device.type != "cpu",
            lora=spec.model.lora,
        )
    owns_model = model is None
    if model is None:
        model, own_tokenizer = build_policy(spec.model, device, seed=spec.seed)
        model.eval()
        tokenizer = own_tokenizer if tokenizer is None else tokenizer
    if tokenizer is None:
        raise ValueError("build_engine: a model passed in needs its tokenizer")
    return Engine(
        model,
        tokenizer,
        device,
        max_batch_size=r.max_batch_size,
        max_batch_tokens=r.max_batch_tokens,
        owns_model=owns_model,
    )


def engine_tokenizer(spec: RunSpec) -> Any:
    """The tokenizer ``build_policy`` would give ``spec.model``, without building the model."""
    if spec.model.path is None or spec.model.tokenizer == "char":  # a built-in takes the char vocabulary
        return CharTokenizer()
    try:
        return load_tokenizer(check_model_path(spec.model.path))
    except ValueError as exc:
        raise ModelError(str(exc)) from None


def vllm_kv_cache_bytes(spec: RunSpec) -> int | None:
    """vLLM's ``kv_cache_memory_bytes``: ``rollout.kv_cache_gib``, on cpu ``VLLM_CPU_KV_CACHE_GIB`` when unset;
    None lets vLLM size the cache from ``rollout.gpu_memory_utilization`` (cuda, npu)."""
    gib = spec.rollout.kv_cache_gib
    if gib is None and spec.resources.device == "cpu":
        gib = VLLM_CPU_KV_CACHE_GIB
    return None if gib is None else int(gib * 2**30)


def engine_weight_dtype(spec: RunSpec) -> torch.dtype | None:
    """The dtype weights are sent to a run's remote engines in: a vLLM engine's (``vllm_dtype``), which it
    would convert them to on arrival; None (as published) for the built-in engine and other workloads."""
    if spec.workload != "llm" or spec.rollout.engine != "vllm":
        return None
    return DTYPES[vllm_dtype(spec)]


def vllm_dtype(spec: RunSpec) -> str:
    """vLLM generates in the trainer's compute dtype: ``trainer.mixed_precision`` when on (the float32
    master weights are the trainer's business), else ``model.dtype``."""
    return {"bf16": "bfloat16", "fp16": "float16"}.get(spec.trainer.mixed_precision, spec.model.dtype)


def build_task(spec: RunSpec) -> Any:
    from runtime.tasks import build_task as _build

    return _build(spec.task, spec.model.path)  # the model directory: its tokenizer's chat template
