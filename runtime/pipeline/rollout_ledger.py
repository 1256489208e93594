"""The trainer's ledger of the ``async`` mode's rollout instances: who holds which group, what came back.

Every group issued to a rollout instance carries a ticket; the ledger holds the tickets outstanding,
and its receiver thread accepts a result only for a ticket still held by the instance that sent it,
so late results of withdrawn work (a dead instance's, or from before a rollback) are never trained
on. It also keeps the accounting read from each result message: generation throughput, bubbles and
the reward service's counters, which a checkpoint carries.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from multiprocessing import connection
from typing import Any

import torch

from runtime.contract import SAMPLES_DROPPED_REWARD
from runtime.pipeline.driver import pack_queue, unpack_queue
from runtime.rollout.scheduling import BubbleMeter, Dispatcher
from runtime.rollout.transfer import ShmCourier
from runtime.rollout.wire import from_bytes
from runtime.sample_queue import QueueClosed, SampleQueue
from runtime.weights.service import WeightService
from runtime.workloads.base import DataSource, Workload


@dataclass(eq=False)
class InstanceSlot:
    """One rollout instance process with its own work queue and result pipe."""

    rank: int
    proc: Any
    work_q: Any
    conn: Any  # the trainer's (receiving) end of the result pipe
    eof: bool = False  # its pipe is closed: the process is gone and everything it sent was read
    dead_since: float | None = None
    handled: bool = False  # its death was handled (work re-issued, replacement started)
    last_seen: float = field(default_factory=time.monotonic)  # its last message (heartbeats included)
    ready: bool = False  # it has built its engine (start-up, which may load a large model, is not timed)
    hung: bool = False  # killed for silence
    remote: bool = False  # a remote instance: ``proc`` and ``work_q`` are its RemotePeer (runtime.rollout.link)


class RolloutLedger:
    """Trainer-side bookkeeping of the rollout instances: who holds which group, what came back.

    Every group issued gets a ticket; ``owner`` maps the tickets outstanding to (slot, issue index).
    A result is accepted only for a ticket still outstanding and held by the instance that sent it;
    a dead instance's tickets and (at a rollback) all tickets are withdrawn, so their late results
    are dropped and the work issued again is the only copy ever trained on. The dispatcher, length
    predictor and bubble meter are updated here from each result message, under ``lock``.
    """

    def __init__(self, queue: SampleQueue, weights: WeightService, spec: Any, workload: Workload, source: DataSource):
        ranks = list(range(spec.resources.all_rollout_workers))
        self.queue = queue
        self.weights = weights
        self.workload = workload
        self.source = source  # unpacks the work items of a checkpoint
        self.group_size = spec.samples_per_item
        self.lock = threading.Lock()  # guards everything below + queue puts against a checkpoint snapshot
        self.slots: list[InstanceSlot] = []
        self.owner: dict[int, tuple[InstanceSlot, int]] = {}
        self.in_flight: dict[int, Any] = {}  # issue index -> work item
        self.next_ticket = 0
        self.discarded = 0  # groups dropped because their ticket was withdrawn
        self.gen_s = 0.0
        self.gen_tokens = 0
        self.dispatcher = Dispatcher(ranks)
        self.cost = workload.work_cost(spec)  # what dispatch weighs a work item by (llm: predicted tokens)
        self.meter = BubbleMeter(ranks)
        self.reward_dropped: list[int] = []  # issue indices of groups that lost a reward (this process)
        self.reward_dropped_before = 0  # groups that lost a reward before the checkpoint this run resumed from
        self.reward_counts: dict[str, float] = {}  # reward-service counters, run totals
        self.circuit_open: dict[int, float] = {}
        # rank -> the state its instance reported with its last accepted samples (runtime.rollout.instance)
        self.states: dict[int, bytes] = {}
        self.error: str | None = None
        self.done = False  # set once every rollout process has exited

    def add(self, slot: InstanceSlot) -> None:
        """A new instance, taking work from now on; the caller holds the lock."""
        self.slots.append(slot)
        self.dispatcher.restore(slot.rank)

    def predicted_cost(self, item: Any) -> float:
        """The work item's predicted generation work, in the units instances measure their throughput in."""
        return self.cost.predict(item)

    def receive(self) -> None:
        """Receiver thread: rollout messages -> queue, until every process has exited and its pipe is drained."""
        while True:
            with self.lock:
                open_slots = {s.conn: s for s in self.slots if not s.eof}
            if not open_slots:
                if self.done:
                    return
                time.sleep(0.05)
                continue
            for ready in connection.wait(list(open_slots), timeout=0.2):
                slot = open_slots[ready]
                try:
                    kind, rank, payload = slot.conn.recv()
                except (EOFError, OSError):  # the process is gone (exit, kill) and its pipe is drained
                    slot.conn.close()
                    if slot.remote:
                        slot.proc.gone()
                    else:
                        self.weights.reader_gone(slot.proc.pid)
                    with self.lock:
                        slot.eof = True
                    continue
                slot.last_seen = time.monotonic()
                slot.ready = True  # "ready" is its first message
                try:
                    self._handle(slot, kind, rank, payload)
                except Exception as exc:  # never die silently: the trainer would wait for samples for ever
                    self.error = f"receiving from rollout process {rank} failed: {type(exc).__name__}: {exc}"
                    self.queue.close()

    def _handle(self, slot: InstanceSlot, kind: str, rank: int, payload: Any) -> None:
        if kind == "samples":
            ref, info = payload
            blob = ShmCourier.unwrap(ref)
            if blob is None:  # its segment was swept: the sender died, and its work is issued again
                self.discarded += 1
                return
            samples = self.workload.unpack_samples(from_bytes(blob))
            with self.lock:
                self._account(slot, info)
                accepted: set[int] = set()
                dropped = set(info["dropped"])
                for ticket in info["tickets"] + info["dropped"]:
                    held = self.owner.get(ticket)
                    if held is None or held[0] is not slot:  # withdrawn: a dead instance's, or from before a rollback
                        self.discarded += 1
                        continue
                    del self.owner[ticket]
                    item = self.in_flight.pop(held[1])
                    self.dispatcher.complete(slot.rank, ticket, 0.0, 0.0)  # throughput: measured in _account
                    if ticket in dropped:
                        self.reward_dropped.append(item.index)
                    else:
                        accepted.add(item.index)
                kept = [s for s in samples if s.group_id in accepted]
                self.cost.observe(kept)
                if not kept:
                    return
                if info.get("state") is not None:
                    self.states[slot.rank] = info["state"]
                # never blocks: the trainer only issues work the queue has room for
                try:
                    if not self.queue.put(kept, timeout=60):
                        self.error = "sample queue stayed full for 60 s (credit accounting broken)"
                except QueueClosed:
                    return
        elif kind == "error":
            self.error = f"rollout process {rank} failed:\n{payload}"
            self.queue.close()

    def _account(self, slot: InstanceSlot, info: dict[str, Any]) -> None:
        """Throughput, bubbles and reward counters of one result message (work done, accepted or not)."""
        self.gen_s += info["gen_s"]
        self.gen_tokens += info["tokens"]
        self.dispatcher.measure(slot.rank, info["tokens"], info["gen_s"])
        self.meter.record_work(slot.rank, info["gen_s"], info["real"], info["allocated"])
        for wait in info["waits"]:
            self.meter.record_wait(wait)
        for key, delta in info["reward"].items():
            if key == "reward/circuit_open":
                self.circuit_open[slot.rank] = delta
            else:
                self.reward_counts[key] = self.reward_counts.get(key, 0.0) + delta

    def withdraw(self, slot: InstanceSlot | None = None) -> list[Any]:
        """Take back the work held by ``slot`` (every slot's when None); caller holds the lock."""
        items: list[Any] = []
        for ticket, (holder, index) in list(self.owner.items()):
            if slot is None or holder is slot:
                del self.owner[ticket]
                items.append(self.in_flight.pop(index))
        if slot is None:
            self.dispatcher.forget()
        else:
            self.dispatcher.remove(slot.rank)
        return sorted(items, key=lambda it: it.index)

    def counters_state(self) -> dict[str, Any]:
        """The reward counters as a checkpoint keeps them (caller holds the lock)."""
        return {
            "dropped_groups": self.reward_dropped_before + len(self.reward_dropped),
            "counts": dict(self.reward_counts),
        }

    def load_counters(self, state: dict[str, Any] | None) -> None:
        """Counters from a checkpoint (absent in older ones: from zero); caller holds the lock."""
        state = state or {}
        self.reward_dropped_before = int(state.get("dropped_groups", 0)) - len(self.reward_dropped)
        self.reward_counts = {k: float(v) for k, v in state.get("counts", {}).items()}

    def checkpoint_state(self) -> dict[str, Any]:
        """The queue, the work in flight and the reward counters, taken together under the lock."""
        with self.lock:
            snap = self.queue.snapshot()
            in_flight = [it.pack() for it in self.in_flight.values()]
            counters = self.counters_state()
            states = dict(self.states)
        return {
            "queue": pack_queue(snap, self.workload),
            "in_flight": in_flight,
            "reward": counters,
            # bytes as uint8 tensors: what torch.load(weights_only=True) reads
            "instance_states": {rank: torch.frombuffer(bytearray(b), dtype=torch.uint8) for rank, b in states.items()},
        }

    def load_state(self, state: dict[str, Any], offset: int = 0) -> list[Any]:
        """A checkpoint's queue and reward counters; returns its work in flight, to be issued again first.
        ``offset`` renumbers weight versions (a rollback's)."""
        with self.lock:
            self.queue.clear()
            self.queue.restore(unpack_queue(state["queue"], self.workload, offset))
            self.load_counters(state.get("reward"))
            # absent in checkpoints from before instances reported state: they start fresh
            saved = state.get("instance_states", {})
            self.states = {int(rank): bytes(t.numpy().tobytes()) for rank, t in saved.items()}
        in_flight = [self.source.unpack_item(d) for d in state["in_flight"]]
        for item in in_flight:
            item.min_version += offset
        return in_flight

    def take_gen_counters(self) -> tuple[float, int]:
        with self.lock:
            out = (self.gen_s, self.gen_tokens)
            self.gen_s, self.gen_tokens = 0.0, 0
            return out

    def step_metrics(self, active: list[int]) -> dict[str, float]:
        """This step's bubbles, and the run's reward-service counters so far."""
        with self.lock:
            bubbles = self.meter.report(among=active)
            out = {f"rollout/{k}": v for k, v in bubbles.items()}
            out[SAMPLES_DROPPED_REWARD] = (self.reward_dropped_before + len(self.reward_dropped)) * self.group_size
            out.update(self.reward_counts)
            if self.circuit_open:
                out["reward/circuit_open"] = max(self.circuit_open.values())
        return out
