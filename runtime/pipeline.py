"""The pipeline: one driver loop per mode, all from the same spec.

* ``sync`` — the baseline: generate a step's prompts, train, copy the new
  weights into the engine, repeat. The trainer idles while generating.
* ``colocated`` — the engine *is* the trainer's model (zero-copy weight sync);
  generation and training alternate on the same devices, optionally with the
  optimizer state offloaded to host memory while generating.
* ``async`` — ``resources.rollout_workers`` rollout processes (spawned, each
  with its own engine and threads) generate continuously into the bounded
  :class:`~runtime.queue.SampleQueue` while the trainer trains; weights reach
  them through the shared-memory :class:`~runtime.weights.WeightService`.
  A sample whose oldest token is more than ``max_policy_lag`` versions behind
  the trainer when it is consumed is never trained on: ``throttle`` keeps it
  from being generated (work items carry the oldest version allowed to
  generate them), ``drop`` discards and counts it, ``sync`` regenerates its
  prompt with the current weights (lock-step for that prompt).

The driver only calls roles (``runtime.roles``: prompt source, rollout
worker; ``runtime.trainer``; ``runtime.evaluator``) and never looks inside a
sample. Every ``checkpoint.interval`` steps (and at the end) the full state
is saved: trainer (policy, critic, optimizers, schedulers), RNG states, data
cursor, the queue's contents and the prompts in flight, weight version, step
and the metrics cursor; :func:`run` with ``resume`` continues from it.
Rollout processes keep no RNG state: a batch's sampling seed is a function of
the run seed and the batch's issue index.
"""

from __future__ import annotations

import os
import queue as std_queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from runtime import metrics as M
from runtime.evaluator import BackgroundEvaluator, evaluate
from runtime.queue import QueueClosed, SampleQueue
from runtime.roles import (
    ConsistencyProbe,
    PromptSource,
    RolloutWorker,
    WorkItem,
    build_engine,
    build_models,
    build_task,
    from_bytes,
    rollout_process,
)
from runtime.samples import Sample
from runtime.spec import RunSpec
from runtime.weights import WeightService

CHECKPOINT_DIR = "checkpoints"
RESOLVED_SPEC = "resolved_spec.yaml"


class PipelineError(RuntimeError):
    """The run cannot start or continue (bad resume target, a rollout process died, ...)."""


