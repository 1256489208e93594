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

The parts: :mod:`~runtime.pipeline.rollout_ledger` (tickets, the receiver thread, accounting),
:mod:`~runtime.pipeline.instance_pool` (spawning, dispatch, scaling, supervision),
:mod:`~runtime.pipeline.remote_peers` (the TCP listener, remote instances and evaluator). This
module is the loop and the step-boundary hooks the driver calls.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from runtime import metrics as M
from runtime.contract import CONSISTENCY_KL, OUTCOME_CANCELLED, QUEUE_DEPTH, QUEUE_WATERMARK, ROLLOUT_ACTIVE
from runtime.evaluation.evaluator import BackgroundEvaluator
from runtime.evaluation.process import ProcessEvaluator
from runtime.evaluation.remote import RemoteEvaluator
from runtime.pipeline.driver import PipelineError, RunContext
from runtime.pipeline.instance_pool import InstancePool
from runtime.pipeline.remote_peers import RemotePeers, takes_remote_peers
from runtime.pipeline.rollout_ledger import RolloutLedger
from runtime.rollout.transfer import sweep
from runtime.rollout.wire import shm_prefix
from runtime.sample_queue import QueueClosed, QueueStats, SampleQueue
from runtime.samples import Sample
from runtime.weights.service import KEPT_ON


