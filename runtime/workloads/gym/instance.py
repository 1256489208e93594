"""The gym workload's sampling worker (async mode): segments from a vector env of its own.

Hosted by :func:`runtime.rollout.instance.rollout_process` (the same process, messages and supervision
as an LLM rollout instance: heartbeats, hang and death detection, replacement, tickets, epochs). Each
work item is one segment: ``env.segment_length`` steps of ``env.num_envs`` env copies. Before every env
step the worker takes the newest published weights (:meth:`WeightSubscriber.switch`), so a segment may
span versions; each step records the version that chose its actions and the segment's ``version`` is
the oldest of them (what the sample queue's lag bound reads). A work item with a ``min_version`` (the
``throttle`` policy) waits for those weights first.

Each worker's envs are seeded by (run seed, rank + 1): distinct from the other workers' and from the sync
mode's sampler (worker 0). A replaced worker starts fresh episodes; its unfinished segment was withdrawn
by the trainer and is sampled again by another worker, so no segment is lost or trained on twice.

The ``samples`` message's ``info`` (read by :mod:`runtime.pipeline.rollout_ledger`): ``tickets`` (one),
``dropped`` (none: no reward service), ``gen_s`` (seconds sampling), ``tokens`` / ``real`` /
``allocated`` (env steps: a vector env wastes no slot), ``waits`` (none), ``throttled_s`` and ``reward`` ({}).
"""

from __future__ import annotations

import os
import queue as std_queue
import time
from typing import Any

import torch

from runtime.rollout.wire import BEAT_S, EPOCH, shm_prefix, to_bytes
from runtime.spec import RunSpec
from runtime.workloads.gym.build import PolicyEngine, describe_env, learner_config
from runtime.workloads.gym.data import SegmentItem
from runtime.workloads.gym.envs import make_env, make_vector_env
from runtime.workloads.gym.networks import Policy
from runtime.workloads.gym.sampler import SegmentSampler
from runtime.workloads.gym.segments import Segment, pack_segments


class GymRolloutInstance:
    """One sampling worker's loop; built inside the spawned process by :func:`build_gym_instance`."""

    def __init__(self, rank: int, spec: RunSpec, device: torch.device, sub: Any, conn: Any, flags: Any):
        self.rank, self.sub, self.conn, self.flags = rank, sub, conn, flags
        space = describe_env(spec)
        self.engine = PolicyEngine(space, learner_config(spec), device)
        envs = make_vector_env(lambda: make_env(spec.env.id, spec.env.entry_point, spec.env.kwargs), spec.env.num_envs)
        self.sampler = SegmentSampler(envs, space, spec.env.segment_length, seed=spec.seed, worker=rank + 1)
        self.courier = None
        if spec.pipeline.transfer_shm_min_bytes is not None:  # the trainer is on this host (a local worker)
            from runtime.rollout.transfer import ShmCourier

            self.courier = ShmCourier(shm_prefix(os.getppid(), rank, os.getpid()), spec.pipeline.transfer_shm_min_bytes)
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
        }
        self.throttled_s = 0.0
        blob = to_bytes(pack_segments([segment]))
        self.conn.send(("samples", self.rank, (self.courier.wrap(blob) if self.courier else blob, info)))

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
