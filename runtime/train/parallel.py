"""How a trained model is spread over the trainer ranks: DDP or FSDP2, mixed precision, checkpointing.

One job: wrap the policy (and the PPO critic) for ``trainer.strategy`` and give the trainer
strategy-independent access to training forwards, gradient accumulation and the model's full state.

- ``ddp`` — :class:`torch.nn.parallel.DistributedDataParallel` when there is more than one rank (one
  rank trains the bare module). Gradients are *summed* over the ranks (a communication hook replaces
  DDP's mean): the trainer's losses are already normalised by the step's global token / sequence
  counts, so the sum is the full-batch gradient. Micro-batches accumulate under ``no_sync()``; the
  last one reduces. ``mixed_precision`` runs forwards under :func:`torch.autocast` with float32
  parameters (and a loss scale for fp16).
- ``fsdp`` — FSDP2 :func:`torch.distributed.fsdp.fully_shard` on every decoder layer, then on the root,
  over the trainer process group's device mesh: parameters, gradients and optimizer state are sharded
  (``DTensor``). ``mixed_precision`` is FSDP2's ``MixedPrecisionPolicy`` (compute in bf16/fp16,
  float32 sharded parameters, gradients reduced in float32); ``cpu_offload`` its ``CPUOffloadPolicy``.
  Every micro-batch reduce-scatters its gradients into the sharded ones (no unsharded gradient is
  kept between micro-batches). Every forward all-gathers, so every rank must run as many forwards
  as the others: :meth:`ParallelModel.agree` gives the count all ranks run.

``gradient_checkpointing`` uses the model's own ``activation_checkpointing_enable`` (non-reentrant; the
built-in decoder has one under transformers' name), which recomputes each decoder layer in the backward pass.

Gradient communication is timed per rank (:class:`CommClock`; the trainer reports it as
``comm/rank<k>/<field>``, ``runtime.contract.COMM_METRICS``): ddp's hook marks each bucket's all-reduce
from its issue to its completion, fsdp's reduce-scatter is FSDP2's default one with a mark on either
side (``set_custom_reduce_scatter``; the class is torch's private ``DefaultReduceScatter``, as of torch
2.13). On CPU the marks are ``time.perf_counter`` (gloo completes ddp's futures when the collective is
done, and fsdp's reduce-scatter blocks); on an accelerator they are timing events on the collective's
stream, read once per step after the step's own synchronisation (the gradient norm's ``float``), so
timing adds no device sync of its own.

Gradient clipping needs no help here: ``torch.nn.utils.clip_grad_norm_`` over DTensor gradients
returns the global norm (a replicated DTensor), identical on every rank.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from runtime.models.lora import inject_like, is_lora

COMPUTE_DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class ParallelError(ValueError):
    """The model cannot be trained with the strategy the spec names (the message names the field)."""


def decoder_layers(module: nn.Module) -> nn.ModuleList:
    """The model's decoder layers: the first ``nn.ModuleList`` named ``layers`` (Qwen2, Llama, the critic's backbone)."""
    for name, child in module.named_modules():
        if isinstance(child, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers":
            return child
    raise ParallelError(
        f"trainer.strategy: fsdp shards per decoder layer, and {type(module).__name__} has no "
        "nn.ModuleList named `layers`"
    )


def enable_gradient_checkpointing(module: nn.Module) -> None:
    """Recompute decoder layers in the backward pass (the model's own mechanism, non-reentrant)."""
    target = module.backbone if hasattr(module, "backbone") else module  # the PPO critic wraps a backbone
    # transformers 5 names it activation_checkpointing_enable (gradient_checkpointing_enable: deprecated alias)
    enable = getattr(target, "activation_checkpointing_enable", None)
    if enable is None:
        raise ParallelError(
            f"trainer.gradient_checkpointing: {type(target).__name__} has no activation_checkpointing_enable "
            "(a built-in or Hugging Face model is needed)"
        )
    enable(activation_checkpointing_kwargs={"use_reentrant": False})
    module.train()  # layers checkpoint only in training mode; the built-in models have no dropout to change


def agree_on_count(count: int, group: Any) -> int:
    """The largest ``count`` over the ranks of ``group`` (one small all-reduce)."""
    box = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX, group=group)
    return int(box.item())