def thread_plan(spec: RunSpec) -> tuple[int, int]:
    """(trainer threads, threads per rollout process): the spec's value, or a fair split of the cores."""
    if spec.resources.threads_per_process:
        return spec.resources.threads_per_process, spec.resources.threads_per_process
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    if spec.pipeline.mode != "async":
        return cores, cores
    share = max(1, cores // (1 + spec.resources.rollout_workers))
    return share, share


def resolve_resume(path: str | Path) -> Path:
    """A checkpoint directory, or a run / checkpoints directory whose newest checkpoint is meant."""
    from runtime.checkpoint import CheckpointManager

    p = Path(path)
    if (p / "manifest.json").is_file():
        return p
    for root in (p, p / CHECKPOINT_DIR):
        if root.is_dir():
            latest = CheckpointManager(root).latest()
            if latest is not None:
                return latest
    raise PipelineError(f"--resume: no complete checkpoint in {p}")


class _Run:
    """What every mode shares: models, trainer, data, weights, checkpoints, reporters, evaluation."""

    def __init__(self, spec: RunSpec, resume: Path | None, reporters: Any = None, stop: Any = None):
        from runtime.checkpoint import CheckpointManager, load_checkpoint
        from runtime.devices import manual_seed_all, resolve_device, set_threads
        from runtime.trainer import Trainer

        self.spec = spec
        self.stop = stop
        self.final_step = spec.pipeline.steps  # lowered when ``stop`` ends the run early
        self.device = resolve_device(spec.resources.device, 0)
        resume_state = load_checkpoint(resolve_resume(resume)) if resume is not None else None
        self.trainer_threads, self.rollout_threads = thread_plan(spec)
        set_threads(self.trainer_threads)
        manual_seed_all(spec.seed)

        self.out_dir = spec.resolved_output_dir()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / RESOLVED_SPEC).write_text(yaml.safe_dump(spec.resolved(), sort_keys=False))

        self.models = build_models(spec, self.device)
        self.tokenizer = self.models.tokenizer
        self.trainer = Trainer(
            spec, self.models.policy, self.tokenizer, self.device, self.models.ref_policy, self.models.critic
        )
        self.task = build_task(spec)
        self.source = PromptSource(self.task.train_prompts())
        self.prompt_by_id = {p.prompt_id: p for p in self.source.prompts}
        self.eval_prompts = self.task.eval_prompts()
        self.weights = WeightService(keep=2)
        self.ckpt = CheckpointManager(
            self.out_dir / CHECKPOINT_DIR,
            keep_last=spec.checkpoint.keep_last,
            keep_best_metric=spec.checkpoint.keep_best_metric,
            keep_best_mode=spec.checkpoint.keep_best_mode,
        )
        self.start_step = 0
        self.dropped_total = 0
        self.resume_state = resume_state
        jsonl_cursor = None
        if resume_state is not None:
            self._load(resume_state)
            jsonl_cursor = resume_state["pipeline"].get("metrics_cursor")
        if reporters is None:
            reporters = M.build_reporters(spec.metrics, self.out_dir, spec.pipeline.steps, jsonl_cursor=jsonl_cursor)
        self.reporters = reporters
        self.trace: dict[str, list] = {"consumed": [], "dropped": [], "leftover": []}
        self.evals: list[dict] = []
        self.last_metrics: dict[str, float] = {}
        if resume_state is not None:
            self.reporters.event("resume", {"step": self.start_step})

    # ---- state -------------------------------------------------------------
    def _load(self, state: dict) -> None:
        from runtime.checkpoint import restore_rng

        self.trainer.load_state_dict(state["trainer"])
        restore_rng(state["rng"], strict=False)
        self.source.load_state_dict(state["source"])
        p = state["pipeline"]
        self.start_step = int(p["step"])
        self.dropped_total = int(p.get("dropped_total", 0))
        self.weights.load_state_dict({"version": int(p["version"])})

    def save_checkpoint(self, step: int, extra: dict[str, Any]) -> Path:
        from runtime.checkpoint import capture_rng
        from runtime.models import save_hf

        jsonl = self.reporters.find(M.JsonlReporter) if hasattr(self.reporters, "find") else None
        state = {
            "trainer": self.trainer.state_dict(),
            "rng": capture_rng(),
            "source": self.source.state_dict(),
            "pipeline": {
                "step": step,
                "version": self.weights.version,
                "mode": self.spec.pipeline.mode,
                "dropped_total": self.dropped_total,
                "metrics_cursor": jsonl.cursor() if jsonl is not None else None,
            },
            **extra,
        }

        def hf_export(directory: Path) -> None:
            save_hf(self.models.policy, self.tokenizer, directory)

        path = self.ckpt.save(
            step,
            state,
            hf_export=hf_export,
            metrics={k: v for k, v in self.last_metrics.items() if isinstance(v, int | float)},
        )
        self.reporters.event("checkpoint", {"step": step, "path": str(path)})
        return path

    def should_stop(self, step: int) -> bool:
        """Whether ``step`` is the last one (the spec's count, or the caller's stop condition)."""
        if step < self.final_step and self.stop is not None and self.stop(step, self.last_metrics):
            self.final_step = step
        return step >= self.final_step

    def checkpoint_due(self, step: int) -> bool:
        interval = self.spec.checkpoint.interval
        return step == self.final_step or (interval > 0 and step % interval == 0)

    def eval_due(self, step: int) -> bool:
        interval = self.spec.pipeline.eval_interval
        return interval > 0 and (step == self.start_step or step % interval == 0 or step == self.final_step)

    def run_eval(self, engine: Any) -> dict:
        r = self.spec.rollout
        return evaluate(engine, self.tokenizer, self.task, self.eval_prompts, r.max_new_tokens, r.max_batch_size)

    def record_eval(self, step: int, metrics: dict) -> None:
        self.evals.append({"step": step, **metrics})
        self.reporters.report(step, metrics)
        self.reporters.event("eval", {"step": step, M.EVAL_ACCURACY: metrics[M.EVAL_ACCURACY]})

    def step_metrics(
        self, trained: dict[str, float], split: dict[str, float], step_s: float, samples: list[Sample], gen_tokens: int
    ) -> dict[str, float]:
        out = dict(trained)
        out.update(split)
        gen_s = split[M.TIME_GENERATE]
        out[M.GEN_TOKENS_PER_S] = gen_tokens / gen_s if gen_s > 0 else 0.0
        out[M.SAMPLES_PER_S] = len(samples) / step_s if step_s > 0 else 0.0
        out[M.BUBBLE_TRAINER] = M.bubble_fraction(split[M.TIME_WAIT], step_s)
        out[M.SAMPLES_DROPPED_STALE] = self.dropped_total
        out[M.WEIGHTS_VERSION] = self.weights.version
        out["time/step"] = step_s
        return out

    def finish(self, final_step: int) -> dict[str, Any]:
        return {
            "mode": self.spec.pipeline.mode,
            "steps": final_step,
            "metrics": self.last_metrics,
            "eval": self.evals,
            "trace": self.trace,
            "output_dir": str(self.out_dir),
            "checkpoint": str(self.ckpt.latest()) if self.ckpt.latest() else None,
        }


