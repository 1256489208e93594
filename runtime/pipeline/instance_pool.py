"""The ``async`` mode's rollout instances, local and remote, as one supervised pool.

Local instances are spawned processes (:mod:`runtime.rollout.instance`) reading weights from the
shared-memory weight service; remote ones join through :mod:`runtime.pipeline.remote_peers` and are
supervised here alike. The pool issues work while the queue has room for it (credits), each group
to the active instance that would finish it soonest (:mod:`runtime.rollout.scheduling`), and keeps
as many instances active as the queue watermark asks for. An instance that dies or goes silent is
replaced, up to ``resources.rollout_restarts`` per rank, and its unfinished work goes back to the
prompt source to be issued again first, so no sample is lost or trained on twice.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, cast

import torch

from runtime import processes
from runtime.pipeline.driver import PipelineError, RunContext
from runtime.pipeline.rollout_ledger import InstanceSlot, RolloutLedger
from runtime.rollout.instance import rollout_process
from runtime.rollout.scheduling import InstanceScaler
from runtime.rollout.transfer import sweep
from runtime.rollout.wire import EPOCH, STOP, shm_prefix
from runtime.sample_queue import SampleQueue
from runtime.spec import RunSpec
from runtime.weights.service import shared_weights_mode


class InstancePool:
    """Spawns, feeds, scales, supervises and stops the rollout instances of one run."""

    def __init__(self, ctx: RunContext, ledger: RolloutLedger, queue: SampleQueue):
        spec = ctx.spec
        self.ctx = ctx
        self.ledger = ledger
        self.queue = queue
        self.group_size = spec.samples_per_item
        self.step_samples = spec.samples_per_step
        self.throttle = spec.pipeline.on_lag_exceeded == "throttle"
        self.per_message = spec.items_per_message
        self.scaler = _scaler(spec)
        self.restarts = [0] * spec.resources.rollout_workers  # of each local instance
        self.mp = processes.context()
        self.flags = self.mp.RawArray("q", 2)  # [STOP, EPOCH]; lock-free, so a killed reader cannot wedge it
        self.shared: Any = None  # the weight service's shared memory, as local instances open it
        self.listening = False  # remote instances may join: the status lists them
        self.closing = False  # shutting down: no remote instance is admitted any more
        self.news: list[tuple[str, dict[str, Any]]] = []  # events of other threads, reported by the main one
        ctx.trace["issued_to"] = []  # [steps done when issued, rollout rank, groups]: runs of consecutive issues

    # ---- local instances ----
    def share_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Lay out the shared-memory weight buffers local instances read; before the first spawn."""
        shared_weights_mode()  # a bad TANDEM_SHARED_WEIGHTS fails the run here, not in every instance
        self.shared = self.ctx.weights.shared_handle(state, self.mp, readers=self.ctx.spec.resources.rollout_workers)

    def spawn_local(self) -> None:
        for rank in range(self.ctx.spec.resources.rollout_workers):
            self.spawn(rank)

    def spawn(self, rank: int) -> InstanceSlot:
        recv, send = self.mp.Pipe(duplex=False)
        work_q = self.mp.Queue()
        proc = self.mp.Process(
            target=rollout_process,
            args=(
                rank,
                self.ctx.spec.resolved(),
                self.shared,
                work_q,
                send,
                self.flags,
                self.ctx.rollout_threads,
                self.ledger.states.get(rank),  # where this rank's last accepted samples left it
                os.getpid(),  # the trainer: the child's parent may be the fork server
            ),
            name=f"rollout-{rank}",
            daemon=True,
        )
        proc.start()
        send.close()  # the child holds the only writing end: its death closes the pipe (EOF)
        slot = InstanceSlot(rank, proc, work_q, recv)
        with self.ledger.lock:
            self.ledger.add(slot)
        return slot

    # ---- what the pool looks like ----
    def live_slots(self) -> list[InstanceSlot]:
        return [s for s in self.ledger.slots if not s.handled and s.dead_since is None]

    def active_ranks(self) -> list[int]:
        """Ranks of the live instances that take new work: the first ``scaler.active`` of them."""
        live = sorted(s.rank for s in self.live_slots() if s.proc.exitcode is None)
        return live[: self.scaler.active]

    def status(self) -> dict[str, Any]:
        """The instances as the run's status shows them."""
        live = sorted(self.live_slots(), key=lambda s: s.rank)
        status: dict[str, Any] = {
            "rollout_pids": [s.proc.pid for s in live if not s.remote],
            "rollout_restarts": sum(self.restarts),
        }
        if self.listening:
            status["rollout_remote"] = [
                {"rank": s.rank, "host": s.proc.host, "pid": s.proc.pid} for s in live if s.remote
            ]
        return status

    # ---- news from other threads ----
    def note(self, kind: str, payload: dict[str, Any]) -> None:
        """An event to report from the main thread; the caller holds the ledger's lock."""
        self.news.append((kind, payload))

    def tell(self, kind: str, payload: dict[str, Any]) -> None:
        """An event to report from the main thread (the remote evaluator's connections)."""
        with self.ledger.lock:
            self.note(kind, payload)

    def report_news(self) -> None:
        """Report the events other threads noted (connections of remote instances and the evaluator)."""
        with self.ledger.lock:
            news, self.news = self.news, []
        for kind, payload in news:
            self.ctx.reporters.event(kind, payload)
        if news:
            self.ctx.publish_status(**self.status())

    # ---- work ----
    def top_up(self, next_take: int, steps_done: int) -> None:
        """Issue work while the queue has room for it (credits), each round within one step's share.

        Each group goes to the active instance that would finish it soonest (length-aware,
        queue-aware dispatch); a round's groups travel as one message per instance.
        ``next_take``: the trainer version at its next ``take`` (the current one before this step's
        take, one more after it); ``steps_done`` labels the issues in the trace."""
        ledger, G, B = self.ledger, self.group_size, self.step_samples
        lag = self.ctx.spec.pipeline.max_policy_lag
        while True:
            with ledger.lock:
                live = {s.rank: s for s in self.live_slots() if s.proc.exitcode is None}
                active = self.active_ranks()
                if not active:
                    return  # replacements are started by supervise()
                ahead = len(self.queue) + len(ledger.in_flight) * G
                room = self.queue.capacity - ahead
                to_boundary = (B - ahead % B) // G  # a message never straddles two steps' shares
                n = min(self.per_message, room // G, max(1, to_boundary))
                if n < 1:
                    return
                # throttle: the message is consumed around version + ahead // B; it must be generated
                # with weights at most `lag` versions older than that
                min_version = max(0, next_take + ahead // B - lag) if self.throttle else 0
                items = self.ctx.source.next(n, min_version=min_version)
                messages: dict[int, list[tuple[int, dict]]] = {}
                for it in items:
                    rank, ticket = self._assign(it, active, live)
                    messages.setdefault(rank, []).append((ticket, it.pack()))
                    self._trace_issue(steps_done, rank)
                epoch = int(self.flags[EPOCH])
            for rank, entries in messages.items():
                live[rank].work_q.put((epoch, entries))

    def _assign(self, item: Any, active: list[int], live: dict[int, InstanceSlot]) -> tuple[int, int]:
        """The instance that takes ``item``, and its ticket; the caller holds the ledger's lock."""
        ledger = self.ledger
        cost = ledger.predicted_cost(item)
        rank = cast(int, ledger.dispatcher.choose(cost, among=active))
        ticket = ledger.next_ticket
        ledger.next_ticket += 1
        ledger.dispatcher.assign(ticket, rank, cost)
        ledger.owner[ticket] = (live[rank], item.index)
        ledger.in_flight[item.index] = item
        return rank, ticket

    def _trace_issue(self, steps_done: int, rank: int) -> None:
        issued = self.ctx.trace["issued_to"]
        if issued and issued[-1][:2] == [steps_done, rank]:
            issued[-1][2] += 1
        else:
            issued.append([steps_done, rank, 1])

    def forget_in_flight(self) -> None:
        """Rollback: withdraw every ticket, so late results are dropped on arrival."""
        with self.ledger.lock:
            self.ledger.withdraw()
            self.flags[EPOCH] += 1  # and rollout processes skip the messages they have not started
            for slot in self.live_slots():
                if slot.remote:
                    slot.proc.set_epoch(int(self.flags[EPOCH]))

    def scale(self, step: int, fill: float) -> None:
        """Dynamic parallelism: follow the queue watermark; report when the active count changes."""
        before = self.scaler.active
        after = self.scaler.update(fill)
        if after != before:
            self.ctx.reporters.event(
                "rollout_scaled", {"step": step, "active": after, "was": before, "watermark_fill": fill}
            )

    # ---- supervision ----
    def supervise(self) -> None:
        """Fail on a rollout error; replace a rollout process that died or went silent, issuing its work again."""
        if self.ledger.error:
            raise PipelineError(self.ledger.error)
        self.report_news()
        now = time.monotonic()
        for slot in list(self.ledger.slots):
            self._kill_if_silent(slot, now)
            if slot.handled or slot.proc.exitcode is None:
                continue
            if slot.dead_since is None:
                slot.dead_since = now
            # let the receiver read what it sent before dying (EOF), so finished work is not redone
            if not slot.eof and now - slot.dead_since < 5.0:
                continue
            self.replace(slot)

    def _kill_if_silent(self, slot: InstanceSlot, now: float) -> bool:
        """Kill an instance that sent nothing, not even a heartbeat, for rollout.hang_timeout_s
        (stuck in a device call, deadlocked, frozen); :meth:`supervise` then replaces it."""
        silent = slot.ready and now - slot.last_seen > self.ctx.spec.rollout.hang_timeout_s
        if not silent or slot.handled or slot.proc.exitcode is not None:
            return False
        slot.hung = True
        slot.proc.kill()
        slot.proc.join(timeout=5)
        return True

    def kill_if_hung(self, pid: int) -> None:
        """A publish waits on the weight buffer's lock, held by reader ``pid``: when that instance
        is silent past the hang timeout, kill it and free the lock it holds (the receiver thread and
        :meth:`supervise` cannot: the publishing thread is the one that runs supervise)."""
        now = time.monotonic()
        for slot in list(self.ledger.slots):
            if not slot.remote and slot.proc.pid == pid and self._kill_if_silent(slot, now):
                self.ctx.weights.reader_gone(pid)

    def replace(self, slot: InstanceSlot) -> None:
        """A dead, hung or disconnected instance: its work goes back in line; a local one is restarted."""
        ctx = self.ctx
        reason = "its connection closed" if slot.remote else _death_reason(slot.proc.exitcode)
        if slot.hung:
            reason = f"sent nothing for rollout.hang_timeout_s={ctx.spec.rollout.hang_timeout_s:g} s and was killed"
        slot.handled = True
        reissued = self._take_back_work(slot)
        if slot.remote:  # it reconnects by itself, or its role is restarted by the platform
            ctx.reporters.event(
                "rollout_disconnected",
                {"rank": slot.rank, "host": slot.proc.host, "reason": reason, "reissued": reissued},
            )
        else:
            self._restart(slot, reason, reissued)
        ctx.publish_status(**self.status())

    def _take_back_work(self, slot: InstanceSlot) -> int:
        """Withdraw ``slot``'s tickets and give their work back to the source; returns how many groups."""
        ledger = self.ledger
        with ledger.lock:
            items = ledger.withdraw(slot)
            for item in items:  # back at their old place in line, with the weights allowed there
                item.pinned = True
            self.ctx.source.give_back(items)
            ledger.slots = [s for s in ledger.slots if not (s.handled and s.eof) or s is slot]
        return len(items)

    def _restart(self, slot: InstanceSlot, reason: str, reissued: int) -> None:
        """Clean up after a dead local instance and start another at its rank, within the budget."""
        ctx, rank = self.ctx, slot.rank
        slot.work_q.cancel_join_thread()  # nobody reads it any more: never block exit on it
        slot.work_q.close()
        ctx.weights.reader_died(slot.proc.pid)  # the others must not wait for a lock it died holding
        sweep(shm_prefix(os.getpid(), rank, slot.proc.pid))  # segments it made but could not announce
        budget = ctx.spec.resources.rollout_restarts
        if self.restarts[rank] >= budget:
            raise PipelineError(
                f"rollout process {rank} {reason}; its restart budget resources.rollout_restarts={budget} is spent"
            )
        self.restarts[rank] += 1
        self.spawn(rank)
        ctx.reporters.event(
            "rollout_restarted",
            {"rank": rank, "restarts": self.restarts[rank], "reason": reason, "reissued": reissued},
        )

    # ---- the end ----
    def close_admission(self) -> list[InstanceSlot]:
        """Tell local instances to stop and admit no remote one any more; returns the instances to stop."""
        self.flags[STOP] = 1
        with self.ledger.lock:
            self.closing = True
            return list(self.ledger.slots)

    def stop(self, slots: list[InstanceSlot], ended: bool) -> None:
        """Stop ``slots`` and wait for them (kill what does not exit). Remote ones are told the run
        ended only when it did (``ended``); after a failure they wait for a restarted trainer instead."""
        for slot in slots:
            if slot.remote:
                slot.proc.close(stop=ended)
            elif not slot.handled:
                slot.work_q.put(None)
        for slot in slots:
            slot.proc.join(timeout=60)
            if slot.proc.is_alive():
                slot.proc.kill()
                slot.proc.join()
            slot.work_q.cancel_join_thread()


def _scaler(spec: RunSpec) -> InstanceScaler:
    r = spec.resources
    return InstanceScaler(
        r.min_rollout_workers or r.all_rollout_workers,
        r.all_rollout_workers,
        spec.pipeline.scale_up_below,
        spec.pipeline.scale_down_above,
    )


def _death_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with status {exitcode}"