class CommClock:
    """The times of one model's gradient collectives on this rank, taken once per step (:meth:`take`).

    A *span* is one collective: a start mark where it is issued and an end mark where it completed.
    Marks are ``time.perf_counter`` seconds on CPU and timing events (``torch.Event``) on an accelerator,
    recorded on the stream the collective is ordered on (read only in :meth:`take`). The spans of one
    backward that communicates (ddp: a micro-batch's last; fsdp: every one) form a *reduction*
    (:meth:`begin`). A span is ``blocking`` when the caller waited for it to complete (fsdp's
    reduce-scatter on CPU).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.on_device = device.type != "cpu"
        self._reductions: list[list[list[Any]]] = []  # [start, end, blocking] per span, per reduction

    def begin(self) -> None:
        """A backward whose collectives form one reduction starts."""
        if not self._reductions or self._reductions[-1]:
            self._reductions.append([])

    def mark(self) -> Any:
        if not self.on_device:
            return time.perf_counter()
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()  # on the current stream: the collective's, or one ordered after it
        return event

    def start(self, blocking: bool = False) -> list[Any]:
        """A collective is issued; :meth:`stop` the span it returns when it completed."""
        if not self._reductions:
            self._reductions.append([])
        span = [self.mark(), None, blocking]
        self._reductions[-1].append(span)
        return span

    def stop(self, span: list[Any]) -> None:
        span[1] = self.mark()

    def take(self) -> tuple[float, float] | None:
        """``(in flight, waited)`` seconds of the spans since the last take (the contract's ``COMM_GRAD``
        and ``COMM_GRAD_WAIT``), or None when there was none; forgets them. In flight: per reduction the
        length of the union of its spans. Waited: per reduction a blocking span's whole length, else from
        the latest start to the latest end."""
        reductions = [[s for s in r if s[1] is not None] for r in self._reductions]
        self._reductions = []
        reductions = [r for r in reductions if r]
        if not reductions:
            return None
        origin = reductions[0][0][0]
        if self.on_device:
            for reduction in reductions:
                for span in reduction:
                    span[1].synchronize()  # complete already: the step synchronised after its backwards
            seconds = lambda mark: origin.elapsed_time(mark) / 1000.0  # noqa: E731
        else:
            seconds = lambda mark: mark - origin  # noqa: E731
        in_flight = waited = 0.0
        for reduction in reductions:
            spans = sorted((seconds(s[0]), max(seconds(s[1]), seconds(s[0])), s[2]) for s in reduction)
            covered_to = spans[0][0]
            for begin, end, _ in spans:
                in_flight += max(end - max(begin, covered_to), 0.0)
                covered_to = max(covered_to, end)
            waited += sum(end - begin for begin, end, blocking in spans if blocking)
            overlapped = [(begin, end) for begin, end, blocking in spans if not blocking]
            if overlapped:
                waited += max(max(end for _, end in overlapped) - max(begin for begin, _ in overlapped), 0.0)
        return in_flight, waited


class _HookState:
    """What the ddp hook needs: the process group, and the clock that times its all-reduces."""

    def __init__(self, group: Any, clock: CommClock):
        self.group = group
        self.clock = clock


def _sum_allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]
    """DDP communication hook: all-reduce a gradient bucket (``dist.GradBucket``) as a sum (DDP's own
    divides by the world size), timed from its issue to its completion: the span ends in the future's
    callback, which DDP's own wait at the end of the backward waits for (on an accelerator the callback
    runs on a stream ordered after the collective). Unannotated: DDP checks the annotations, and
    postponed ones are strings."""
    span = state.clock.start()
    work = dist.all_reduce(bucket.buffer(), group=state.group, async_op=True)
    assert work is not None

    def done(fut):  # type: ignore[no-untyped-def]
        state.clock.stop(span)
        return fut.value()[0]

    return work.get_future().then(done)


def _timed_reduce_scatter(clock: CommClock) -> Any:
    """FSDP2's default reduce-scatter with a span around it (see :class:`CommClock`); FSDP2 calls it
    synchronously on its reduce-scatter stream: on CPU it blocks until done, on an accelerator the events
    are on that stream. Built here so the FSDP2 import stays lazy."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class TimedReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[no-untyped-def]
            span = clock.start(blocking=not clock.on_device and not async_op)
            work = super().__call__(output_tensor, input_tensor, group, op, async_op)
            clock.stop(span)  # async_op is False in FSDP2: the collective is done (CPU) or enqueued (device)
            return work

    return TimedReduceScatter()


