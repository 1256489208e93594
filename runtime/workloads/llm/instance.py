"""The LLM workload's rollout instance (async mode): a group of sequences per prompt, streamed through
continuous batching.

The instance keeps one :class:`~runtime.rollout.batcher.ContinuousBatcher` busy for its whole life.
Work arrives as messages of groups (one prompt each, ``group_size`` sequences) and is fed to the
batcher as it comes, so a finished sequence's slot is refilled at the next engine step with the
next request of *any* message: one long sample no longer holds a batch, nor a message its
successors. New weights are taken at every engine step, so sequences in flight continue under them;
each token records the version that produced it. An instance computing on the host reads the weight
service's shared buffer *in place* — its engine's parameters are the buffer's tensors, no copy of its
own and no model built or loaded — and runs each engine step inside :meth:`WeightSubscriber.reading`
(a publish waits for the step to end); one on an accelerator copies each new version into its engine
(:meth:`WeightSubscriber.switch`). ``TANDEM_SHARED_WEIGHTS=copy`` makes a host instance copy too.

A group is complete when its ``group_size`` sequences are; it is then scored — by the task's
verifier at once, or by the remote reward service on a thread pool so generation never waits for
it — and handed to an :class:`~runtime.rollout.transfer.Aggregator`, which sends finished groups back
packed (flat tensors + lengths) in one message per ``transfer_max_bytes`` or ``transfer_window_s``.
A group that loses a reward (the service timed out, failed or its breaker is open, after retries)
is dropped whole — a GRPO group is normalised over all its samples — and reported as dropped.

The messages in and out are those of :mod:`runtime.rollout.instance` (the process that hosts it, or
:mod:`runtime.rollout.remote` on another host); the ``samples`` message's ``info`` here: ``tickets``
(groups in the blob), ``dropped`` (tickets whose group lost a reward), ``group_tokens`` (ticket ->
tokens generated), ``gen_s`` (engine busy seconds), ``tokens``, ``real`` / ``allocated`` (token
accounting: the padding bubble), ``waits`` (seconds each group waited for its first slot),
``throttled_s`` and ``reward`` (reward-client counter deltas).

Throttling: a group's ``min_version`` is the oldest weight version allowed to generate it; the
instance holds it back until those weights are available, without holding anything else back.
A rollback bumps the shared epoch: the instance forgets every group of an older epoch, in flight
or not (the trainer has withdrawn their tickets and will issue the prompts again).
"""

from __future__ import annotations

import os
import queue as std_queue
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.rollout.engine import Engine
from runtime.rollout.wire import BEAT_S, EPOCH, shm_prefix, to_bytes, trainer_pid
from runtime.samples import Sample
from runtime.weights.service import shared_weights_mode
from runtime.workloads.llm.data import WorkItem
from runtime.workloads.llm.generation import batch_seed, make_samples, reward_scores
from runtime.workloads.llm.models import build_engine, build_task, engine_tokenizer
from runtime.workloads.llm.probe import PublishedPolicy


@dataclass
class _Group:
    ticket: int
    epoch: int
    item: WorkItem
    prompt_ids: list[int] = field(default_factory=list)
    done: dict[int, Any] = field(default_factory=dict)  # sample index -> Completion
    submitted_at: float = 0.0
    waited: float | None = None  # seconds until its first sequence got a slot
    tokens: int = 0


