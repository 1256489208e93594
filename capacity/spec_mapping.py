"""From a runtime spec to the model's knobs, naming every field whose effect the model leaves out.

Every field of ``runtime/spec.py`` is in one of four tables here, or in a section left out whole
(:data:`NOT_MODELLED_SECTIONS`; a test walks the spec to keep it so), and a field in none of them — a spec newer than this module — is reported as not modelled,
never dropped silently:

* :data:`MAPPED` — the field is a model knob (``pipeline.max_policy_lag`` -> ``max_policy_lag``);
* :data:`THROUGH_INPUTS` — its effect reaches the model through another input: the costs (model
  size, dtype, engine, device kind) or the length inputs (task, sampling);
* :data:`NO_TIMING_EFFECT` — it changes what is learnt or what happens on a failure, not how long a
  failure-free step takes;
* :data:`NOT_MODELLED` — it changes step time and the model leaves it out; reported with the reason
  unless its value is the one that does nothing (``pipeline.eval_interval: 0``).

The input is the resolved spec as the platform stores it (a plain dict): this module imports neither
the runtime nor pydantic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class NotModelled(NamedTuple):
    """A spec field whose effect on step time the model leaves out, and what that effect is."""

    field: str
    reason: str


@dataclass
class SpecMapping:
    """What :func:`map_spec` made of a spec."""

    values: dict[str, Any] = field(default_factory=dict)
    """Config field -> value (``max_new_tokens`` goes to the length distribution)."""
    not_modelled: list[NotModelled] = field(default_factory=list)
    through_inputs: list[str] = field(default_factory=list)
    no_timing_effect: list[str] = field(default_factory=list)

    @property
    def not_modelled_fields(self) -> list[str]:
        return [n.field for n in self.not_modelled]


def _same(name: str) -> Callable[[Any], tuple[str, Any]]:
    return lambda value: (name, value)


_DISPATCH_OF = {"from_stats": "longest_first", "off": "fifo"}

# path -> (Config field, value) from the spec's value
MAPPED: dict[str, Callable[[Any], tuple[str, Any]]] = {
    "seed": _same("seed"),
    "pipeline.mode": _same("mode"),
    "pipeline.steps": _same("run_steps"),
    "pipeline.prompts_per_step": _same("prompts_per_step"),
    "pipeline.max_policy_lag": _same("max_policy_lag"),
    "pipeline.on_lag_exceeded": _same("on_lag_exceeded"),
    "pipeline.queue_capacity": _same("queue_capacity"),
    "pipeline.offload_optimizer": _same("offload_optimizer"),
    # the runtime's both ways are a send per instance (broadcast: a process group of its own per instance)
    "pipeline.remote_weight_sync": lambda _value: ("weight_publication", "unicast"),
    "algorithm.group_size": _same("group_size"),
    "rollout.max_new_tokens": _same("max_new_tokens"),
    "rollout.max_batch_size": _same("max_batch_size"),
    "rollout.max_batch_tokens": _same("max_batch_tokens"),
    "rollout.length_prediction": lambda value: ("dispatch", _DISPATCH_OF.get(value, value)),
    "trainer.updates_per_step": _same("updates_per_step"),
    "resources.trainer_devices": _same("trainer_ranks"),
    "trainer.strategy": lambda value: ("training", "sharded" if value == "fsdp" else "ddp"),
    "resources.rollout_workers": _same("rollout_instances"),
    "resources.remote_rollout_workers": _same("remote_rollout_instances"),
}

_COSTS = "through the costs input (measured or derived for this model, engine and device)"
_LENGTHS = "through the prompt_tokens and lengths inputs"
THROUGH_INPUTS: dict[str, str] = {
    "model.builtin": _COSTS,
    "model.path": _COSTS,
    "model.tokenizer": _LENGTHS,
    "model.dtype": _COSTS,
    "model.implementation": _COSTS + ": the implementation's speed is part of the measured per-token costs",
    "model.attn_implementation": _COSTS + ": the attention kernel is part of the measured per-token costs",
    "model.reference": _COSTS + ": the reference forward is part of the per-token training cost",
    "model.lora": _COSTS + ": the adapters' training and weight-sync costs are part of the measured costs",
    "algorithm.name": _COSTS + ": a critic (ppo) is part of the per-token training cost",
    "algorithm.off_policy": _COSTS + ": the proximal forward is part of the per-token training cost",
    "algorithm.proximal_logprobs": _COSTS + ": the proximal forward it skips is part of the per-token training cost",
    "trainer.micro_batch_tokens": _COSTS,
    "trainer.layout": _COSTS + ": the tokens a layout computes are part of the measured per-token training cost",
    "rollout.engine": _COSTS,
    "rollout.gpu_memory_utilization": _COSTS + ": the KV cache vLLM may hold bounds the engine's batch",
    "rollout.kv_cache_gib": _COSTS + ": the KV cache vLLM may hold bounds the engine's batch",
    "trainer.mixed_precision": _COSTS + ": the compute dtype is part of the per-token training cost",
    "trainer.gradient_checkpointing": _COSTS + ": recomputing each layer is part of the per-token training cost",
    "resources.device": _COSTS,
    "resources.threads_per_process": _COSTS,
    "task.name": _LENGTHS,
    "task.path": _LENGTHS,
    "task.min_len": _LENGTHS,
    "task.max_len": _LENGTHS,
    "task.prompt_key": _LENGTHS,
    "task.answer_key": _LENGTHS,
    "task.system_prompt": _LENGTHS + ": a system prompt lengthens every prompt",
    "task.chat_template": _LENGTHS + ": a chat template lengthens every prompt",
    "rollout.temperature": _LENGTHS,
    "rollout.top_p": _LENGTHS,
    "rollout.top_k": _LENGTHS,
}

NO_TIMING_EFFECT: dict[str, str] = {
    **{
        path: "what is learnt, not how long a step takes"
        for path in (
            "algorithm.clip_eps",
            "algorithm.clip_eps_high",
            "algorithm.kl_coef",
            "algorithm.entropy_coef",
            "algorithm.loss_agg",
            "algorithm.normalize_adv_std",
            "algorithm.is_cap",
            "algorithm.gamma",
            "algorithm.lam",
            "algorithm.value_clip",
            "algorithm.vf_coef",
            "trainer.lr",
            "trainer.critic_lr",
            "trainer.warmup_steps",
            "trainer.weight_decay",
            "trainer.grad_clip",
            "task.eval_path",
            "task.verifier",
            "task.train_size",
            "task.eval_size",
            "task.seed",
        )
    },
    **{
        path: "acts on failures; the model simulates a failure-free run"
        for path in (
            "resources.max_restarts",
            "resources.rollout_restarts",
            "resources.preemptible",
            "trainer.collective_timeout_s",
            "rollout.hang_timeout_s",
            "pipeline.rollout_reconnect_s",
            "reward.timeout_s",
            "reward.max_retries",
            "reward.backoff_s",
            "reward.breaker_failures",
            "reward.breaker_cooldown_s",
        )
    },
    **{
        path: "names and records, no work in a step"
        for path in (
            "name",
            "output_dir",
            "pipeline.rollout_listen",
            "checkpoint.keep_last",
            "checkpoint.keep_best_metric",
            "checkpoint.keep_best_mode",
            "metrics.progress_bar",
            "metrics.jsonl",
            "metrics.reporters",
            "metrics.mlflow_tracking_uri",
            "metrics.mlflow_experiment",
            "metrics.wandb_project",
            "metrics.wandb_mode",
            "metrics.telemetry_interval_s",  # a sample costs ~76 us per period (bench/telemetry.py)
        )
    },
}


def _is(value: Any) -> Callable[[Any, dict[str, Any]], bool]:
    return lambda v, _spec: v == value


def _never(_value: Any, _spec: dict[str, Any]) -> bool:
    return False


def _no_evaluation(_value: Any, spec: dict[str, Any]) -> bool:
    return not _at(spec, "pipeline.eval_interval")


def _no_reward_service(_value: Any, spec: dict[str, Any]) -> bool:
    return _at(spec, "reward.url") is None


def _no_scaling(_value: Any, spec: dict[str, Any]) -> bool:
    return _at(spec, "resources.min_rollout_workers") is None  # all instances stay active


def _not_gym(_value: Any, spec: dict[str, Any]) -> bool:
    return _at(spec, "workload") in (None, "llm")


def _device_per_instance(value: Any, spec: dict[str, Any]) -> bool:
    # on CPU the runtime splits the cores between the processes (each its own), as the model's devices
    return value == _at(spec, "resources.rollout_workers") or _at(spec, "resources.device") == "cpu"


_GYM = "the model simulates an LLM workload's token generation; a gym workload's env steps are not modelled"

# path -> (whether the value does nothing in this spec, the effect left out)
NOT_MODELLED: dict[str, tuple[Callable[[Any, dict[str, Any]], bool], str]] = {
    "workload": (_is("llm"), _GYM),
    "pipeline.eval_interval": (_is(0), "evaluation at step boundaries takes time the model leaves out"),
    "resources.eval_devices": (_no_evaluation, "where the evaluator runs (evaluation is not modelled)"),
    "resources.remote_evaluator": (_no_evaluation, "where the evaluator runs (evaluation is not modelled)"),
    "checkpoint.interval": (_is(0), "checkpoint saves every N steps take time the model leaves out"),
    "reward.url": (_is(None), "a remote reward service's latency is not modelled (scoring is free)"),
    "reward.concurrency": (_no_reward_service, "a remote reward service's latency is not modelled"),
    "pipeline.transfer_max_bytes": (_never, "the model sends each finished group at once, not in batches"),
    "pipeline.transfer_window_s": (_never, "the model sends each finished group at once, not in batches"),
    "pipeline.transfer_shm_min_bytes": (_never, "shared-memory vs pipe transfer is one cost in the model"),
    "resources.min_rollout_workers": (_no_scaling, "instance scaling: the model keeps every instance active"),
    "pipeline.scale_up_below": (_no_scaling, "instance scaling: the model keeps every instance active"),
    "pipeline.scale_down_above": (_no_scaling, "instance scaling: the model keeps every instance active"),
    "trainer.cpu_offload": (
        _is(False),
        "host-device traffic of offloaded parameters and the optimizer step on the CPU are not modelled",
    ),
    "resources.rollout_devices": (
        _device_per_instance,
        "the model gives each rollout instance a device of its own; here instances share devices",
    ),
}

# Sections the model leaves out whole: named once, as the section, in a spec where they act.
NOT_MODELLED_SECTIONS: dict[str, tuple[Callable[[Any, dict[str, Any]], bool], str]] = {
    "env": (_not_gym, _GYM),
    "agent": (_not_gym, _GYM),
}

UNKNOWN = "a field the capacity model does not know: its effect is not modelled"


def _at(spec: dict[str, Any], path: str) -> Any:
    value: Any = spec
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _leaves(spec: dict[str, Any]) -> list[tuple[str, Any]]:
    """(dotted path, value) of each field: top-level scalars and each section's fields."""
    out: list[tuple[str, Any]] = []
    for key, value in spec.items():
        if isinstance(value, dict):
            out.extend((f"{key}.{name}", inner) for name, inner in value.items())
        else:
            out.append((key, value))
    return out


def map_spec(spec: dict[str, Any]) -> SpecMapping:
    """Sort every field of ``spec`` (a resolved runtime spec) into the four tables."""
    mapping = SpecMapping()
    for section, (does_nothing, reason) in NOT_MODELLED_SECTIONS.items():
        if section in spec and not does_nothing(spec[section], spec):
            mapping.not_modelled.append(NotModelled(section, reason))
    for path, value in _leaves(spec):
        if path.split(".")[0] in NOT_MODELLED_SECTIONS:
            continue
        if path in MAPPED:
            name, converted = MAPPED[path](value)
            mapping.values[name] = converted
        elif path in THROUGH_INPUTS:
            mapping.through_inputs.append(path)
        elif path in NO_TIMING_EFFECT:
            mapping.no_timing_effect.append(path)
        elif path in NOT_MODELLED:
            does_nothing, reason = NOT_MODELLED[path]
            if not does_nothing(value, spec):
                mapping.not_modelled.append(NotModelled(path, reason))
        else:
            mapping.not_modelled.append(NotModelled(path, UNKNOWN))
    if mapping.values.get("mode", "sync") != "async":
        mapping.values["dispatch"] = "fifo"  # the lock-step modes generate in issue order
    return mapping
