"""Per-device memory of a run: what each part of training and generation keeps, in bytes (computed).

Standard library only. The formulas, their assumptions and a table are in docs/memory.md
(``bench/memory_table.py`` prints the table from these functions). ``P`` is the policy's parameter
count, ``N`` the trainer ranks, ``T`` the tokens of one micro-batch (``trainer.micro_batch_tokens``).

* **Training state** (AdamW; ZeRO, Rajbhandari et al., SC 2020, section 3.1): weights, gradients and
  the two moments in the parameters' dtype — 2 + 2 + 4 bytes per parameter in pure bf16, 4 + 4 + 8
  in fp32 and with mixed precision (fp32 master weights, fp32 gradients and moments) plus the bf16
  compute copies. ddp keeps all of it on every rank; fsdp divides weights, gradients and moments by
  N and all-gathers the bf16 weights of one layer at a time, with the next one prefetched (two units
  of the largest one: a decoder layer, or the embedding when it is bigger). ``cpu_offload`` (fsdp)
  keeps the sharded state on the host; ``offload_optimizer`` (colocated) moves the moments there
  while generation runs, so the generation phase does not hold them.
* **Activations** kept for the backward, per token and decoder layer, in the compute dtype:
  ``6h + 2·kv·d + 4I`` elements — both RMSNorms' input and output (4h), q (h), k and v (2·kv·d),
  the attention output (h; SDPA keeps no score matrix), and the SwiGLU MLP's gate, up, activation
  and product (4I). Gradient checkpointing per layer keeps only each layer's input (h) plus one
  layer recomputed at a time. The logits add ``V`` elements in the compute dtype and two float32
  copies (upcast and log-softmax) per token: ``10 V`` bytes. Assumptions, not measurements.
* **Generation**: the engine's weights in the compute dtype (2P for bf16) and its KV cache,
  ``2 · L · kv · d · 2`` bytes per cached token; vLLM instead takes ``gpu_memory_utilization`` of
  the device for weights + activations + KV cache together.
* **Host**: the weight service keeps ``keep`` versions (async: ``max(2, max_policy_lag + 1)``) in
  ``model.dtype`` (what ``Trainer.publish_state`` gives), plus one shared-memory buffer for local
  rollout instances.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
STRATEGIES = ("ddp", "fsdp")
MODES = ("sync", "async", "colocated")
ENGINES = ("builtin", "vllm")


class MemoryInputError(ValueError):
    """An input the memory model cannot take; the message names the field."""


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer (Qwen2 / Llama layout: GQA attention, SwiGLU MLP, RMSNorm)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool = True  # Qwen2 has biases on q, k and v; Llama none

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attention = 2 * h * h + 2 * h * kv + (h + 2 * kv if self.qkv_bias else 0)
        return attention + 3 * h * self.intermediate + 2 * h  # + the layer's two RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        heads = 1 if self.tied_embeddings else 2  # input embedding, and the LM head unless tied
        return heads * self.embedding_params + self.layers * self.layer_params + self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of K and V that one cached token takes across all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def activation_elements_per_token_layer(self) -> int:
        return 6 * self.hidden + 2 * self.kv_heads * self.head_dim + 4 * self.intermediate


# Figures from each model's config.json (Qwen2.5 family, Hugging Face hub).
QWEN25 = {
    "0.5B": ModelShape("Qwen2.5-0.5B", 24, 896, 14, 2, 4864, 151936, tied_embeddings=True),
    "1.5B": ModelShape("Qwen2.5-1.5B", 28, 1536, 12, 2, 8960, 151936, tied_embeddings=True),
    "7B": ModelShape("Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064, tied_embeddings=False),
    "32B": ModelShape("Qwen2.5-32B", 64, 5120, 40, 8, 27648, 152064, tied_embeddings=False),
}


@dataclass(frozen=True)
class Training:
    """How the trainer trains: the spec's ``trainer`` section and ``model.dtype``."""

    strategy: str = "ddp"
    ranks: int = 1
    model_dtype: str = "float32"
    mixed_precision: bool = False  # trainer.mixed_precision bf16/fp16: fp32 master weights, 2-byte compute
    gradient_checkpointing: bool = False
    cpu_offload: bool = False  # fsdp: sharded weights, gradients and moments on the host
    micro_batch_tokens: int = 4096
    reference: bool = False  # a frozen reference policy for the KL penalty (compute dtype)

    def check(self) -> None:
        if self.strategy not in STRATEGIES:
            raise MemoryInputError(f"trainer.strategy: {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        if self.ranks < 1:
            raise MemoryInputError(f"resources.trainer_devices: {self.ranks} must be >= 1")
        if self.model_dtype not in DTYPE_BYTES:
            raise MemoryInputError(f"model.dtype: {self.model_dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        if self.mixed_precision and self.model_dtype != "float32":
            raise MemoryInputError("trainer.mixed_precision: needs model.dtype float32 (the master weights)")
        if self.cpu_offload and self.strategy != "fsdp":
            raise MemoryInputError("trainer.cpu_offload: acts only with trainer.strategy fsdp")
        if self.micro_batch_tokens < 1:
            raise MemoryInputError(f"trainer.micro_batch_tokens: {self.micro_batch_tokens} must be >= 1")

    @property
    def compute_bytes(self) -> int:
        return 2 if self.mixed_precision else DTYPE_BYTES[self.model_dtype]

    @property
    def state_bytes(self) -> int:
        """Bytes per parameter of the kept weights (the master weights under mixed precision)."""
        return DTYPE_BYTES[self.model_dtype]


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes one trainer rank keeps on its device at the peak of a training step."""

    weights: int  # the kept (master) weights: sharded with fsdp
    compute_weights: int  # the 2-byte copies a mixed-precision forward reads (all, or two fsdp units)
    gradients: int
    optimizer: int  # AdamW's two moments
    activations: int
    logits: int
    reference: int

    @property
    def total(self) -> int:
        return sum(vars(self).values())

    def between_steps(self, offload_optimizer: bool = False) -> int:
        """What stays on the device between steps (gradients freed by ``zero_grad(set_to_none=True)``,
        activations by the backward); ``offload_optimizer`` moves the moments to the host."""
        return self.weights + (0 if offload_optimizer else self.optimizer) + self.reference


def training_memory(model: ModelShape, t: Training) -> TrainingMemory:
    """Per-rank device bytes of training ``model`` as ``t`` says (see the module docstring)."""
    t.check()
    p, sb, cb = model.params, t.state_bytes, t.compute_bytes
    shard = t.ranks if t.strategy == "fsdp" else 1
    on_device = 0 if t.cpu_offload else 1
    weights = on_device * p * sb // shard
    gradients = on_device * p * sb // shard
    optimizer = on_device * 2 * p * sb // shard
    if t.strategy == "fsdp":  # one unit all-gathered for compute and the next prefetched
        compute = 2 * max(model.layer_params, model.embedding_params) * cb
    else:  # ddp: autocast's 2-byte copy of every weight lives from the forward to its backward
        compute = p * cb if t.mixed_precision else 0
    per_layer = model.activation_elements_per_token_layer() * cb * t.micro_batch_tokens
    if t.gradient_checkpointing:
        activations = model.layers * model.hidden * cb * t.micro_batch_tokens + per_layer
    else:
        activations = model.layers * per_layer
    logits = model.vocab * (cb + 4 + 4) * t.micro_batch_tokens
    reference = p * cb if t.reference else 0
    return TrainingMemory(weights, compute, gradients, optimizer, activations, logits, reference)


@dataclass(frozen=True)
class Generation:
    """The rollout engine: ``rollout.engine`` and what its KV cache is given."""

    engine: str = "builtin"
    kv_tokens: int = 64 * 1024  # builtin: cached tokens at once (max_batch_size x (prompt + max_new_tokens))
    gpu_memory_utilization: float = 0.5  # vllm: its share of the device for weights + activations + KV cache
    dtype_bytes: int = 2

    def check(self) -> None:
        if self.engine not in ENGINES:
            raise MemoryInputError(f"rollout.engine: {self.engine!r} is not one of {', '.join(ENGINES)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise MemoryInputError(f"rollout.gpu_memory_utilization: {self.gpu_memory_utilization} not in (0, 1]")
        if self.kv_tokens < 0:
            raise MemoryInputError(f"rollout.max_batch_tokens: {self.kv_tokens} cached tokens must be >= 0")


@dataclass(frozen=True)
class GenerationMemory:
    weights: int
    kv_cache: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache


def generation_memory(model: ModelShape, g: Generation, device_bytes: float) -> GenerationMemory:
    """Device bytes of the engine. vLLM takes its share of the device whatever the model needs; its KV
    cache is what the share leaves after the weights (activations left out)."""
    g.check()
    weights = model.params * g.dtype_bytes
    if g.engine == "vllm":
        share = int(g.gpu_memory_utilization * device_bytes)
        return GenerationMemory(weights, max(0, share - weights))
    return GenerationMemory(weights, g.kv_tokens * model.kv_bytes_per_token(g.dtype_bytes))


@dataclass(frozen=True)
class DeviceMemory:
    """The peak of each kind of device of a run, and the host's kept weights."""

    trainer_device: int
    rollout_device: int  # 0 when the trainer's devices generate (sync, colocated)
    eval_device: int  # 0 when the evaluator reads the host's kept versions (resources.eval_devices 0)
    host_weights: int  # the weight service's kept versions and the shared buffer (host memory)


def run_memory(
    model: ModelShape,
    mode: str,
    t: Training,
    g: Generation,
    device_bytes: float,
    keep: int = 2,
    eval_device: bool = False,
    offload_optimizer: bool = False,
) -> DeviceMemory:
    """Per-device peaks of a run in ``mode``.

    sync: the trainer's device also hosts the engine (its own weights copy and KV cache). colocated: the
    built-in engine with ddp generates with the trainer's own weights (no copy) and keeps its KV cache
    (and, with fsdp, a weights copy of its own) throughout; vLLM sleeps (level 1) while the trainer trains,
    so the peak is the larger of the training step and vLLM's share beside what training keeps between
    steps (less the moments with ``offload_optimizer``).
    async: training alone on the trainer's device (the probe and evaluator read the host's kept versions),
    the engine on each rollout device. ``keep``: the versions the weight service keeps (async sets
    ``max(2, max_policy_lag + 1)``).
    """
    if mode not in MODES:
        raise MemoryInputError(f"pipeline.mode: {mode!r} is not one of {', '.join(MODES)}")
    if keep < 0:
        raise MemoryInputError(f"keep: {keep} kept versions must be >= 0")
    train = training_memory(model, t)
    gen = generation_memory(model, g, device_bytes)
    published = model.params * t.state_bytes  # Trainer.publish_state: the policy's weights in model.dtype
    evaluator = (model.params * g.dtype_bytes + gen.kv_cache) if eval_device else 0
    if mode == "async":
        host = (keep + 1) * published  # kept versions + the shared buffer of local instances
        return DeviceMemory(train.total, gen.total, evaluator, host)
    if mode == "sync":
        return DeviceMemory(train.total + gen.total, 0, evaluator, 0)
    if g.engine == "vllm":  # asleep (level 1: weights to the host, KV cache dropped) while the trainer trains
        return DeviceMemory(max(train.total, train.between_steps(offload_optimizer) + gen.total), 0, evaluator, 0)
    shares_weights = t.strategy == "ddp"  # RunSpec.engine_shares_policy: the trainer's own module, no copy
    resident = gen.kv_cache + (0 if shares_weights else gen.weights)  # the built-in engine keeps both
    return DeviceMemory(train.total + resident, 0, evaluator, 0)
