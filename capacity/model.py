"""The pipeline simulation: trainer, rollout engines, sample queue and links as simpy processes.

One :class:`Pipeline` simulates ``config.sim_steps`` training steps of one configuration on one set of
costs and answers a :class:`~capacity.result.Result` from the steps after the warm-up. It follows
the runtime's modes (``runtime/pipeline/``):

* ``sync`` — generate the step's prompts on engines on the trainer's devices (in chunks of
  ``max_batch_size // group_size`` prompts, as ``RolloutWorker.generate`` does), train, copy the new
  weights into the engines (a local copy), repeat;
* ``colocated`` — the same on shared parameters: no copy, but a switch each way between generation
  and training, and with ``offload_optimizer`` the optimizer state's trip to host memory and back;
* ``async`` — engines on devices of their own take groups issued while the sample queue has room
  (credits: queued + in-flight samples within its capacity); under ``throttle`` a group carries the
  oldest weight version allowed to generate it (``next take + ahead // step samples - lag``, as
  ``InstancePool.top_up``); finished groups are sent to the queue (a FIFO server: its per-request
  cost and the bytes); the trainer takes a step's samples no more than ``max_policy_lag`` versions
  old — staler ones are dropped (``drop``) or their prompts issued again first with the current
  weights (``throttle``, ``sync``) — trains, stages the new weights (blocking) and publishes them in
  the background; an engine loads a version when it arrives, at a step boundary.

In every mode the leader's batch is scattered to the ranks (``transfer: leader``) or each rank takes
its shard from the queue (``flat``); each rank trains on its interleaved shard (the slowest decides),
and each update all-reduces the gradients (``ddp``) or gathers parameters and reduce-scatters
gradients (``sharded``). The inter-node part of the trainer's collectives and of the sampling side's
transfers are flows on :class:`~capacity.links.SharedLink` s: one link for both with
``shared_comm_domain``, one each otherwise. With ``host_cores`` (a CPU machine whose one-thread
processes may outnumber its cores) the trainer's and the engines' compute are jobs on one
:class:`~capacity.engine.HostCores`, which shares the cores among the processes computing at once.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from capacity.comm import (
    CommPlan,
    Topology,
    allreduce_plan,
    publication_plan,
    queue_takes_per_step,
    reduce_scatter_plan,
    scatter_plan,
)
from capacity.config import Config
from capacity.costs import Costs
from capacity.engine import Group, HostCores, RolloutEngine, compute
from capacity.links import SharedLink
from capacity.result import (
    ALLREDUCE,
    GENERATE,
    ROLLOUT_AWAIT,
    ROLLOUT_GENERATE,
    ROLLOUT_IDLE,
    ROLLOUT_LOAD,
    SPLIT_KEYS,
    SWITCH,
    TRAIN,
    TRANSFER,
    WAIT,
    WEIGHT_SYNC,
    Result,
    bottleneck_of,
)
from capacity.server import FifoServer


class ModelError(RuntimeError):
    """The simulation could not finish (a configuration that can never produce a step)."""


@dataclass
class _Step:
    ended_at: float = 0.0
    split: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SPLIT_KEYS, 0.0))
    staleness: list[int] = field(default_factory=list)
    response_tokens: int = 0
    dropped: int = 0


def placement(config: Config) -> list[int]:
    """The device of each rollout engine. Trainer ranks hold devices ``0 .. ranks - 1``, nodes of
    ``devices_per_node`` in order. sync / colocated: engine ``i`` on trainer device ``i``; async:
    local instances on the devices after the trainer's, remote ones each on a node of its own after
    those."""
    if config.mode != "async":
        return list(range(config.rollout_instances))
    first = config.trainer_ranks
    local = [first + i for i in range(config.rollout_instances)]
    per_node = config.devices_per_node
    next_node = math.ceil((first + config.rollout_instances) / per_node)
    remote = [(next_node + i) * per_node for i in range(config.remote_rollout_instances)]
    return local + remote


class Pipeline:
    """One configuration's simulation; :meth:`run` returns its result."""

    def __init__(self, config: Config, costs: Costs):
        self.config, self.costs = config, costs
        self.env = simpy.Environment()
        self.topo = Topology(config.devices_per_node, costs.intra_node, costs.inter_node)
        bandwidth = costs.inter_node.bandwidth_bytes_per_s
        self.training_link = SharedLink(self.env, bandwidth)
        self.sampling_link = self.training_link if config.shared_comm_domain else SharedLink(self.env, bandwidth)
        self.queue_server = FifoServer(self.env)
        self.devices = placement(config)
        self.cores = (
            HostCores(self.env, config.host_cores, config.host_background) if config.host_cores is not None else None
        )
        self.staged_at: dict[int, float] = {}  # version -> when the trainer staged it
        self.engines = [
            RolloutEngine(
                self.env,
                costs,
                max_batch_size=config.max_batch_size,
                max_batch_tokens=config.max_batch_tokens,
                max_new_tokens=config.lengths.max_new_tokens,
                on_done=self._group_done,
                staged_at=self.staged_at,
                cores=self.cores,
            )
            for _ in self.devices
        ]
        self.version = 0
        self.steps: list[_Step] = []
        self.rollout_at_warmup = (0.0, 0.0, 0.0)
        # async state
        self.queue: deque[Group] = deque()
        self.in_flight = 0
        self.reissue: deque[Group] = deque()
        self.next_index = 0
        self.queue_changed = self.env.event()
        self.version_staged = self.env.event()
        self._rng = np.random.default_rng(config.seed)
        self._drawn: list[tuple[list[int], float]] = []

    # ---- workload ----
    def new_group(self, index: int, min_version: int = 0) -> Group:
        """Prompt ``index``'s group: its lengths (and prediction error) depend only on the seed and
        the index, so every mode, and a prompt issued again, sees the same work."""
        cfg = self.config
        while len(self._drawn) <= index:  # drawn in index order from one stream
            lengths = cfg.lengths.group(self._rng, cfg.group_size)
            error = self._rng.normal(0.0, cfg.length_prediction_error) if cfg.length_prediction_error else 0.0
            self._drawn.append((lengths, error))
        lengths, error = self._drawn[index]
        noise = 1.0 if cfg.dispatch == "fifo" else math.exp(error)
        predicted = cfg.group_size * cfg.prompt_tokens + sum(lengths) * noise
        return Group(index, list(lengths), cfg.prompt_tokens, predicted, min_version=min_version)

    def dispatch(self, groups: list[Group]) -> None:
        """Each group to an engine by the dispatch rule, from the work each has queued."""
        by_fifo = self.config.dispatch == "fifo"
        loads = [float(e.queued_groups) if by_fifo else e.queued_cost for e in self.engines]
        for group, i in assign(groups, loads, self.config.dispatch):
            group.engine = i
            self.engines[i].submit(group)

    def _group_done(self, group: Group) -> None:
        if group.finished is not None:
            group.finished.succeed()
        if self.config.mode == "async":
            self.env.process(self._send_to_queue(group))

    # ---- communication helpers ----
    def communicate(self, plan: CommPlan, link: SharedLink) -> Generator[Any, Any, None]:
        if plan.other_s > 0:
            yield self.env.timeout(plan.other_s)
        if plan.inter_bytes > 0:
            yield link.send(plan.inter_bytes)

    def sample_bytes(self, groups: list[Group]) -> float:
        return sum(g.tokens for g in groups) * self.costs.sample_bytes_per_token

    def queue_request_s(self, nbytes: float) -> float:
        return self.costs.queue_op_s + nbytes / self.costs.intra_node.bandwidth_bytes_per_s

    # ---- the trainer's step, shared by the modes ----
    def train(self, groups: list[Group], step: _Step) -> Generator[Any, Any, None]:
        """Transfer the batch to the ranks, train each update, all-reduce."""
        cfg, costs, env = self.config, self.costs, self.env
        ranks = cfg.trainer_ranks
        started = env.now
        if cfg.mode == "async":
            yield from self._take_from_queue(groups)
        if cfg.transfer == "leader" and ranks > 1:
            yield from self.communicate(scatter_plan(self.sample_bytes(groups), ranks, self.topo), self.training_link)
        step.split[TRANSFER] += env.now - started
        per_rank = [0] * ranks
        for k, tokens in enumerate(t for g in groups for t in _sample_tokens(g)):
            per_rank[k % ranks] += tokens  # interleaved shards, as TrainerGroup cuts them
        compute_s = max(per_rank) * costs.train_s_per_token / cfg.updates_per_step
        optimizer_s = costs.optimizer_step_s / (ranks if cfg.training == "sharded" else 1)
        for _ in range(cfg.updates_per_step):
            started = env.now
            yield compute(env, self.cores, compute_s + optimizer_s)  # longer when host cores are oversubscribed
            step.split[TRAIN] += env.now - started
            started = env.now
            yield from self.communicate(self._update_plan(), self.training_link)
            step.split[ALLREDUCE] += env.now - started

    def _update_plan(self) -> CommPlan:
        cfg, costs = self.config, self.costs
        if cfg.training == "ddp":
            return allreduce_plan(costs.all_reduce_bytes, cfg.trainer_ranks, self.topo)
        gather = reduce_scatter_plan(costs.weight_bytes, cfg.trainer_ranks, self.topo)
        return gather + gather + reduce_scatter_plan(costs.all_reduce_bytes, cfg.trainer_ranks, self.topo)

    def _take_from_queue(self, groups: list[Group]) -> Generator[Any, Any, None]:
        """The queue's requests for this batch: one (the leader) or one per rank, served in turn."""
        takes = queue_takes_per_step(self.config.trainer_ranks, self.config.transfer)
        service = self.queue_request_s(self.sample_bytes(groups) / takes)
        requests = [self.env.process(self.queue_server.serve(service)) for _ in range(takes)]
        yield self.env.all_of(requests)

    def record(self, step: _Step, groups: list[Group]) -> None:
        step.ended_at = self.env.now
        step.staleness = [self.version - g.version for g in groups for _ in g.lengths]
        step.response_tokens = sum(g.response_tokens for g in groups)
        self.version += 1
        self.steps.append(step)
        if len(self.steps) == self.config.warmup_steps:
            self.rollout_at_warmup = self._rollout_totals()

    def _rollout_totals(self) -> tuple[float, float, float]:
        """Seconds generating, loading weights and awaiting them, summed over the engines."""
        spent = [engine.time_spent() for engine in self.engines]
        return (sum(s[0] for s in spent), sum(s[1] for s in spent), sum(s[2] for s in spent))

    # ---- lock-step modes ----
    def lock_step(self) -> Generator[Any, Any, None]:
        cfg, costs, env = self.config, self.costs, self.env
        colocated = cfg.mode == "colocated"
        offload = colocated and cfg.offload_optimizer
        for _ in range(cfg.sim_steps):
            step = _Step()
            started = env.now
            if colocated:
                yield env.timeout(costs.colocated_switch_s + (costs.optimizer_offload_s if offload else 0.0))
            step.split[SWITCH] += env.now - started
            started = env.now
            groups = [self.new_group(self.next_index + i) for i in range(cfg.prompts_per_step)]
            self.next_index += cfg.prompts_per_step
            yield from self._generate_in_chunks(groups)
            step.split[GENERATE] += env.now - started
            started = env.now
            if colocated:
                yield env.timeout(costs.colocated_switch_s + (costs.optimizer_reload_s if offload else 0.0))
            step.split[SWITCH] += env.now - started
            yield from self.train(groups, step)
            if not colocated:  # each engine's device copies the new weights into it
                copy_s = costs.local.time_s(costs.weight_bytes)
                yield env.timeout(copy_s)
                step.split[WEIGHT_SYNC] += copy_s
            self.record(step, groups)
            for engine in self.engines:
                engine.set_version(self.version)

    def _generate_in_chunks(self, groups: list[Group]) -> Generator[Any, Any, None]:
        """Dispatch the step's groups over the engines; each engine generates its share in chunks of
        ``max_batch_size // group_size`` prompts, one after the other."""
        for group in groups:
            group.finished = self.env.event()
        shares: list[list[Group]] = [[] for _ in self.engines]
        for group, i in assign(groups, [0.0] * len(self.engines), self.config.dispatch):
            shares[i].append(group)
        chunk = max(1, self.config.max_batch_size // self.config.group_size)
        runs = [
            self.env.process(self._run_chunks(engine, share, chunk))
            for engine, share in zip(self.engines, shares, strict=True)
            if share
        ]
        yield self.env.all_of(runs)

    def _run_chunks(self, engine: RolloutEngine, groups: list[Group], chunk: int) -> Generator[Any, Any, None]:
        for start in range(0, len(groups), chunk):
            part = groups[start : start + chunk]
            for group in part:
                engine.submit(group)
            yield self.env.all_of([g.finished for g in part if g.finished is not None])

    # ---- async ----
    def async_trainer(self) -> Generator[Any, Any, None]:
        cfg, costs, env = self.config, self.costs, self.env
        B = cfg.samples_per_step
        for _ in range(cfg.sim_steps):
            step = _Step()
            started = env.now
            while True:
                self.top_up(self.version)
                groups = self._fresh_batch(B // cfg.group_size, step)
                if groups is not None:
                    break
                self.top_up(self.version)  # the stale ones moved out made room
                yield self.queue_changed
            step.split[WAIT] += env.now - started
            self.top_up(self.version + 1)  # refill at once so the instances keep generating
            yield from self.train(groups, step)
            stage_s = costs.local.time_s(costs.weight_bytes)
            yield env.timeout(stage_s)
            step.split[WEIGHT_SYNC] += stage_s
            self.record(step, groups)
            self.staged_at[self.version] = env.now
            self._poke_publisher()

    def _fresh_batch(self, n_groups: int, step: _Step) -> list[Group] | None:
        """Move stale groups out (dropped, or issued again first), then the ``n_groups`` oldest if
        there are that many."""
        cfg = self.config
        fresh: deque[Group] = deque()
        for group in self.queue:
            if self.version - group.version > cfg.max_policy_lag:
                step.dropped += len(group.lengths)
                if cfg.on_lag_exceeded != "drop":  # throttle, sync: the prompt again, current weights
                    self.reissue.append(self.new_group(group.index, min_version=self.version))
            else:
                fresh.append(group)
        self.queue = fresh
        if len(self.queue) < n_groups:
            return None
        return [self.queue.popleft() for _ in range(n_groups)]

    def top_up(self, next_take: int) -> None:
        """Issue groups while the queue has room for them (reissued prompts first)."""
        cfg = self.config
        G, B = cfg.group_size, cfg.samples_per_step
        issued: list[Group] = []
        while True:
            ahead = (len(self.queue) + self.in_flight) * G
            if cfg.capacity - ahead < G:
                break
            floor = max(0, next_take + ahead // B - cfg.max_policy_lag) if cfg.on_lag_exceeded == "throttle" else 0
            if self.reissue:
                group = self.reissue.popleft()
                group.min_version = max(group.min_version, floor)
            else:
                group = self.new_group(self.next_index, min_version=floor)
                self.next_index += 1
            self.in_flight += 1
            issued.append(group)
        if issued:
            self.dispatch(issued)

    def _send_to_queue(self, group: Group) -> Generator[Any, Any, None]:
        """A finished group to the sample queue: across the sampling side's inter-node link first when
        its engine is on another node than the trainer's leader, then one request of the queue."""
        nbytes = self.sample_bytes([group])
        if self.topo.node_of(self.devices[group.engine]) != self.topo.node_of(0):
            yield self.env.timeout(self.costs.inter_node.latency_s)
            yield self.sampling_link.send(nbytes)
        yield from self.queue_server.serve(self.queue_request_s(nbytes))
        self.in_flight -= 1
        self.queue.append(group)
        self._notify()

    def _notify(self) -> None:
        changed, self.queue_changed = self.queue_changed, self.env.event()
        changed.succeed()

    def _poke_publisher(self) -> None:
        if not self.version_staged.triggered:
            self.version_staged.succeed()

    def publisher(self) -> Generator[Any, Any, None]:
        """Deliver staged versions to every engine in the background, newest wins: a version staged
        while another is on its way waits, and only the newest of those goes next (as the runtime's
        shared-memory subscribers and remote links do)."""
        costs, delivered = self.costs, 0
        plan = publication_plan(costs.weight_bytes, 0, self.devices, self.topo, self.config.weight_publication)
        load_s = costs.local.time_s(costs.weight_bytes)
        while True:
            if self.version <= delivered:
                self.version_staged = self.env.event()
                yield self.version_staged
                continue
            version = self.version
            yield from self.communicate(plan, self.sampling_link)
            for engine in self.engines:
                engine.offer_weights(version, load_s)
            delivered = version

    # ---- run ----
    def run(self) -> Result:
        cfg = self.config
        if cfg.mode == "async":
            self.env.process(self.publisher())
        trainer = self.env.process(self.async_trainer() if cfg.mode == "async" else self.lock_step())
        try:
            self.env.run(until=trainer)
        except RuntimeError as exc:  # simpy: nothing left to happen and the trainer not done
            raise ModelError(f"the simulation stalled after {len(self.steps)} steps: {exc}") from None
        return self.result()

    def result(self) -> Result:
        cfg = self.config
        measured = self.steps[cfg.warmup_steps :]
        start = self.steps[cfg.warmup_steps - 1].ended_at if cfg.warmup_steps else 0.0
        window = measured[-1].ended_at - start
        n = len(measured)
        step_time = window / n
        split = {key: sum(s.split[key] for s in measured) / n for key in SPLIT_KEYS}
        staleness = [x for s in measured for x in s.staleness]
        per_engine_step = n * len(self.engines)
        generate, load, wait = (
            (now - then) / per_engine_step
            for now, then in zip(self._rollout_totals(), self.rollout_at_warmup, strict=True)
        )
        rollout = {
            ROLLOUT_GENERATE: generate,
            ROLLOUT_LOAD: load,
            ROLLOUT_AWAIT: wait,
            ROLLOUT_IDLE: max(0.0, step_time - generate - load - wait),
        }
        return Result(
            samples_per_s=cfg.samples_per_step / step_time,
            tokens_per_s=sum(s.response_tokens for s in measured) / window,
            step_time_s=step_time,
            time_split=split,
            rollout_split=rollout,
            mean_staleness=sum(staleness) / len(staleness),
            max_staleness=max(staleness),
            dropped_samples=sum(s.dropped for s in measured),
            bottleneck=bottleneck_of(split, rollout),
            run_time_s=cfg.run_steps * step_time,
            steps_measured=n,
        )


def _sample_tokens(group: Group) -> list[int]:
    return [group.prompt_tokens + length for length in group.lengths]


def assign(groups: list[Group], loads: list[float], rule: str) -> list[tuple[Group, int]]:
    """The engine index of each group, ``loads`` (each engine's queued work) updated as it goes.

    ``longest_first``: groups by predicted tokens, longest first, each to the engine with the least
    predicted work queued (the engines are alike, so that is the soonest to finish it: the runtime's
    ``Dispatcher``); ``fifo``: in issue order, each to the engine with the fewest queued groups."""
    by_length = rule == "longest_first"
    ordered = sorted(groups, key=lambda g: -g.predicted) if by_length else groups
    out: list[tuple[Group, int]] = []
    for group in ordered:
        i = min(range(len(loads)), key=loads.__getitem__)
        loads[i] += group.predicted if by_length else 1.0
        out.append((group, i))
    return out


def simulate(config: Config, costs: Costs) -> Result:
    """Simulate ``config`` on ``costs`` and return its steady-state result."""
    return Pipeline(config, costs).run()