def _broadcast_from_leader(module: nn.Module, group: Any) -> None:
    """Rank 0's parameters and buffers on every rank: each rank shards the same model."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)


class ParallelModel:
    """One trained module under ``trainer.strategy``.

    ``module`` holds the parameters the optimizer steps and the state a checkpoint saves (with fsdp
    the sharded module itself); :meth:`forward` is what training and scoring passes call.
    """

    def __init__(self, module: nn.Module, tcfg: Any, group: Any, device: torch.device, world: int):
        self.module = module
        self.group = group
        self.world = world
        self.device = device
        self.strategy = tcfg.strategy
        self.compute_dtype = COMPUTE_DTYPES[tcfg.mixed_precision]
        self.sharded = tcfg.strategy == "fsdp"
        self._unsharded_class = type(module)  # before fully_shard swaps in its FSDP subclass
        self._config = getattr(module, "config", None)
        if tcfg.gradient_checkpointing:
            enable_gradient_checkpointing(module)
        self._ddp: nn.Module | None = None
        self.clock = CommClock(device)  # this rank's gradient collectives (none with one rank)
        if self.sharded:
            self._shard(tcfg)
        elif world > 1:
            self._ddp = _wrap_ddp(module, group, device, self.clock)

    def _shard(self, tcfg: Any) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        if self.group is None:
            raise ParallelError("trainer.strategy: fsdp needs a trainer process group (resources.trainer_devices >= 2)")
        _broadcast_from_leader(self.module, self.group)
        mesh = DeviceMesh.from_group(self.group, self.device.type)
        mp = (
            MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
            if self.compute_dtype is not None
            else MixedPrecisionPolicy()
        )
        offload = CPUOffloadPolicy() if tcfg.cpu_offload else OffloadPolicy()
        units: list[Any] = list(decoder_layers(self.module)) + [self.module]
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=mp, offload_policy=offload)
            # Sum, not mean, over the ranks (see the module docstring); set on every sharded unit, each
            # reduces its own parameters. Sum-only collectives: gloo has no pre-multiplied sum.
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
            unit.set_custom_reduce_scatter(_timed_reduce_scatter(self.clock))

    # ----------------------------------------------------------------- forwards

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """A forward pass through the strategy's wrapper, in the compute precision."""
        model = self._ddp if self._ddp is not None and torch.is_grad_enabled() else self.module
        with self.precision():
            return model(*args, **kwargs)

    def prefix_forward(self, *args: Any, **kwargs: Any) -> Any:
        """A forward another forward of the same micro-batch follows (the shared-prefix layout's prompts):
        the module itself, so that with ddp only the micro-batch's last forward goes through the wrapper."""
        with self.precision():
            return self.module(*args, **kwargs)

    def precision(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast for ddp with mixed precision; FSDP2 casts by its own policy."""
        if self.compute_dtype is None or self.sharded:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    @contextlib.contextmanager
    def accumulating(self, last: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward: ddp reduces gradients only on the ``last``."""
        if self._ddp is not None and not last:
            with self._ddp.no_sync():  # type: ignore[operator]
                yield
        else:
            if self.sharded or self._ddp is not None:
                self.clock.begin()  # this backward's collectives are one reduction
            yield

    def comm_seconds(self) -> tuple[float, float] | None:
        """This rank's gradient communication since the last call: ``(in flight, waited)`` seconds
        (:meth:`CommClock.take`), or None when it had none (one rank, or no reducing backward)."""
        return self.clock.take()

    def agree(self, count: int, training: bool) -> int:
        """How many forwards every rank runs when this rank has ``count``: the ranks' largest count
        wherever a forward (fsdp) or a backward (ddp, training) is a collective; else ``count``."""
        collective = self.sharded or (self._ddp is not None and training)
        return agree_on_count(count, self.group) if collective else count

    # ----------------------------------------------------------------- full state

    def full_state(self, adapters_only: bool = False) -> dict[str, Tensor]:
        """The model's full weights: with fsdp gathered from the shards (a collective; rank 0 gets them
        on the CPU, the other ranks an empty dict), else detached references to the module's own.
        ``adapters_only`` (LoRA): with fsdp, gather only the parameters that train."""
        if not self.sharded:
            return {k: v.detach() for k, v in self.module.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=adapters_only)
        full = get_model_state_dict(self.module, options=options)
        return {name: value for name, value in full.items() if isinstance(value, Tensor)}

    @contextlib.contextmanager
    def unsharded(self) -> Iterator[nn.Module | None]:
        """The whole model as a plain module (for an HF export): the module itself, or with fsdp a copy
        built on the meta device and filled from :meth:`full_state` on the CPU (None on ranks > 0)."""
        if not self.sharded:
            yield self.module
            return
        state = self.full_state()
        if not state:
            yield None
            return
        if self._config is None:
            raise ParallelError(f"trainer.strategy: fsdp export needs an HF model, not {type(self.module).__name__}")
        with torch.device("meta"):  # no memory until the gathered tensors are assigned
            shell = self._unsharded_class(self._config)
            if is_lora(self.module):
                inject_like(self.module, shell)
        shell.load_state_dict(state, strict=False, assign=True)
        tie = getattr(shell, "tie_weights", None)
        if tie is not None:
            tie()
        yield shell


def _wrap_ddp(module: nn.Module, group: Any, device: torch.device, clock: CommClock) -> nn.Module:
    ids = [device.index] if device.type != "cpu" and device.index is not None else None
    # forward_sync_buffers=False: the buffers (rotary frequencies) are not trained and equal on every rank,
    # and a broadcast per forward would make no-grad scoring a collective too.
    ddp = nn.parallel.DistributedDataParallel(module, device_ids=ids, process_group=group, forward_sync_buffers=False)
    ddp.register_comm_hook(_HookState(group, clock), _sum_allreduce_hook)
    return ddp


# --------------------------------------------------------------------------- loss scaling (fp16)


class LossScale:
    """fp16's dynamic loss scale (``torch.amp.GradScaler``); inert for bf16 and float32.

    Gradients are unscaled before the algorithm's update step, whose non-finite-norm check then skips
    the optimizer step on an overflow; :meth:`update` lowers or raises the scale from that outcome.
    """

    def __init__(self, mixed_precision: str, device: torch.device):
        self.scaler = torch.amp.GradScaler(device.type) if mixed_precision == "fp16" else None

    def scale(self, loss: Tensor) -> Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def update(self) -> None:
        if self.scaler is not None:
            self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


# --------------------------------------------------------------------------- sharded checkpoints


def sharded_state(models: dict[str, ParallelModel], optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, Any]:
    """``{name: model state, name_optimizer: optimizer state}`` for DCP: every rank's own shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    state: dict[str, Any] = {}
    for name, model in models.items():
        # LoRA: the frozen base is rebuilt from the spec; only what trains is saved
        options = StateDictOptions(ignore_frozen_params=is_lora(model.module))
        model_state, optim_state = get_state_dict(model.module, optimizers[name], options=options)
        state[name] = model_state
        state[f"{name}_optimizer"] = optim_state
    return state


def save_shards(
    directory: Any, models: dict[str, ParallelModel], optimizers: dict[str, torch.optim.Optimizer], group: Any
) -> None:
    """Every rank writes its shards of the models and optimizers into ``directory`` (a collective)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(sharded_state(models, optimizers), checkpoint_id=str(directory), process_group=group)


def load_shards(
    directory: Any, models: dict[str, ParallelModel], optimizers: dict[str, torch.optim.Optimizer], group: Any
) -> None:
    """Every rank reads its shards from ``directory`` (written by :func:`save_shards`) into the models
    and optimizers (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = sharded_state(models, optimizers)
    dcp.load(state, checkpoint_id=str(directory), process_group=group)
    for name, model in models.items():
        lora = is_lora(model.module)
        set_state_dict(
            model.module,
            optimizers[name],
            model_state_dict=state[name],
            optim_state_dict=state[f"{name}_optimizer"],
            options=StateDictOptions(ignore_frozen_params=lora, strict=not lora),
        )


# --------------------------------------------------------------------------- measuring


def local_bytes(tensor: Tensor) -> int:
    """Bytes this rank holds of ``tensor`` (its own shard of a DTensor)."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def training_state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (call it while the gradients exist,
    e.g. from an optimizer step pre-hook)."""
    params = [p for p in module.parameters() if p.requires_grad]
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            local_bytes(v) for state in optimizer.state.values() for v in state.values() if isinstance(v, Tensor)
        ),
    }
