"""The gym workload's sampling worker (async mode): segments from a vector env of its own.

Hosted by :func:`runtime.rollout.instance.rollout_process` (the same process, messages and supervision
as an LLM rollout instance: heartbeats, hang and death detection, replacement, tickets, epochs). Each
work item is one segment: ``env.segment_length`` steps of ``env.num_envs`` env copies. Before every env
step the worker takes the newest published weights (:meth:`WeightSubscriber.switch`), so a segment may
span versions; each step records the version that chose its actions and the segment's ``version`` is
the oldest of them (what the sample queue's lag bound reads). A work item with a ``min_version`` (the
``throttle`` policy) waits for those weights first.

Each worker's envs are seeded by (run seed, rank + 1): distinct from the other workers' and from the sync
mode's sampler (worker 0). Every ``samples`` message carries the sampler's state after its segment
(``info["state"]``: the action generator, each copy's episode seed and the actions taken in it); the
trainer keeps the last accepted one of each rank, in its checkpoints too, and a worker that replaces a
dead one, or starts a resumed run, continues from it — the episodes go on where the last segment
trained left them. A dead worker's unfinished segment was withdrawn by the trainer and is sampled again,
so no segment is lost or trained on twice.

Where the worker runs: a spawned process of the trainer's host (:func:`local_instance`, from
:mod:`runtime.rollout.instance`), or a process of another host (:class:`RemoteGymRollout`, from
:mod:`runtime.rollout.remote`), which keeps its envs across sessions with (restarted) trainers.

The ``samples`` message's ``info`` (read by :mod:`runtime.pipeline.rollout_ledger`): ``tickets`` (one),
``dropped`` (none: no reward service), ``gen_s`` (seconds sampling), ``tokens`` / ``real`` /
``allocated`` (env steps: a vector env wastes no slot), ``waits`` (none), ``throttled_s``, ``reward``
({}) and ``state``.
"""

from __future__ import annotations

import os
import queue as std_queue
import time
from typing import Any

import torch

from runtime.rollout.wire import BEAT_S, EPOCH, from_bytes, shm_prefix, to_bytes, trainer_pid
from runtime.spec import RunSpec
from runtime.workloads.gym.build import PolicyEngine, describe_env, learner_config, one_env
from runtime.workloads.gym.data import SegmentItem
from runtime.workloads.gym.envs import make_vector_env
from runtime.workloads.gym.networks import Policy
from runtime.workloads.gym.sampler import SegmentSampler
from runtime.workloads.gym.segments import Segment, pack_segments


class GymRolloutInstance:
    """One sampling worker's loop over its policy (``engine``) and envs (``sampler``)."""

    def __init__(
        self,
        rank: int,
        engine: PolicyEngine,
        sampler: SegmentSampler,
        sub: Any,
        conn: Any,
        flags: Any,
        courier: Any = None,
        owns_envs: bool = True,
    ):
        self.rank, self.engine, self.sampler = rank, engine, sampler
        self.sub, self.conn, self.flags = sub, conn, flags
        self.courier = courier  # shared memory for large segments when the trainer is on this host
        self.owns_envs = owns_envs  # a remote worker's envs outlive the session
        self.last_beat = 0.0
        self.throttled_s = 0.0

    # ---- the sampler's policy source ----
    def current(self) -> tuple[Policy, int]:
        """The newest published weights at every env step (and a heartbeat while a long segment runs)."""
        self.sub.switch(self.engine.update_weights)
        self.beat()
        return self.engine.policy, self.engine.version

    def beat(self) -> None:
        now = time.monotonic()
        if now - self.last_beat >= BEAT_S:
            self.conn.send(("beat", self.rank, None))
            self.last_beat = now

    # ---- the loop ----
    def run(self, work_q: Any, ended: Any) -> None:
        """Take work as it comes; sample the oldest item whose weights are available. A throttled item waits
        for its weights without holding back the items behind it (they may be what the trainer needs first)."""
        held: list[tuple[int, int, SegmentItem]] = []  # (epoch, ticket, item) taken and not yet sampled
        while not ended():
            self.beat()
            try:
                msg = work_q.get(timeout=0.2) if not held else work_q.get_nowait()
                while True:
                    if msg is None:
                        return
                    epoch, entries = msg
                    held += [(epoch, ticket, SegmentItem.unpack(packed)) for ticket, packed in entries]
                    msg = work_q.get_nowait()
            except std_queue.Empty:
                pass
            held = [h for h in held if h[0] == self.flags[EPOCH]]  # older epochs: withdrawn by a rollback
            ready = [h for h in held if h[2].min_version <= self.sub.latest_version]
            if not ready:
                if held:  # only throttled work: wait for the weights it needs
                    waited = time.perf_counter()
                    self.sub.wait_for(min(h[2].min_version for h in held), timeout=0.2)
                    self.throttled_s += time.perf_counter() - waited
                continue
            entry = min(ready, key=lambda h: h[2].index)
            held.remove(entry)
            _, ticket, item = entry
            started = time.perf_counter()
            with torch.no_grad():
                segment = self.sampler.sample(self, sample_id=item.index, group_id=item.index)
            self.send(ticket, segment, time.perf_counter() - started)

    def send(self, ticket: int, segment: Segment, gen_s: float) -> None:
        steps = self.sampler.steps_per_segment
        info = {
            "tickets": [ticket],
            "dropped": [],
            "group_tokens": {ticket: steps},
            "gen_s": gen_s,
            "tokens": steps,
            "real": steps,
            "allocated": steps,
            "waits": [],
            "throttled_s": self.throttled_s,
            "reward": {},
            "state": to_bytes(self.sampler.state_dict()),  # where the next segment starts
        }
        self.throttled_s = 0.0
        blob = to_bytes(pack_segments([segment]))
        self.conn.send(("samples", self.rank, (self.courier.wrap(blob) if self.courier else blob, info)))

    def close(self) -> None:
        if self.owns_envs:
            self.sampler.envs.close()