def run(
    spec: RunSpec,
    resume: str | Path | None = None,
    reporters: Any = None,
    stop: Callable[[int, dict[str, float]], bool] | None = None,
) -> dict[str, Any]:
    """Run ``spec`` to ``pipeline.steps`` (continuing from the checkpoint ``resume`` when given).

    ``stop(step, metrics)``, checked after every step, ends the run early as if that step were
    the last (final evaluation and checkpoint included): a wall-clock budget, a stop command.
    Returns the final step's metrics, the evaluations, and a trace of the issue indices
    consumed per step / dropped / left over (queue and in flight) at the end.
    """
    ctx = _Run(spec, Path(resume) if resume is not None else None, reporters, stop)
    try:
        if spec.pipeline.mode == "async":
            return _run_async(ctx)
        return _run_inline(ctx)
    finally:
        ctx.reporters.close()


# ---- sync and colocated ---------------------------------------------------------


def _run_inline(ctx: _Run) -> dict[str, Any]:
    """sync and colocated: generation and training alternate in this process."""
    from runtime.models import build_policy

    spec = ctx.spec
    colocated = spec.pipeline.mode == "colocated"
    trainer = ctx.trainer
    if colocated:
        engine_model = ctx.models.policy  # zero copy: the engine reads the trainer's parameters
    else:
        engine_model, _ = build_policy(spec.model, ctx.device, seed=spec.seed)
        engine_model.eval()
    engine = build_engine(engine_model, ctx.tokenizer, ctx.device, spec)
    engine.update_weights(None if colocated else trainer.publish_state(), ctx.weights.version)
    worker = RolloutWorker(spec, engine, ctx.tokenizer, ctx.task, ctx.device)
    offload = colocated and spec.pipeline.offload_optimizer
    P = spec.pipeline.prompts_per_step

    step = ctx.start_step
    if ctx.eval_due(step):
        ctx.record_eval(step, ctx.run_eval(engine))
    while step < spec.pipeline.steps:
        timer = M.StepTimer()
        started = time.perf_counter()
        items = ctx.source.next(P, min_version=ctx.weights.version)
        with timer.section("generate"):
            if offload:
                trainer.offload_optimizer()
            with torch.no_grad():
                samples, gen_tokens = worker.generate(items)
            if offload:
                trainer.reload_optimizer()
        with timer.section("train"):
            trained = trainer.train_step(samples, step)
        with timer.section("weight_sync"):
            state = None if colocated else trainer.publish_state()
            version = ctx.weights.publish(state, version=trainer.version)
            engine.update_weights(state, version)
        step += 1
        split = timer.lap()
        split[M.TIME_WAIT] = split[M.TIME_GENERATE]  # lock-step: the trainer idles while generating
        ctx.trace["consumed"].append(sorted({s.group_id for s in samples}))
        ctx.last_metrics = ctx.step_metrics(trained, split, time.perf_counter() - started, samples, gen_tokens)
        ctx.last_metrics[M.QUEUE_DEPTH] = 0
        ctx.last_metrics[M.QUEUE_WATERMARK] = len(samples)
        ctx.reporters.report(step, ctx.last_metrics)
        last = ctx.should_stop(step)
        if ctx.eval_due(step):  # at the step boundary, timed apart from the step (time/eval)
            ctx.record_eval(step, ctx.run_eval(engine))
        if ctx.checkpoint_due(step):
            ctx.save_checkpoint(step, {"queue": _pack_queue(SampleQueue(1).snapshot()), "in_flight": []})
        if last:
            break
    return ctx.finish(step)


def _pack_queue(snapshot: dict[str, Any]) -> dict[str, Any]:
    from runtime.checkpoint import pack_samples

    snap = dict(snapshot)
    snap["items"] = pack_samples(snap["items"])
    snap["stale"] = pack_samples(snap["stale"])
    return snap


def _unpack_queue(state: dict[str, Any]) -> dict[str, Any]:
    from runtime.checkpoint import unpack_samples

    snap = dict(state)
    snap["items"] = unpack_samples(snap["items"])
    snap["stale"] = unpack_samples(snap["stale"])
    return snap


# ---- async ------------------------------------------------------------------------