class RolloutInstance:
    """The instance's state and loop; built inside the spawned process by :func:`rollout_process`."""

    def __init__(
        self,
        rank: int,
        spec: Any,
        engine: Any,
        tokenizer: Any,
        task: Any,
        sub: Any,
        conn: Any,
        flags: Any,
        shm: bool = True,
        in_place: bool = False,
    ):
        from runtime.rollout import sampling_params
        from runtime.rollout.transfer import Aggregator, sample_nbytes

        self.rank, self.spec, self.engine, self.tokenizer, self.task = rank, spec, engine, tokenizer, task
        self.sub, self.conn, self.flags = sub, conn, flags
        self.in_place = in_place  # the engine's parameters are the shared buffer's tensors
        self.G = spec.algorithm.group_size
        self.params = sampling_params(spec.rollout, n=1, stop_ids=tokenizer.stop_ids)
        self.batcher: Any = None  # built at the first group, seeded from its issue index
        self.groups: dict[int, _Group] = {}  # ticket -> group in generation or scoring
        self.held: list[_Group] = []  # waiting for weights >= their min_version
        self.scoring: list[tuple[_Group, list[str], list[Future]]] = []
        self.reward = None
        self.pool: ThreadPoolExecutor | None = None
        if spec.reward.url:
            from runtime.tasks.reward_service import RewardClient

            self.reward = RewardClient.from_spec(spec.reward)
            self.pool = ThreadPoolExecutor(max_workers=spec.reward.concurrency, thread_name_prefix="reward")
        self.reward_sent: dict[str, float] = {}
        p = spec.pipeline
        self.out: Aggregator[tuple[_Group, list[Sample] | None]] = Aggregator(
            p.transfer_max_bytes, p.transfer_window_s, lambda e: sample_nbytes(e[1] or [])
        )
        self.courier = None
        if p.transfer_shm_min_bytes is not None and shm:  # shm: the trainer is on this host
            from runtime.rollout.transfer import ShmCourier

            self.courier = ShmCourier(shm_prefix(trainer_pid(), rank, os.getpid()), p.transfer_shm_min_bytes)
        self.busy_s = 0.0
        self.throttled_s = 0.0
        self.stats_sent = (0, 0)  # the engine's real and allocated tokens at the last message
        self.last_beat = 0.0

    # ---- intake ----
    def take(self, msg: tuple[int, list]) -> None:
        epoch, entries = msg
        if epoch != self.flags[EPOCH]:
            return  # issued before a rollback: the trainer has forgotten it
        for ticket, packed in entries:
            item = WorkItem.unpack(packed)
            group = _Group(ticket, epoch, item, self.tokenizer.encode_prompt(item.prompt.text))
            self.groups[ticket] = group
            self.held.append(group)
        if self.batcher is None and self.held:
            gen = torch.Generator(device=self.engine.device)
            gen.manual_seed(batch_seed(self.spec.seed, self.held[0].item.index))
            self.batcher = self.engine.batcher(self.params, gen)

    def release_held(self) -> None:
        """Groups whose weights are available go to the batcher (submitted in issue order)."""
        version = self.engine.version
        ready = [g for g in self.held if g.item.min_version <= version]
        if not ready:
            return
        self.held = [g for g in self.held if g.item.min_version > version]
        now = time.perf_counter()
        for g in sorted(ready, key=lambda g: g.item.index):
            g.submitted_at = now
            # the group's sequences start together: on the same weights, so one staleness for the group
            self.batcher.submit_group([(g.prompt_ids, (g.ticket, j)) for j in range(self.G)])

    def forget_old_epochs(self) -> None:
        epoch = self.flags[EPOCH]
        old = {t for t, g in self.groups.items() if g.epoch != epoch}
        if not old:
            return
        if self.batcher is not None:
            self.batcher.cancel(lambda tag: tag[0] in old)
        self.held = [g for g in self.held if g.ticket not in old]
        self.scoring = [e for e in self.scoring if e[0].ticket not in old]
        kept = [e for e in self.out.flush() if e[0].ticket not in old]
        for entry in kept:
            self.out.add(entry)
        for t in old:
            del self.groups[t]

    # ---- generation ----
    def step(self) -> None:
        started = time.perf_counter()
        finished = self.batcher.step()
        now = time.perf_counter()
        self.busy_s += now - started
        for ticket, _ in self.batcher.admitted:
            g = self.groups.get(ticket)
            if g is not None and g.waited is None:
                g.waited = started - g.submitted_at  # it got its slot in this step
        self.batcher.admitted.clear()
        for (ticket, j), completion in finished:
            g = self.groups.get(ticket)
            if g is None:
                continue
            g.done[j] = completion
            g.tokens += len(completion.token_ids)
            if len(g.done) == self.G:
                self.score(g)

    def score(self, g: _Group) -> None:
        texts = [self.tokenizer.decode(list(g.done[j].token_ids)) for j in range(self.G)]
        if self.reward is None:
            self.finish(g, [self.task.score(g.item.prompt, t) for t in texts])
            return
        assert self.pool is not None
        p = g.item.prompt
        futures = [self.pool.submit(self.reward.score, p.text, t, p.answer) for t in texts]
        self.scoring.append((g, texts, futures))

    def collect_rewards(self, wait: float = 0.0) -> None:
        """Groups whose remote rewards are all in go to the aggregator (dropped whole if one is missing)."""
        if wait and self.scoring:
            from concurrent.futures import FIRST_COMPLETED
            from concurrent.futures import wait as wait_futures

            wait_futures([f for *_, fs in self.scoring for f in fs], timeout=wait, return_when=FIRST_COMPLETED)
        still = []
        for g, texts, futures in self.scoring:
            if not all(f.done() for f in futures):
                still.append((g, texts, futures))
                continue
            self.finish(g, reward_scores(self.task, g.item.prompt, texts, [f.result() for f in futures]))
        self.scoring = still

    def finish(self, g: _Group, scores: list[tuple[float, bool]] | None) -> None:
        """A scored group (None: it lost a reward) waits in the aggregator to be sent."""
        completions = [g.done[j] for j in range(self.G)]
        self.out.add((g, None if scores is None else make_samples(g.item, g.prompt_ids, completions, scores)))

    # ---- output ----
    def send(self) -> None:
        from runtime.sample_queue import pack_samples

        entries = self.out.flush()
        kept = [s for g, samples in entries if samples is not None for s in samples]
        real, alloc = self.engine.stats.real_tokens, self.engine.stats.allocated_tokens
        sent_real, sent_alloc = self.stats_sent
        self.stats_sent = (real, alloc)
        info = {
            "tickets": [g.ticket for g, samples in entries if samples is not None],
            "dropped": [g.ticket for g, samples in entries if samples is None],
            "group_tokens": {g.ticket: g.tokens for g, _ in entries},
            "gen_s": self.busy_s,
            "tokens": sum(g.tokens for g, _ in entries),
            "real": real - sent_real,
            "allocated": alloc - sent_alloc,
            "waits": [g.waited for g, _ in entries if g.waited is not None],
            "throttled_s": self.throttled_s,
            "reward": self.reward_deltas(),
        }
        self.busy_s = self.throttled_s = 0.0
        for g, _ in entries:
            self.groups.pop(g.ticket, None)
        blob = to_bytes(pack_samples(kept))
        self.conn.send(("samples", self.rank, (self.courier.wrap(blob) if self.courier else blob, info)))

    def reward_deltas(self) -> dict[str, float]:
        if self.reward is None:
            return {}
        now = self.reward.metrics()
        counters = {k: v for k, v in now.items() if k != "reward/circuit_open"}
        deltas = {k: v - self.reward_sent.get(k, 0.0) for k, v in counters.items()}
        self.reward_sent = counters
        deltas["reward/circuit_open"] = now["reward/circuit_open"]
        return deltas

    def beat(self) -> None:
        now = time.monotonic()
        if now - self.last_beat >= BEAT_S:
            self.conn.send(("beat", self.rank, None))
            self.last_beat = now

    # ---- the loop ----
    def idle(self) -> bool:
        return (self.batcher is None or self.batcher.idle) and not self.scoring

    def run(self, work_q: Any, ended: Any) -> None:
        while not ended():
            self.beat()
            block = self.idle() and not self.held and not self.out.entries
            try:
                msg = work_q.get(timeout=0.2) if block else work_q.get_nowait()
                while True:
                    if msg is None:
                        return
                    self.take(msg)
                    msg = work_q.get_nowait()
            except std_queue.Empty:
                pass
            self.forget_old_epochs()
            with self.newest_weights():  # the next engine step runs on them
                self.release_held()
                if self.batcher is not None and not self.batcher.idle:
                    with torch.no_grad():
                        self.step()
            self.collect_rewards(wait=0.05 if self.scoring and self.batcher.idle else 0.0)
            if self.out.due() or (self.out.entries and self.idle()):
                self.send()
            if self.held and self.idle():  # only throttled work: wait for the weights it needs
                waited = time.perf_counter()
                self.sub.wait_for(min(g.item.min_version for g in self.held), timeout=0.2)
                self.throttled_s += time.perf_counter() - waited

    @contextmanager
    def newest_weights(self) -> Iterator[None]:
        """The engine on the newest published weights for the block: copied in when they are new, or (in place)
        held as they are in the shared buffer, only while there is work: an idle instance never holds a publish."""
        if not self.in_place:
            self.sub.switch(self.engine.update_weights)
            yield
            return
        if not self.held and (self.batcher is None or self.batcher.idle):
            yield
            return
        with self.sub.reading(self.rank) as version:
            if version != self.engine.version:
                self.engine.update_weights(None, version)  # no copy: the parameters are the buffer
            yield

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def build_instance(rank: int, spec: Any, device: torch.device, sub: Any, conn: Any, flags: Any) -> RolloutInstance:
    """A spawned instance's side: its engine — over the shared buffer's tensors where it can read them in
    place, else with weights of its own — and the task."""
    engine = engine_on_shared_weights(spec, device, None if sub is None else sub.shared, rank)
    in_place = engine is not None
    if engine is None:
        engine = build_engine(None, None, device, spec)
    return RolloutInstance(rank, spec, engine, engine.tokenizer, build_task(spec), sub, conn, flags, in_place=in_place)


