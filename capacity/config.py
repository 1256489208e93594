"""What the pipeline model simulates: the run's shape and the knobs of the runtime's modes.

The knobs are the runtime's (``runtime/spec.py``): ``mode`` sync / async / colocated,
``max_policy_lag`` with ``on_lag_exceeded`` throttle / drop / sync, the sample queue's capacity,
rollout instances with their engine limits (``max_batch_size``, ``max_batch_tokens``) and
length-aware dispatch, data-parallel trainer ranks, optimizer offload. Beside them sit what a spec
does not say but the model needs: prompt and response lengths, the placement of devices in nodes,
and the communication choices a larger deployment has (weight publication, transfer, sharded
training, a shared comm domain).

A knob of another mode is accepted and has no effect (the planner simulates one spec in every mode).
:meth:`Config.from_spec` maps a runtime spec and names each of its fields whose effect the model
leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from capacity.checks import Problems
from capacity.comm import PUBLICATIONS, TRANSFERS
from capacity.lengths import LengthDistribution
from capacity.spec_mapping import SpecMapping, map_spec

MODES = ("sync", "async", "colocated")
LAG_POLICIES = ("throttle", "drop", "sync")
DISPATCHES = ("longest_first", "fifo")
TRAININGS = ("ddp", "sharded")


def _default_lengths() -> LengthDistribution:
    return LengthDistribution(median=16, max_new_tokens=32, sigma=0.5)


@dataclass(frozen=True)
class Config:
    """One pipeline configuration (validated on construction; a bad value names its field)."""

    mode: str = "sync"
    """sync: generate, train, publish in turn, generation on the trainer's devices; async: rollout
    instances on devices of their own generate into the sample queue while the trainer trains;
    colocated: generation and training alternate on the same devices, weights shared."""
    prompts_per_step: int = 8
    """Prompts a training step consumes (``pipeline.prompts_per_step``)."""
    group_size: int = 8
    """Samples per prompt (``algorithm.group_size``)."""
    prompt_tokens: int = 16
    """Tokens of every prompt."""
    lengths: LengthDistribution = field(default_factory=_default_lengths)
    """Response lengths; its ``max_new_tokens`` is ``rollout.max_new_tokens``."""
    max_policy_lag: int = 1
    """Async: largest (trainer version - sample version) trained on."""
    on_lag_exceeded: str = "throttle"
    """Async: throttle (generation waits for recent enough weights), drop (stale samples discarded),
    sync (stale samples' prompts regenerated with the current weights)."""
    queue_capacity: int | None = None
    """Async: samples the queue holds; None: 5x one step's samples (the runtime's default)."""
    rollout_instances: int = 1
    """Rollout instances (engines), one device each. sync and colocated: engines on trainer devices
    (the runtime has one, on rank 0); async: on devices after the trainer's, on its node first."""
    remote_rollout_instances: int = 0
    """Async: further instances, each on a node of its own (``resources.remote_rollout_workers``)."""
    max_batch_size: int = 64
    """Sequences one engine decodes together (continuous batching slots)."""
    max_batch_tokens: int = 16384
    """Token budget of one engine: each live request reserves its prompt plus ``max_new_tokens``."""
    dispatch: str = "longest_first"
    """longest_first: a round's groups, longest predicted first, each to the instance that would finish
    it soonest (``length_prediction: from_stats``); fifo: issue order, to the instance with the
    fewest queued groups (``length_prediction: off``)."""
    length_prediction_error: float = 0.0
    """Log-space standard deviation of the predicted group length around the true one (0: exact)."""
    trainer_ranks: int = 1
    """Data-parallel trainer ranks, one device each (``resources.trainer_devices``)."""
    training: str = "ddp"
    """ddp: replicated weights, gradients all-reduced; sharded: ZeRO-3/FSDP (1.5x the traffic,
    the optimizer step split over the ranks)."""
    updates_per_step: int = 1
    """Optimizer updates per step, each with its all-reduce (``trainer.updates_per_step``)."""
    devices_per_node: int = 8
    """Devices sharing one intra-node fabric (a server; a supernode's size for a supernode)."""
    weight_publication: str = "unicast"
    """How a weight version reaches rollout instances: unicast (a send each: the runtime),
    broadcast (one over the slowest link), hierarchical (across nodes, then inside each)."""
    transfer: str = "leader"
    """Sample transfer to trainer ranks: leader (rank 0 takes the batch and scatters it: the runtime),
    flat (every rank takes its shard from the queue)."""
    shared_comm_domain: bool = False
    """Training traffic (all-reduce, the batch's scatter) and sampling traffic (weight publication,
    sample transfer) share one inter-node link, each slowing the other; False: separate domains."""
    offload_optimizer: bool = False
    """Colocated: the optimizer state goes to host memory while generating."""
    host_cores: int | None = None
    """The devices are processes of one CPU host with this many cores, one thread each: while more of
    them compute than there are cores, each computes at ``cores / computing`` speed (processor
    sharing). None: every device computes on its own (accelerators)."""
    host_background: float = 0.0
    """With ``host_cores``: cores' worth of other work computing on the host all along (a shared
    machine); it takes its share of the cores like one more process."""
    run_steps: int = 50
    """Steps of the whole run (``pipeline.steps``): the estimated run time is this times the step time."""
    sim_steps: int = 12
    """Training steps simulated."""
    warmup_steps: int = 2
    """First simulated steps left out of the steady-state figures (the queue's first fill)."""
    seed: int = 0
    """Seed of the response lengths and length-prediction errors."""

    def __post_init__(self) -> None:
        p = Problems()
        p.choice("mode", self.mode, MODES)
        p.choice("on_lag_exceeded", self.on_lag_exceeded, LAG_POLICIES)
        p.choice("dispatch", self.dispatch, DISPATCHES)
        p.choice("training", self.training, TRAININGS)
        p.choice("weight_publication", self.weight_publication, PUBLICATIONS)
        p.choice("transfer", self.transfer, TRANSFERS)
        p.integer("prompts_per_step", self.prompts_per_step, low=1, high=10_000_000)
        p.integer("group_size", self.group_size, low=1, high=1024)
        p.integer("prompt_tokens", self.prompt_tokens, low=1, high=1 << 20)
        p.integer("max_policy_lag", self.max_policy_lag, low=0, high=1000)
        p.integer("rollout_instances", self.rollout_instances, low=0, high=1 << 20)
        p.integer("remote_rollout_instances", self.remote_rollout_instances, low=0, high=1 << 20)
        p.integer("max_batch_size", self.max_batch_size, low=1, high=1 << 20)
        p.integer("max_batch_tokens", self.max_batch_tokens, low=2, high=1 << 40)
        p.number("length_prediction_error", self.length_prediction_error, low=0, high=5)
        p.integer("trainer_ranks", self.trainer_ranks, low=1, high=1 << 20)
        p.integer("updates_per_step", self.updates_per_step, low=1, high=64)
        p.integer("devices_per_node", self.devices_per_node, low=1, high=1 << 16)
        p.integer("run_steps", self.run_steps, low=1, high=10_000_000)
        p.integer("sim_steps", self.sim_steps, low=1, high=100_000)
        p.integer("warmup_steps", self.warmup_steps, low=0, high=100_000)
        p.integer("seed", self.seed, low=0, high=(1 << 63) - 1)
        for name in ("shared_comm_domain", "offload_optimizer"):
            if not isinstance(getattr(self, name), bool):
                p.add(name, f"must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.lengths, LengthDistribution):
            p.add("lengths", f"must be a LengthDistribution, got {type(self.lengths).__name__}")
        p.raise_if_any()  # the combinations below read these as valid
        if self.host_cores is not None:
            p.integer("host_cores", self.host_cores, low=1, high=1 << 20)
        p.number("host_background", self.host_background, low=0, high=1 << 20)
        if self.queue_capacity is not None:
            p.integer("queue_capacity", self.queue_capacity, low=self.samples_per_step, high=1 << 40)
        if self.warmup_steps >= self.sim_steps:
            p.add("warmup_steps", f"{self.warmup_steps} leaves no step of sim_steps={self.sim_steps} to measure")
        one_request = self.prompt_tokens + self.lengths.max_new_tokens
        if self.max_batch_tokens < one_request:
            p.add("max_batch_tokens", f"{self.max_batch_tokens} cannot hold one request ({one_request} tokens)")
        if self.mode == "async":
            if self.instances == 0:
                p.add("rollout_instances", "async mode needs at least one rollout instance (local or remote)")
            if self.max_batch_size < self.group_size:
                p.add("max_batch_size", f"an async instance starts a group whole: {self.group_size} sequences")
        elif not 1 <= self.rollout_instances <= self.trainer_ranks:
            p.add(
                "rollout_instances",
                f"{self.mode} mode runs its engines on the trainer's devices: 1 to trainer_ranks "
                f"({self.trainer_ranks}), got {self.rollout_instances}",
            )
        p.raise_if_any()

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def capacity(self) -> int:
        """The sample queue's capacity in samples."""
        return self.queue_capacity or 5 * self.samples_per_step

    @property
    def instances(self) -> int:
        """Every rollout instance of the configuration (async: local and remote)."""
        return self.rollout_instances + (self.remote_rollout_instances if self.mode == "async" else 0)

    @property
    def devices(self) -> int:
        """Devices the configuration occupies."""
        return self.trainer_ranks + (self.instances if self.mode == "async" else 0)

    def with_(self, **changes: Any) -> Config:
        """A copy with ``changes`` (validated again)."""
        return replace(self, **changes)

    @classmethod
    def from_spec(cls, spec: dict[str, Any], **model_inputs: Any) -> tuple[Config, SpecMapping]:
        """A configuration from a runtime spec as the platform stores it (``RunSpec.resolved()``), and
        what the mapping did with each field (see :mod:`capacity.spec_mapping`).

        ``model_inputs`` are Config fields a spec does not hold (``prompt_tokens``, ``lengths`` —
        whose ``max_new_tokens`` is replaced by the spec's — ``devices_per_node``, ``sim_steps``, ...).
        """
        mapping = map_spec(spec)
        values: dict[str, Any] = {**model_inputs, **mapping.values}
        max_new = values.pop("max_new_tokens", None)
        lengths = model_inputs.get("lengths") or _default_lengths()
        if max_new is not None:
            median = min(lengths.median, max_new)
            lengths = replace(lengths, median=median, max_new_tokens=max_new)
        values["lengths"] = lengths
        return cls(**values), mapping