class _AsyncState:
    """Trainer-side bookkeeping of the rollout processes: what is in flight, what came back."""

    def __init__(self, queue: SampleQueue):
        self.queue = queue
        self.lock = threading.Lock()  # guards in_flight + queue puts against a checkpoint snapshot
        self.in_flight: dict[int, WorkItem] = {}
        self.gen_s = 0.0
        self.gen_tokens = 0
        self.error: str | None = None
        self.ready = 0
        self.exited = 0
        self.done = False  # set once every rollout process has exited

    def in_flight_samples(self, group_size: int) -> int:
        with self.lock:
            return len(self.in_flight) * group_size

    def receive(self, out_q: Any, n_workers: int) -> None:
        """Receiver thread: rollout messages -> queue, until every rollout process has exited."""
        from runtime.queue import unpack_samples

        while self.exited < n_workers:
            try:
                kind, rank, payload = out_q.get(timeout=0.2)
            except std_queue.Empty:
                if self.done:
                    return
                continue
            if kind == "samples":
                blob, info = payload
                samples = unpack_samples(from_bytes(blob))
                with self.lock:
                    # never blocks: the trainer only issues work the queue has room for
                    try:
                        if not self.queue.put(samples, timeout=60):
                            self.error = "sample queue stayed full for 60 s (credit accounting broken)"
                    except QueueClosed:
                        continue
                    for index in info["indices"]:
                        self.in_flight.pop(index, None)
                    self.gen_s += info["gen_s"]
                    self.gen_tokens += info["tokens"]
            elif kind == "ready":
                self.ready += 1
            elif kind == "error":
                self.error = f"rollout process {rank} failed:\n{payload}"
                self.queue.close()
            elif kind == "exit":
                self.exited += 1

    def take_gen_counters(self) -> tuple[float, int]:
        with self.lock:
            out = (self.gen_s, self.gen_tokens)
            self.gen_s, self.gen_tokens = 0.0, 0
            return out


