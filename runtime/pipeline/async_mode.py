"""The ``async`` mode: rollout instances generate into the sample queue while the trainer trains.

Each rollout instance (a spawned process, :mod:`runtime.rollout.instance`: its own engine with
continuous batching, threads, work queue and result pipe) takes groups the trainer issues while the
queue has room for them (credits), and gets weights from the shared-memory weight service. The
trainer's length-aware dispatch (:mod:`runtime.rollout.scheduling`) sends each group to the active instance
with the smallest estimated completion time — queued predicted tokens over measured tokens/s — so
long and short prompts spread evenly; the number of active instances follows the queue watermark
(dynamic parallelism). Every group carries a ticket: a result whose ticket the trainer no longer
holds (a dead or hung instance's, or from before a rollback) is dropped. An instance that dies or
goes silent is replaced, up to ``resources.rollout_restarts`` per rank, and its unfinished work is
issued again first, so no sample is lost or trained on twice. The step boundary, checkpoints and
directives are the shared ``runtime.pipeline.driver.RunContext``'s.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from runtime import metrics as M
from runtime.contract import ENDPOINT_FILE, EVALUATOR_ROLE
from runtime.evaluation.evaluator import BackgroundEvaluator
from runtime.evaluation.remote import RemoteEvaluator
from runtime.pipeline.driver import PipelineError, RunContext, pack_queue, unpack_queue
from runtime.rollout.instance import rollout_process, shm_prefix
from runtime.rollout.link import (
    Endpoint,
    RemotePeer,
    RolloutListener,
    WeightBlobs,
    advertised_address,
    env_key,
    spec_digest,
    write_endpoint,
)
from runtime.rollout.scheduling import BubbleMeter, Dispatcher, InstanceScaler, LengthPredictor
from runtime.rollout.transfer import ShmCourier, sweep
from runtime.sample_queue import QueueClosed, SampleQueue
from runtime.samples import Sample
from runtime.weights.service import WeightService
from runtime.workloads.llm import EPOCH, STOP, ConsistencyProbe, WorkItem, build_engine, from_bytes


@dataclass(eq=False)
class _Slot:
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


class _AsyncState:
    """Trainer-side bookkeeping of the rollout instances: who holds which group, what came back.

    Every group issued gets a ticket; ``owner`` maps the tickets outstanding to (slot, issue index).
    A result is accepted only for a ticket still outstanding and held by the instance that sent it;
    a dead instance's tickets and (at a rollback) all tickets are withdrawn, so their late results
    are dropped and the work issued again is the only copy ever trained on. The dispatcher, length
    predictor and bubble meter are updated here from each result message, under ``lock``.
    """

    def __init__(self, queue: SampleQueue, weights: WeightService, spec: Any):
        ranks = list(range(spec.resources.all_rollout_workers))
        self.queue = queue
        self.weights = weights
        self.group_size = spec.algorithm.group_size
        self.task_name = spec.task.name
        self.lock = threading.Lock()  # guards everything below + queue puts against a checkpoint snapshot
        self.slots: list[_Slot] = []
        self.owner: dict[int, tuple[_Slot, int]] = {}
        self.in_flight: dict[int, WorkItem] = {}
        self.next_ticket = 0
        self.discarded = 0  # groups dropped because their ticket was withdrawn
        self.gen_s = 0.0
        self.gen_tokens = 0
        self.dispatcher = Dispatcher(ranks)
        self.predictor = LengthPredictor(spec.rollout.max_new_tokens, spec.rollout.length_prediction)
        self.meter = BubbleMeter(ranks)
        self.reward_dropped: list[int] = []  # issue indices of groups that lost a reward (this process)
        self.reward_dropped_before = 0  # groups that lost a reward before the checkpoint this run resumed from
        self.reward_counts: dict[str, float] = {}  # reward-service counters, run totals
        self.circuit_open: dict[int, float] = {}
        self.error: str | None = None
        self.done = False  # set once every rollout process has exited

    def predicted_tokens(self, item: WorkItem) -> float:
        """The group's predicted generation work: group size x predicted response length."""
        p = item.prompt
        return self.group_size * self.predictor.predict(p.prompt_id, self.task_name, len(p.text))

    def receive(self) -> None:
        """Receiver thread: rollout messages -> queue, until every process has exited and its pipe is drained."""
        from multiprocessing.connection import wait

        while True:
            with self.lock:
                open_slots = {s.conn: s for s in self.slots if not s.eof}
            if not open_slots:
                if self.done:
                    return
                time.sleep(0.05)
                continue
            for ready in wait(list(open_slots), timeout=0.2):
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

    def _handle(self, slot: _Slot, kind: str, rank: int, payload: Any) -> None:
        from runtime.sample_queue import unpack_samples

        if kind == "samples":
            ref, info = payload
            blob = ShmCourier.unwrap(ref)
            if blob is None:  # its segment was swept: the sender died, and its work is issued again
                self.discarded += 1
                return
            samples = unpack_samples(from_bytes(blob))
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
                for s in kept:
                    self.predictor.observe(s.prompt_id, self.task_name, len(s.prompt_ids), len(s.response_ids))
                if not kept:
                    return
                # never blocks: the trainer only issues work the queue has room for
                try:
                    if not self.queue.put(kept, timeout=60):
                        self.error = "sample queue stayed full for 60 s (credit accounting broken)"
                except QueueClosed:
                    return
        elif kind == "error":
            self.error = f"rollout process {rank} failed:\n{payload}"
            self.queue.close()

    def _account(self, slot: _Slot, info: dict[str, Any]) -> None:
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

    def withdraw(self, slot: _Slot | None = None) -> list[WorkItem]:
        """Take back the work held by ``slot`` (every slot's when None); caller holds the lock."""
        items: list[WorkItem] = []
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
            out[M.SAMPLES_DROPPED_REWARD] = (self.reward_dropped_before + len(self.reward_dropped)) * self.group_size
            out.update(self.reward_counts)
            if self.circuit_open:
                out["reward/circuit_open"] = max(self.circuit_open.values())
        return out