def engine_on_shared_weights(spec: Any, device: torch.device, shared: Any | None, rank: int) -> Engine | None:
    """An engine whose parameters are ``shared``'s tensors (runtime.weights.service.SharedWeights), built without
    building or loading a model (the module tree on the meta device, bound to them); None where it cannot read
    them in place: an accelerator (its weights live on the device), vLLM, LoRA, no reader slot for ``rank``, a buffer
    in another dtype than ``model.dtype``, or ``TANDEM_SHARED_WEIGHTS=copy``."""
    if shared_weights_mode() == "copy" or shared is None or rank >= shared.reader_slots:
        return None
    if device.type != "cpu" or spec.rollout.engine != "builtin":
        return None
    if spec.model.lora is not None:  # the buffer holds adapters only: the engine copies them onto its own base
        return None
    policy = PublishedPolicy(spec.model, device)
    model = policy.bind(shared.tensors)
    bound = model.state_dict()
    if any(bound[name].data_ptr() != tensor.data_ptr() for name, tensor in shared.tensors.items()):
        policy.release()  # .to() converted some: they would be copies, never updated
        return None
    r = spec.rollout
    engine = Engine(model, engine_tokenizer(spec), device, r.max_batch_size, r.max_batch_tokens, owns_model=True)
    engine.version = -1  # no work runs before the first reading
    return engine


class RemoteLLMRollout:
    """A remote instance's engine and task (:mod:`runtime.rollout.remote`), built once and kept across sessions
    with (restarted) trainers: loading a model is the slow part of a reconnection."""

    def __init__(self, rank: int, spec: Any, device: torch.device):
        self.rank, self.spec = rank, spec
        self.engine = build_engine(None, None, device, spec)
        self.tokenizer = self.engine.tokenizer
        self.task = build_task(spec)

    def session(self, sub: Any, conn: Any, flags: Any, state: bytes | None = None) -> RolloutInstance:
        """The instance loop for one trainer; an LLM instance has no state to continue from (``state`` unused:
        its work items carry their seeds)."""
        self.engine.update_weights(None, -1)  # no work runs before this trainer's weights arrive
        return RolloutInstance(
            self.rank, self.spec, self.engine, self.tokenizer, self.task, sub, conn, flags, shm=False
        )

    def close(self) -> None:
        pass  # the engine and task go with the process