def _run_async(ctx: _Run) -> dict[str, Any]:
    spec = ctx.spec
    trainer = ctx.trainer
    G = spec.algorithm.group_size
    B = spec.samples_per_step
    lag = spec.pipeline.max_policy_lag
    policy = spec.pipeline.on_lag_exceeded
    queue = SampleQueue(spec.queue_capacity, max_policy_lag=lag, on_lag_exceeded=policy)
    st = _AsyncState(queue)
    if ctx.resume_state is not None:
        queue.restore(_unpack_queue(ctx.resume_state["queue"]))
        in_flight = [WorkItem.unpack(d) for d in ctx.resume_state["in_flight"]]
        ctx.source.give_back(in_flight)  # in-flight prompts at checkpoint time are re-issued first
        stale = queue.pop_stale()  # stale but not yet handled when the checkpoint was taken
        if stale:
            _handle_stale(ctx, queue, stale, policy)
    if B > queue.capacity:
        raise PipelineError(f"pipeline.queue_capacity: {queue.capacity} is smaller than one step's {B} samples")

    ctx.weights.keep = max(2, lag + 1)  # every version a consumable sample can come from
    probe = ConsistencyProbe(spec, ctx.device, max_samples=min(G, 4))  # a sample of the batch: cheap
    mp = torch.multiprocessing.get_context("spawn")
    shared = ctx.weights.shared_handle(trainer.publish_state(), mp)
    ctx.weights.initialize(trainer.publish_state())
    work_q, out_q, stop = mp.Queue(), mp.Queue(), mp.Event()
    n_workers = spec.resources.rollout_workers
    procs = [
        mp.Process(
            target=rollout_process,
            args=(rank, spec.resolved(), shared, work_q, out_q, stop, ctx.rollout_threads),
            name=f"rollout-{rank}",
            daemon=True,
        )
        for rank in range(n_workers)
    ]
    for p in procs:
        p.start()
    receiver = threading.Thread(target=st.receive, args=(out_q, n_workers), name="receiver", daemon=True)
    receiver.start()
    evaluator = None
    if spec.pipeline.eval_interval > 0:
        evaluator = BackgroundEvaluator(lambda: _eval_engine(ctx), ctx.run_eval)
    per_message = max(1, min(spec.pipeline.prompts_per_step, spec.rollout.max_batch_size // G))

    def top_up(next_take: int) -> None:
        """Issue work while the queue has room for it (credits), each message within one step's share.

        ``next_take``: the trainer version at its next ``take`` (the current one before this step's
        take, one more after it)."""
        while True:
            with st.lock:
                ahead = len(queue) + len(st.in_flight) * G
                room = queue.capacity - ahead
                to_boundary = (B - ahead % B) // G  # a message never straddles two steps' shares
                n = min(per_message, room // G, max(1, to_boundary))
                if n < 1:
                    return
                # throttle: the message is consumed around version + ahead // B; it must be generated
                # with weights at most `lag` versions older than that
                min_version = max(0, next_take + ahead // B - lag) if policy == "throttle" else 0
                items = ctx.source.next(n, min_version=min_version)
                for it in items:
                    st.in_flight[it.index] = it
            work_q.put([it.pack() for it in items])

    def check_alive() -> None:
        if st.error:
            raise PipelineError(st.error)
        dead = [p.name for p in procs if not p.is_alive()]
        if dead:
            raise PipelineError(f"rollout process(es) {', '.join(dead)} exited unexpectedly")

    step = ctx.start_step
    try:
        if evaluator is not None and ctx.eval_due(step):
            evaluator.submit(step, ctx.weights.version, ctx.weights.state(ctx.weights.version))
        queue.reset_watermark()
        while step < spec.pipeline.steps:
            timer = M.StepTimer()
            started = time.perf_counter()
            top_up(trainer.version)
            with timer.section("wait"):
                batch = None
                while batch is None:
                    try:
                        batch = queue.take(B, trainer.version, timeout=0.2)
                    except QueueClosed:
                        check_alive()
                        raise
                    stale = queue.pop_stale()
                    if stale:
                        _handle_stale(ctx, queue, stale, policy)
                    if batch is None:
                        check_alive()
                        top_up(trainer.version)
            stats = queue.stats()
            top_up(trainer.version + 1)  # refill at once so the rollouts keep generating while we train
            with timer.section("train"):
                trained = trainer.train_step(batch, step)
            if M.CONSISTENCY_KL not in trained:  # no sample of the trainer's own version in this batch
                trained.update(probe.measure(batch, ctx.weights))
            with timer.section("weight_sync"):
                version = ctx.weights.publish(trainer.publish_state(), version=trainer.version)
            step += 1
            gen_s, gen_tokens = st.take_gen_counters()
            timer.add("generate", gen_s)
            split = timer.lap()
            ctx.trace["consumed"].append(sorted({s.group_id for s in batch}))
            ctx.last_metrics = ctx.step_metrics(trained, split, time.perf_counter() - started, batch, gen_tokens)
            ctx.last_metrics[M.QUEUE_DEPTH] = stats.depth
            ctx.last_metrics[M.QUEUE_WATERMARK] = stats.high_water
            queue.reset_watermark()
            ctx.reporters.report(step, ctx.last_metrics)
            last = ctx.should_stop(step)
            if evaluator is not None:
                for eval_step, result in evaluator.results():
                    ctx.record_eval(eval_step, result)
                if ctx.eval_due(step):
                    evaluator.submit(step, version, ctx.weights.state(version))
            if ctx.checkpoint_due(step):
                with st.lock:
                    snap = queue.snapshot()
                    in_flight_state = [it.pack() for it in st.in_flight.values()]
                ctx.save_checkpoint(step, {"queue": _pack_queue(snap), "in_flight": in_flight_state})
            if last:
                break
    finally:
        stop.set()
        for _ in procs:
            work_q.put(None)
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
        st.done = True  # every process has exited: the receiver drains what they sent, then stops
        receiver.join(timeout=60)
        work_q.cancel_join_thread()
        if evaluator is not None:
            for eval_step, result in evaluator.close(wait=step == ctx.final_step):
                ctx.record_eval(eval_step, result)
    with st.lock:
        ctx.trace["leftover"] = sorted(
            {s.group_id for s in queue.snapshot()["items"]} | set(st.in_flight) | {w.index for w in ctx.source.reissue}
        )
    return ctx.finish(step)


def _handle_stale(ctx: _Run, queue: SampleQueue, stale: list[Sample], policy: str) -> None:
    """drop: count and forget; throttle / sync: regenerate the prompt with the current weights."""
    groups = sorted({s.group_id: s.prompt_id for s in stale}.items())
    ctx.dropped_total += len(stale)
    if policy == "drop":
        ctx.trace["dropped"].extend(g for g, _ in groups)
        return
    queue.release([s.sample_id for s in stale])  # the regenerated group reuses the ids
    items = [WorkItem(index=g, prompt=ctx.prompt_by_id[pid]) for g, pid in groups]
    ctx.source.give_back(items, min_version=ctx.trainer.version)


def _eval_engine(ctx: _Run) -> Any:
    from runtime.models import build_policy

    model, _ = build_policy(ctx.spec.model, ctx.device, seed=ctx.spec.seed)
    model.eval()
    return build_engine(model, ctx.tokenizer, ctx.device, ctx.spec)