def sampling_worker(rank: int, spec: RunSpec, device: torch.device) -> tuple[PolicyEngine, SegmentSampler]:
    """Worker ``rank``'s policy and envs, its envs seeded apart from every other worker's."""
    space = describe_env(spec)
    engine = PolicyEngine(space, learner_config(spec), device)
    envs = make_vector_env(lambda: one_env(spec), spec.env.num_envs)
    return engine, SegmentSampler(envs, space, spec.env.segment_length, seed=spec.seed, worker=rank + 1)


def local_instance(
    rank: int, spec: RunSpec, device: torch.device, sub: Any, conn: Any, flags: Any, state: bytes | None
) -> GymRolloutInstance:
    """A worker in a process the trainer spawned; ``state``: where this rank's last accepted segment left off."""
    engine, sampler = sampling_worker(rank, spec, device)
    if state is not None:
        sampler.load_state_dict(from_bytes(state))
    courier = None
    if spec.pipeline.transfer_shm_min_bytes is not None:
        from runtime.rollout.transfer import ShmCourier

        courier = ShmCourier(shm_prefix(trainer_pid(), rank, os.getpid()), spec.pipeline.transfer_shm_min_bytes)
    return GymRolloutInstance(rank, engine, sampler, sub, conn, flags, courier)


class RemoteGymRollout:
    """A worker on another host: its policy and envs, kept across sessions with (restarted) trainers."""

    def __init__(self, rank: int, spec: RunSpec, device: torch.device):
        self.rank = rank
        self.engine, self.sampler = sampling_worker(rank, spec, device)

    def session(self, sub: Any, conn: Any, flags: Any, state: bytes | None = None) -> GymRolloutInstance:
        """The loop for one trainer. With ``state`` (the trainer's record of this rank) the envs continue from
        it; without (the trainer has none yet) they go on from where this process left them."""
        if state is not None:
            self.sampler.load_state_dict(from_bytes(state))
        return GymRolloutInstance(self.rank, self.engine, self.sampler, sub, conn, flags, owns_envs=False)

    def close(self) -> None:
        self.sampler.envs.close()


class SegmentCost:
    """Every segment asks for the same work: ``num_envs x segment_length`` env steps."""

    def __init__(self, spec: RunSpec):
        self.steps = spec.env.num_envs * spec.env.segment_length

    def predict(self, item: Any) -> float:
        return float(self.steps)

    def observe(self, samples: list[Any]) -> None:
        pass  # nothing to learn: a segment's length is fixed


class NoProbe:
    """The async mode's consistency probe, for a workload whose sampler and learner run the same module."""

    def measure(self, samples: list[Any], weights: Any) -> dict[str, float]:
        return {}