def _death_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


class AsyncMode:
    """async: rollout processes generate into the queue while the trainer trains."""

    def __init__(self, ctx: RunContext):
        spec = ctx.spec
        self.ctx = ctx
        self.G = spec.algorithm.group_size
        self.B = spec.samples_per_step
        self.policy = spec.pipeline.on_lag_exceeded
        self.queue = SampleQueue(
            spec.queue_capacity, max_policy_lag=spec.pipeline.max_policy_lag, on_lag_exceeded=self.policy
        )
        self.st = _AsyncState(self.queue, ctx.weights, spec)
        r = spec.resources
        self.scaler = InstanceScaler(
            r.min_rollout_workers or r.all_rollout_workers,
            r.all_rollout_workers,
            spec.pipeline.scale_up_below,
            spec.pipeline.scale_down_above,
        )
        if ctx.resume_state is not None:
            self.st.load_counters(ctx.resume_state.get("reward"))
            self.queue.restore(unpack_queue(ctx.resume_state["queue"]))
            in_flight = [WorkItem.unpack(d) for d in ctx.resume_state["in_flight"]]
            ctx.source.give_back(in_flight)  # in-flight prompts at checkpoint time are re-issued first
            self._handle_stale()  # stale but not yet handled when the checkpoint was taken
        if self.B > self.queue.capacity:
            raise PipelineError(
                f"pipeline.queue_capacity: {self.queue.capacity} is smaller than one step's {self.B} samples"
            )
        ctx.weights.keep = max(2, spec.pipeline.max_policy_lag + 1)  # every version a consumable sample can come from
        self.per_message = max(1, min(spec.pipeline.prompts_per_step, spec.rollout.max_batch_size // self.G))
        self.restarts = [0] * spec.resources.rollout_workers  # of each local instance
        self.listener: Any = None  # accepts remote instances (resources.remote_rollout_workers)
        self.endpoint_address = ""  # the address the listener advertises
        self.blobs = WeightBlobs()
        self.closing = False
        self.news: list[tuple[str, dict[str, Any]]] = []  # events of other threads, reported by the main one
        self.steps_done = ctx.start_step
        ctx.trace["issued_to"] = []  # [steps done when issued, rollout rank, groups]: runs of consecutive issues
        self.evaluator: BackgroundEvaluator | RemoteEvaluator | None = None
        self.remote_eval: RemoteEvaluator | None = None  # resources.remote_evaluator: kept across rollbacks
        self.mp = torch.multiprocessing.get_context("spawn")
        self.flags = self.mp.RawArray("q", 2)  # [STOP, EPOCH]; lock-free, so a killed reader cannot wedge it
        ctx.weights.on_wait = self.kill_if_hung  # a publish waiting on a frozen reader must not wait for ever

    # ---- rollout processes ----
    def spawn(self, rank: int) -> _Slot:
        recv, send = self.mp.Pipe(duplex=False)
        work_q = self.mp.Queue()
        proc = self.mp.Process(
            target=rollout_process,
            args=(rank, self.ctx.spec.resolved(), self.shared, work_q, send, self.flags, self.ctx.rollout_threads),
            name=f"rollout-{rank}",
            daemon=True,
        )
        proc.start()
        send.close()  # the child holds the only writing end: its death closes the pipe (EOF)
        slot = _Slot(rank, proc, work_q, recv)
        with self.st.lock:
            self.st.slots.append(slot)
            self.st.dispatcher.restore(rank)
        return slot

    def live_slots(self) -> list[_Slot]:
        return [s for s in self.st.slots if not s.handled and s.dead_since is None]

    def rollout_status(self) -> dict[str, Any]:
        live = sorted(self.live_slots(), key=lambda s: s.rank)
        status: dict[str, Any] = {
            "rollout_pids": [s.proc.pid for s in live if not s.remote],
            "rollout_restarts": sum(self.restarts),
        }
        if self.listener is not None:
            status["rollout_remote"] = [
                {"rank": s.rank, "host": s.proc.host, "pid": s.proc.pid} for s in live if s.remote
            ]
        return status

    # ---- remote instances (runtime.rollout.link) ----
    def listen(self) -> None:
        """Accept remote instances; their endpoint goes to the output directory (shared with their hosts)."""
        import secrets

        key = env_key()
        drawn = key is None  # standalone: draw one; the endpoint file (mode 0600) carries it
        if key is None:
            key = secrets.token_hex(32).encode()
        if self.ctx.spec.resources.remote_evaluator:
            self.remote_eval = RemoteEvaluator(spec_digest(self.ctx.spec), self.tell)
            self.params_changed()  # it is the evaluator from now on
        self.listener = RolloutListener(self.ctx.spec.pipeline.rollout_listen, key, self.admit)
        self.ctx.weights.on_publish = self.push_weights
        endpoint = Endpoint(
            advertised_address(self.listener.bind_host),
            self.listener.port,
            secrets.token_hex(8),
            key if drawn else None,
        )
        write_endpoint(self.ctx.out_dir / ENDPOINT_FILE, endpoint)
        self.endpoint_address = endpoint.address
        self.listener.start()
        self.ctx.reporters.event("rollout_listening", {"address": endpoint.address, "port": endpoint.port})

    def admit(self, conn: Any, hello: dict[str, Any]) -> tuple[str, bool] | None:
        """A remote instance said hello (listener thread): refuse it with (reason, retry later?), or take it."""
        spec = self.ctx.spec
        r = spec.resources
        if hello.get("role") == EVALUATOR_ROLE:
            if self.remote_eval is None:
                return "this run has no remote evaluator (resources.remote_evaluator)", False
            return self.remote_eval.admit(conn, hello)
        rank = hello.get("rank")
        if not isinstance(rank, int) or not r.rollout_workers <= rank < r.all_rollout_workers:
            first, last = r.rollout_workers, r.all_rollout_workers - 1
            return f"rank {rank!r} is not a remote rollout rank of this run ({first}..{last})", False
        if hello.get("digest") != spec_digest(spec):
            return "its spec differs from the trainer's (model, task, rollout, reward, group size or seed)", False
        with self.st.lock:
            if self.closing:
                return "the trainer is shutting down", True
            if any(s.rank == rank and not s.handled for s in self.st.slots):
                return f"rank {rank} is still connected", True
            welcome: dict[str, Any] = {"epoch": int(self.flags[EPOCH])}
            broadcast = self.broadcast_sender()
            if broadcast is not None:
                welcome["broadcast"] = {**broadcast.welcome, "address": self.endpoint_address}
            conn.send(("welcome", welcome))
            peer = RemotePeer(conn, rank, int(hello.get("pid") or 0), str(hello.get("host") or "?"), broadcast)
            self.st.slots.append(_Slot(rank, peer, peer, conn, remote=True))
            self.st.dispatcher.restore(rank)
            # a version published from now on is pushed by push_weights; this one is the current
            version = self.ctx.weights.version
            self.push_to(peer, version, self.ctx.weights.state(version))
            sync = "broadcast" if broadcast is not None else "link"
            self.news.append(
                ("rollout_connected", {"rank": rank, "host": peer.host, "pid": peer.pid, "weight_sync": sync})
            )
        return None

    def tell(self, kind: str, payload: dict[str, Any]) -> None:
        """News from another thread (the remote evaluator's), reported by the main one."""
        with self.st.lock:
            self.news.append((kind, payload))

    def push_weights(self, version: int, state: dict[str, torch.Tensor]) -> None:
        with self.st.lock:
            peers = [s.proc for s in self.live_slots() if s.remote]
        for peer in peers:
            self.push_to(peer, version, state)

    def push_to(self, peer: Any, version: int, state: dict[str, torch.Tensor]) -> None:
        peer.push_weights(version, lambda: self.blobs.get(version, state), state)

    def broadcast_sender(self) -> Any:
        """With pipeline.remote_weight_sync broadcast: a new connection's end of its own process group."""
        if self.ctx.spec.pipeline.remote_weight_sync != "broadcast":
            return None
        from runtime.devices import dist_backend
        from runtime.weights.broadcast import BroadcastSender

        spec = self.ctx.spec
        return BroadcastSender(dist_backend(spec.resources.device), self.ctx.device, spec.rollout.hang_timeout_s)

    def supervise(self) -> None:
        """Fail on a rollout error; replace a rollout process that died or went silent, issuing its work again."""
        if self.st.error:
            raise PipelineError(self.st.error)
        self.report_news()
        now = time.monotonic()
        for slot in list(self.st.slots):
            self._kill_if_silent(slot, now)
            if slot.handled or slot.proc.exitcode is None:
                continue
            if slot.dead_since is None:
                slot.dead_since = now
            # let the receiver read what it sent before dying (EOF), so finished work is not redone
            if not slot.eof and now - slot.dead_since < 5.0:
                continue
            self.replace(slot)

    def report_news(self) -> None:
        """Report the events other threads noted (connections of remote instances and the evaluator)."""
        with self.st.lock:
            news, self.news = self.news, []
        for kind, payload in news:
            self.ctx.reporters.event(kind, payload)
        if news:
            self.ctx.publish_status(**self.rollout_status())

    def _kill_if_silent(self, slot: _Slot, now: float) -> bool:
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
        for slot in list(self.st.slots):
            if not slot.remote and slot.proc.pid == pid and self._kill_if_silent(slot, now):
                self.ctx.weights.reader_gone(pid)

    def replace(self, slot: _Slot) -> None:
        ctx, rank = self.ctx, slot.rank
        reason = "its connection closed" if slot.remote else _death_reason(slot.proc.exitcode)
        if slot.hung:
            reason = f"sent nothing for rollout.hang_timeout_s={ctx.spec.rollout.hang_timeout_s:g} s and was killed"
        slot.handled = True
        with self.st.lock:
            items = self.st.withdraw(slot)
            for item in items:  # back at their old place in line, with the weights allowed there
                item.pinned = True
            ctx.source.give_back(items)
            self.st.slots = [s for s in self.st.slots if not (s.handled and s.eof) or s is slot]
        if slot.remote:  # it reconnects by itself, or its role is restarted by the platform
            ctx.reporters.event(
                "rollout_disconnected", {"rank": rank, "host": slot.proc.host, "reason": reason, "reissued": len(items)}
            )
            ctx.publish_status(**self.rollout_status())
            return
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
            {"rank": rank, "restarts": self.restarts[rank], "reason": reason, "reissued": len(items)},
        )
        ctx.publish_status(**self.rollout_status())

    def active_ranks(self) -> list[int]:
        """Ranks of the live instances that take new work: the first ``scaler.active`` of them."""
        live = sorted(s.rank for s in self.live_slots() if s.proc.exitcode is None)
        return live[: self.scaler.active]

    def top_up(self, next_take: int) -> None:
        """Issue work while the queue has room for it (credits), each round within one step's share.

        Each group goes to the active instance that would finish it soonest (length-aware,
        queue-aware dispatch); a round's groups travel as one message per instance.
        ``next_take``: the trainer version at its next ``take`` (the current one before this step's
        take, one more after it)."""
        ctx, st, G, B = self.ctx, self.st, self.G, self.B
        lag = ctx.spec.pipeline.max_policy_lag
        while True:
            with st.lock:
                live = {s.rank: s for s in self.live_slots() if s.proc.exitcode is None}
                active = self.active_ranks()
                if not active:
                    return  # replacements are started by supervise()
                ahead = len(self.queue) + len(st.in_flight) * G
                room = self.queue.capacity - ahead
                to_boundary = (B - ahead % B) // G  # a message never straddles two steps' shares
                n = min(self.per_message, room // G, max(1, to_boundary))
                if n < 1:
                    return
                # throttle: the message is consumed around version + ahead // B; it must be generated
                # with weights at most `lag` versions older than that
                min_version = max(0, next_take + ahead // B - lag) if self.policy == "throttle" else 0
                items = ctx.source.next(n, min_version=min_version)
                messages: dict[int, list[tuple[int, dict]]] = {}
                for it in items:
                    cost = st.predicted_tokens(it)
                    rank = cast(int, st.dispatcher.choose(cost, among=active))
                    ticket = st.next_ticket
                    st.next_ticket += 1
                    st.dispatcher.assign(ticket, rank, cost)
                    st.owner[ticket] = (live[rank], it.index)
                    st.in_flight[it.index] = it
                    messages.setdefault(rank, []).append((ticket, it.pack()))
                    issued = ctx.trace["issued_to"]
                    if issued and issued[-1][:2] == [self.steps_done, rank]:
                        issued[-1][2] += 1
                    else:
                        issued.append([self.steps_done, rank, 1])
                epoch = int(self.flags[EPOCH])
            for rank, entries in messages.items():
                live[rank].work_q.put((epoch, entries))

    # ---- the loop ----
    def run(self) -> dict[str, Any]:
        ctx, spec, trainer, st, queue = self.ctx, self.ctx.spec, self.ctx.trainer, self.st, self.queue
        B = self.B
        probe = ConsistencyProbe(spec, ctx.device, max_samples=min(self.G, 4))  # a sample of the batch: cheap
        self.shared = ctx.weights.shared_handle(trainer.publish_state(), self.mp)
        if spec.resources.remote_rollout_workers or spec.resources.remote_evaluator:
            self.listen()
        ctx.weights.initialize(trainer.publish_state())
        receiver = threading.Thread(target=st.receive, name="receiver", daemon=True)
        step = ctx.start_step
        ended = False
        try:
            for rank in range(spec.resources.rollout_workers):
                self.spawn(rank)
            receiver.start()
            self.params_changed()  # the evaluator, when evaluation is on
            if ctx.eval_due(step):
                self.evaluate(step)
                ctx.eval_step = step
            ctx.publish_status(step, **self.rollout_status())
            queue.reset_watermark()
            while step < spec.pipeline.steps:
                timer = M.StepTimer()
                started = time.perf_counter()
                self.supervise()  # a dead process's work is issued again before it is waited for
                self.top_up(trainer.version)
                with timer.section("wait"):
                    batch = None
                    while batch is None:
                        try:
                            batch = queue.take(B, trainer.version, timeout=0.2)
                        except QueueClosed:
                            self.supervise()
                            raise
                        self._handle_stale()
                        if batch is None:
                            self.supervise()
                            self.top_up(trainer.version)
                stats = queue.stats()
                self.top_up(trainer.version + 1)  # refill at once so the rollouts keep generating while we train
                with timer.section("train"):
                    trained = trainer.train_step(batch, step)
                if M.CONSISTENCY_KL not in trained:  # no sample of the trainer's own version in this batch
                    trained.update(probe.measure(batch, ctx.weights))
                with timer.section("weight_sync"):
                    ctx.weights.publish(trainer.publish_state(), version=trainer.version)
                step += 1
                gen_s, gen_tokens = st.take_gen_counters()
                timer.add("generate", gen_s)
                split = timer.lap()
                ctx.trace["consumed"].append(sorted({s.group_id for s in batch}))
                ctx.last_metrics = ctx.step_metrics(trained, split, time.perf_counter() - started, batch, gen_tokens)
                ctx.last_metrics[M.QUEUE_DEPTH] = stats.depth
                ctx.last_metrics[M.QUEUE_WATERMARK] = stats.high_water
                ctx.last_metrics.update(st.step_metrics(self.active_ranks()))
                ctx.last_metrics[M.ROLLOUT_ACTIVE] = self.scaler.active
                self.steps_done = step
                self.scale(step, queue.stats().high_water / queue.capacity)
                queue.reset_watermark()
                ctx.reporters.report(step, ctx.last_metrics)
                self.collect_evals()
                ctx.publish_status(step, **self.rollout_status())
                nxt = ctx.boundary(step, self)
                if nxt is None:
                    break
                if nxt != step:  # rolled back
                    queue.reset_watermark()
                step = nxt
            ended = True
        finally:
            self.shutdown(receiver, wait_eval=step == ctx.final_step and ctx.ending != "cancelled", ended=ended)
        with st.lock:
            ctx.trace["reward_dropped"] = list(st.reward_dropped)
            ctx.trace["leftover"] = sorted(
                {s.group_id for s in queue.snapshot()["items"]}
                | set(st.in_flight)
                | {w.index for w in ctx.source.reissue}
            )
        return ctx.finish(step)

    def scale(self, step: int, fill: float) -> None:
        """Dynamic parallelism: follow the queue watermark; report when the active count changes."""
        before = self.scaler.active
        after = self.scaler.update(fill)
        if after != before:
            self.ctx.reporters.event(
                "rollout_scaled", {"step": step, "active": after, "was": before, "watermark_fill": fill}
            )

    def shutdown(self, receiver: threading.Thread, wait_eval: bool, ended: bool = True) -> None:
        """Stop the rollout instances. Remote ones are told the run ended only when it did (``ended``);
        after a failure they wait for a restarted trainer instead."""
        st = self.st
        self.flags[STOP] = 1
        with st.lock:
            self.closing = True
            slots = list(st.slots)
        if self.listener is not None:
            self.listener.close()
            if ended:
                write_endpoint(self.ctx.out_dir / ENDPOINT_FILE, None)
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
        st.done = True  # every process has exited: the receiver drains what they sent, then stops
        if receiver.is_alive():
            receiver.join(timeout=60)
        sweep(shm_prefix(os.getpid(), 0))  # what no one will read any more
        if self.evaluator is not None:
            for eval_step, result in self.evaluator.close(wait=wait_eval):
                self.ctx.record_eval(eval_step, result)
        if self.remote_eval is not None:
            self.remote_eval.release(stop=ended)
        self.report_news()  # what happened since the last step

    def collect_evals(self) -> None:
        if self.evaluator is not None:
            for eval_step, result in self.evaluator.results():
                self.ctx.record_eval(eval_step, result)

    def _handle_stale(self) -> None:
        stale = self.queue.pop_stale()
        if stale:
            _handle_stale(self.ctx, self.queue, stale, self.policy)

    # ---- _Mode ----
    def evaluate(self, step: int) -> None:
        if self.evaluator is not None:
            version = self.ctx.weights.version
            self.evaluator.submit(step, version, self.ctx.weights.state(version))

    def checkpoint(self, step: int) -> None:
        with self.st.lock:
            snap = self.queue.snapshot()
            in_flight_state = [it.pack() for it in self.st.in_flight.values()]
            counters = self.st.counters_state()
        self.ctx.save_checkpoint(step, {"queue": pack_queue(snap), "in_flight": in_flight_state, "reward": counters})

    def forget_in_flight(self) -> None:
        with self.st.lock:
            self.st.withdraw()  # late results of these tickets are dropped on arrival
            self.flags[EPOCH] += 1  # and rollout processes skip the messages they have not started
            for slot in self.live_slots():
                if slot.remote:
                    slot.proc.set_epoch(int(self.flags[EPOCH]))
        if self.evaluator is not None:  # evaluations of the abandoned timeline are reported before the rollback
            for eval_step, result in self.evaluator.close(wait=False):
                self.ctx.record_eval(eval_step, result)
            self.evaluator = None

    def restore(self, state: dict[str, Any], offset: int) -> None:
        ctx = self.ctx
        with self.st.lock:
            self.queue.clear()
            self.queue.restore(unpack_queue(state["queue"], offset))
            self.st.load_counters(state.get("reward"))
        in_flight = [WorkItem.unpack(d) for d in state["in_flight"]]
        for item in in_flight:
            item.min_version += offset
        ctx.source.give_back(in_flight)
        ctx.weights.publish(ctx.trainer.publish_state(), version=ctx.trainer.version)
        self._handle_stale()
        self.params_changed()

    def params_changed(self) -> None:
        spec = self.ctx.spec
        self.queue.max_policy_lag = spec.pipeline.max_policy_lag
        self.ctx.weights.keep = max(2, spec.pipeline.max_policy_lag + 1)
        if self.evaluator is None and spec.pipeline.eval_interval > 0:
            self.evaluator = self.remote_eval or BackgroundEvaluator(lambda: _eval_engine(self.ctx), self.ctx.run_eval)

    def tick(self) -> None:
        self.supervise()
        self.collect_evals()


def _handle_stale(ctx: RunContext, queue: SampleQueue, stale: list[Sample], policy: str) -> None:
    """drop: count and forget; throttle / sync: regenerate the prompt with the current weights."""
    groups = sorted({s.group_id: s.prompt_id for s in stale}.items())
    ctx.dropped_total += len(stale)
    if policy == "drop":
        ctx.trace["dropped"].extend(g for g, _ in groups)
        return
    queue.release([s.sample_id for s in stale])  # the regenerated group reuses the ids
    items = [WorkItem(index=g, prompt=ctx.prompt_by_id[pid]) for g, pid in groups]
    ctx.source.give_back(items, min_version=ctx.trainer.version)


def _eval_engine(ctx: RunContext) -> Any:
    """The evaluator's engine: on its own device with ``resources.eval_devices``, else the trainer's."""
    from runtime.devices import resolve_device
    from runtime.models import build_policy
    from runtime.placement import eval_device_index

    index = eval_device_index(ctx.spec)
    device = ctx.device if index is None else resolve_device(ctx.spec.resources.device, index)
    model, _ = build_policy(ctx.spec.model, device, seed=ctx.spec.seed)
    model.eval()
    return build_engine(model, ctx.tokenizer, device, ctx.spec)