class AsyncMode:
    """async: rollout processes generate into the queue while the trainer trains."""

    def __init__(self, ctx: RunContext):
        spec = ctx.spec
        self.ctx = ctx
        self.G = spec.samples_per_item
        self.B = spec.samples_per_step
        self.policy = spec.pipeline.on_lag_exceeded
        self.queue = SampleQueue(
            spec.queue_capacity, max_policy_lag=spec.pipeline.max_policy_lag, on_lag_exceeded=self.policy
        )
        self.ledger = RolloutLedger(self.queue, ctx.weights, spec, ctx.workload, ctx.source)
        self.pool = InstancePool(ctx, self.ledger, self.queue)
        self.peers = RemotePeers(ctx, self.pool) if takes_remote_peers(spec) else None
        if ctx.resume_state is not None:
            ctx.source.give_back(self.ledger.load_state(ctx.resume_state))  # in flight then: issued again first
            self._handle_stale()  # stale but not yet handled when the checkpoint was taken
        if self.B > self.queue.capacity:
            raise PipelineError(
                f"pipeline.queue_capacity: {self.queue.capacity} is smaller than one step's {self.B} samples"
            )
        ctx.weights.keep = max(2, spec.pipeline.max_policy_lag + 1)  # every version a consumable sample can come from
        ctx.weights.on_wait = self.pool.kill_if_hung  # a publish waiting on a frozen reader must not wait for ever
        self.steps_done = ctx.start_step
        self.evaluator: BackgroundEvaluator | ProcessEvaluator | RemoteEvaluator | None = None

    # ---- the loop ----
    def run(self) -> dict[str, Any]:
        ctx = self.ctx
        # a sample: cheap; scored where the weight service keeps its versions, reading them in place
        probe = ctx.workload.consistency_probe(ctx.spec, KEPT_ON, max_samples=min(self.G, 4))
        self.pool.share_weights(ctx.trainer.publish_state())
        # Kept before anyone may connect: a remote instance is admitted with the current version's weights,
        # and one waiting for the endpoint file connects the moment it appears.
        ctx.weights.initialize(ctx.trainer.publish_state())
        if self.peers is not None:
            self.peers.listen()
            if self.peers.evaluator is not None:
                self.params_changed()  # the remote evaluator is the evaluator from now on
        receiver = threading.Thread(target=self.ledger.receive, name="receiver", daemon=True)
        step = ctx.start_step
        ended = False
        try:
            self._start(receiver, step)
            while step < ctx.spec.pipeline.steps:
                timer, started = M.StepTimer(), time.perf_counter()
                batch, stats, trained = self._train_on_next_batch(step, timer, probe)
                step += 1
                self._report_step(step, timer, started, batch, stats, trained)
                nxt = ctx.boundary(step, self)
                if nxt is None:
                    break
                if nxt != step:  # rolled back
                    self.queue.reset_watermark()
                step = nxt
            ended = True
        finally:
            self.shutdown(receiver, wait_eval=step == ctx.final_step and ctx.ending != OUTCOME_CANCELLED, ended=ended)
        self._trace_leftover()
        return ctx.finish(step)

    def _start(self, receiver: threading.Thread, step: int) -> None:
        ctx = self.ctx
        self.pool.spawn_local()
        receiver.start()
        self.params_changed()  # the evaluator, when evaluation is on
        if ctx.eval_due(step):
            self.evaluate(step)
            ctx.eval_step = step
        ctx.publish_status(step, **self.pool.status())
        self.queue.reset_watermark()

    def _train_on_next_batch(
        self, step: int, timer: M.StepTimer, probe: Any
    ) -> tuple[list[Sample], QueueStats, dict[str, float]]:
        """Wait for the next batch, train on it and publish the new weights."""
        ctx, trainer = self.ctx, self.ctx.trainer
        self.pool.supervise()  # a dead process's work is issued again before it is waited for
        self._top_up(trainer.version)
        with timer.section("wait"):
            batch = self._next_batch()
        stats = self.queue.stats()
        self._top_up(trainer.version + 1)  # refill at once so the rollouts keep generating while we train
        with timer.section("train"):
            trained = trainer.train_step(batch, step)
        if CONSISTENCY_KL not in trained:  # no sample of the trainer's own version in this batch
            trained.update(probe.measure(batch, ctx.weights))
        with timer.section("weight_sync"):
            ctx.weights.publish(trainer.publish_state(), version=trainer.version)
        return batch, stats, trained

    def _report_step(
        self,
        step: int,
        timer: M.StepTimer,
        started: float,
        batch: list[Sample],
        stats: QueueStats,
        trained: dict[str, float],
    ) -> None:
        """The step's metrics, the scaling that follows the watermark, and the run's status."""
        ctx = self.ctx
        gen_s, gen_tokens = self.ledger.take_gen_counters()
        timer.add("generate", gen_s)
        split = timer.lap()
        ctx.trace["consumed"].append(sorted({s.group_id for s in batch}))
        metrics = ctx.step_metrics(trained, split, time.perf_counter() - started, batch, gen_tokens)
        ctx.last_metrics = metrics
        metrics[QUEUE_DEPTH] = stats.depth
        metrics[QUEUE_WATERMARK] = stats.high_water
        metrics.update(self.ledger.step_metrics(self.pool.active_ranks()))
        metrics[ROLLOUT_ACTIVE] = self.pool.scaler.active
        self.steps_done = step
        self.pool.scale(step, self.queue.stats().high_water / self.queue.capacity)
        self.queue.reset_watermark()
        ctx.reporters.report(step, metrics)
        self.collect_evals()
        ctx.publish_status(step, **self.pool.status())

    def _next_batch(self) -> list[Sample]:
        """Wait for one step's samples, supervising and topping up meanwhile."""
        trainer = self.ctx.trainer
        batch = None
        while batch is None:
            try:
                batch = self.queue.take(self.B, trainer.version, timeout=0.2)
            except QueueClosed:
                self.pool.supervise()
                raise
            self._handle_stale()
            if batch is None:
                self.pool.supervise()
                self._top_up(trainer.version)
        return batch

    def _top_up(self, next_take: int) -> None:
        self.pool.top_up(next_take, self.steps_done)

    def _handle_stale(self) -> None:
        """drop: count and forget; throttle / sync: regenerate the prompt with the current weights."""
        stale = self.queue.pop_stale()
        if not stale:
            return
        ctx = self.ctx
        ctx.dropped_total += len(stale)
        if self.policy == "drop":
            ctx.trace["dropped"].extend(sorted({s.group_id for s in stale}))
            return
        self.queue.release([s.sample_id for s in stale])  # the regenerated group reuses the ids
        ctx.source.regenerate(stale, min_version=ctx.trainer.version)

    def _trace_leftover(self) -> None:
        ctx = self.ctx
        with self.ledger.lock:
            ctx.trace["reward_dropped"] = list(self.ledger.reward_dropped)
            ctx.trace["leftover"] = sorted(
                {s.group_id for s in self.queue.snapshot()["items"]}
                | set(self.ledger.in_flight)
                | {w.index for w in ctx.source.reissue}
            )

    def shutdown(self, receiver: threading.Thread, wait_eval: bool, ended: bool = True) -> None:
        """Stop the rollout instances. Remote ones are told the run ended only when it did (``ended``);
        after a failure they wait for a restarted trainer instead."""
        slots = self.pool.close_admission()
        if self.peers is not None:
            self.peers.stop_listening(ended)
        self.pool.stop(slots, ended)
        self.ledger.done = True  # every process has exited: the receiver drains what they sent, then stops
        if receiver.is_alive():
            receiver.join(timeout=60)
        sweep(shm_prefix(os.getpid(), 0))  # what no one will read any more
        if self.evaluator is not None:
            self._record_evals(self.evaluator.close(wait=wait_eval))
        if self.peers is not None:
            self.peers.release_evaluator(ended)
        self.pool.report_news()  # what happened since the last step

    def collect_evals(self) -> None:
        if self.evaluator is not None:
            self._record_evals(self.evaluator.results())

    def _record_evals(self, results: list[tuple[int, dict]]) -> None:
        for eval_step, result in results:
            self.ctx.record_eval(eval_step, result)

    # ---- _Mode: the step boundary's hooks ----
    def evaluate(self, step: int) -> None:
        if self.evaluator is not None:
            version = self.ctx.weights.version
            self.evaluator.submit(step, version, self.ctx.weights.state(version))

    def checkpoint(self, step: int) -> None:
        self.ctx.save_checkpoint(step, self.ledger.checkpoint_state())

    def forget_in_flight(self) -> None:
        self.pool.forget_in_flight()
        if self.evaluator is not None:  # evaluations of the abandoned timeline are reported before the rollback
            self._record_evals(self.evaluator.close(wait=False))
            self.evaluator = None

    def restore(self, state: dict[str, Any], offset: int) -> None:
        ctx = self.ctx
        ctx.source.give_back(self.ledger.load_state(state, offset))
        ctx.weights.publish(ctx.trainer.publish_state(), version=ctx.trainer.version)
        self._handle_stale()
        self.params_changed()

    def params_changed(self) -> None:
        spec = self.ctx.spec
        self.queue.max_policy_lag = spec.pipeline.max_policy_lag
        self.ctx.weights.keep = max(2, spec.pipeline.max_policy_lag + 1)
        if self.evaluator is None and spec.pipeline.eval_interval > 0:
            remote = self.peers.evaluator if self.peers is not None else None
            self.evaluator = remote or _local_evaluator(self.ctx)

    def tick(self) -> None:
        self.pool.supervise()
        self.collect_evals()


def _local_evaluator(ctx: RunContext) -> BackgroundEvaluator | ProcessEvaluator:
    """The evaluator on the trainer's host: a process of its own when the workload asks, else a thread.

    Without a device of its own the thread evaluates on the host, beside the weight service's kept
    versions, so the workload can read them in place instead of copying the policy onto the trainer's
    device (the built-in engine; vLLM stays on the trainer's device)."""
    if ctx.workload.evaluates_in_process:
        return ProcessEvaluator(ctx.spec.resolved(), str(_eval_device(ctx, ctx.device)))
    # vLLM loads weights of its own onto an accelerator: without a device of its own it keeps the trainer's
    device = _eval_device(ctx, KEPT_ON if ctx.spec.rollout.engine == "builtin" else ctx.device)
    return BackgroundEvaluator(lambda: ctx.workload.eval_engine(ctx.spec, device, ctx.models), ctx.run_eval)


def _eval_device(ctx: RunContext, default: Any) -> Any:
    """The evaluator's device: its own with ``resources.eval_devices``, else ``default``."""
    from runtime.devices import resolve_device
    from runtime.placement import eval_device_index

    index = eval_device_index(ctx.spec)
    return default if index is None else resolve_device(ctx.spec.resources.device, index)
