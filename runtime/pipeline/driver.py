"""The pipeline: one driver loop per mode, all from the same spec.

* ``sync`` — the baseline: generate a step's prompts, train, copy the new
  weights into the engine, repeat. The trainer idles while generating.
* ``colocated`` — the engine *is* the trainer's model (zero-copy weight sync);
  generation and training alternate on the same devices, optionally with the
  optimizer state offloaded to host memory while generating.
* ``async`` — ``resources.rollout_workers`` rollout processes (spawned, each
  with its own engine, threads, work queue and result pipe) generate
  continuously into the bounded :class:`~runtime.sample_queue.SampleQueue` while the
  trainer trains; weights reach them through the shared-memory
  :class:`~runtime.weights.service.WeightService`. A sample whose oldest token is more
  than ``max_policy_lag`` versions behind the trainer when it is consumed is
  never trained on: ``throttle`` keeps it from being generated (work items
  carry the oldest version allowed to generate them), ``drop`` discards and
  counts it, ``sync`` regenerates its prompt with the current weights
  (lock-step for that prompt). A rollout process that dies is replaced (up to
  ``resources.rollout_restarts`` times per rank) and its unfinished work is
  issued again: every message carries a ticket, and a result whose ticket the
  trainer no longer holds (a dead process's, or from before a rollback) is
  dropped, so no sample is lost or trained on twice.

The modes live in ``runtime.pipeline.inline`` (sync, colocated) and
``runtime.pipeline.async_mode``; what they share — models, trainer, data, weights,
checkpoints, reporters, evaluation and the step boundary with its
directives — is :class:`RunContext` here.

The driver reaches the workload only through its protocol (``runtime.workloads.base.Workload``:
models, trainer, data source, generation, evaluation, export; the LLM's is ``runtime.workloads.llm``)
and never looks inside a sample. Every ``checkpoint.interval`` steps (and at the end) the full state
is saved: trainer (policy, critic, optimizers, schedulers), RNG states, data
cursor, the queue's contents and the prompts in flight, weight version, step
and the metrics cursor; :func:`run` with ``resume`` continues from it.
Rollout processes keep no RNG state: a batch's sampling seed is a function of
the run seed and the batch's issue index.

At every step boundary (after the step's metrics are reported) the
directives of a :class:`~runtime.control.Control` are applied in order —
pause, resume, stop, preempt, cancel, rollback, set_params; see
``docs/runtime-control.md`` for their exact semantics — and the run's status
is published on it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import yaml

from runtime import metrics as M
from runtime.contract import (
    BUBBLE_TRAINER,
    CHECKPOINT_DIR,
    EVENT_CHECKPOINT,
    EVENT_RESUME,
    EVENT_ROLLBACK,
    OUTCOME_CANCELLED,
    OUTCOME_COMPLETED,
    OUTCOME_OF_COMMAND,
    REWOUND_DIR,
    SAMPLES_DROPPED_STALE,
    SAMPLES_PER_S,
    TIME_GENERATE,
    TIME_WAIT,
    WEIGHTS_VERSION,
    live_param_problems,
)
from runtime.control import Control, Directive
from runtime.models.implementation import pinned
from runtime.sample_queue import PackError
from runtime.samples import Sample
from runtime.spec import RunSpec
from runtime.telemetry import with_telemetry
from runtime.weights.service import WeightService
from runtime.workloads.base import Workload, workload_for

if TYPE_CHECKING:
    from runtime.checkpoint import CheckpointManager

RESOLVED_SPEC = "resolved_spec.yaml"
PAUSE_POLL_S = 0.5  # while paused: how often rollout processes are supervised between directives


class PipelineError(RuntimeError):
    """The run cannot start or continue (bad resume target, a rollout process died too often, ...)."""


def thread_plan(spec: RunSpec) -> tuple[int, int]:
    """(trainer threads, threads per rollout process): the spec's value, or a fair split of the cores."""
    if spec.resources.threads_per_process:
        return spec.resources.threads_per_process, spec.resources.threads_per_process
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    ranks = spec.resources.trainer_devices
    if spec.pipeline.mode != "async":
        share = max(1, cores // ranks)
        return share, share
    share = max(1, cores // (ranks + spec.resources.rollout_workers))
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


def _trainer_device(spec: RunSpec) -> Any:
    from runtime.devices import resolve_device

    return resolve_device(spec.resources.device, 0)


def _read_resume(resume: Path | None) -> tuple[Path | None, dict | None]:
    """The checkpoint a resumed run continues from, and its state (None, None for a fresh run)."""
    from runtime.checkpoint import load_checkpoint

    resume_path = resolve_resume(resume) if resume is not None else None
    resume_state = load_checkpoint(resume_path) if resume_path is not None else None
    return resume_path, resume_state


def _prepare_output_dir(spec: RunSpec) -> Path:
    """The run's output directory, with the resolved spec it runs."""
    out_dir = spec.resolved_output_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / RESOLVED_SPEC).write_text(yaml.safe_dump(spec.resolved(), sort_keys=False))
    return out_dir


class _Mode(Protocol):
    """What the step-boundary logic needs from a mode's driver."""

    def evaluate(self, step: int) -> None: ...

    def checkpoint(self, step: int) -> None: ...

    def forget_in_flight(self) -> None:
        """Rollback, before the state changes: generation issued so far must never be trained on."""

    def restore(self, state: dict[str, Any], offset: int) -> None:
        """Rollback: the mode's part of ``state`` (sample versions shifted by ``offset``); publish the weights."""

    def params_changed(self) -> None: ...

    def tick(self) -> None:
        """While paused, between directives (async: supervise the rollout processes)."""


class RunContext:
    """What every mode shares: models, trainer, data, weights, checkpoints, reporters, evaluation, control."""

    def __init__(
        self,
        spec: RunSpec,
        resume: Path | None,
        reporters: Any = None,
        stop: Any = None,
        control: Control | None = None,
        rotate_checkpoints: bool = True,
    ):
        self.spec = spec.model_copy(deep=True)  # live parameter changes must not leak into the caller's spec
        self.workload: Workload = workload_for(self.spec)
        self._init_control(stop, control)
        self.device = _trainer_device(self.spec)
        if self.spec.workload == "llm":  # one implementation for every role, recorded in the resolved spec
            self.spec.model = pinned(self.spec.model, self.device.type)
        resume_path, self.resume_state = _read_resume(resume)
        self._set_threads_and_seed()
        self.out_dir = _prepare_output_dir(self.spec)
        self._build_models_and_trainer()
        self._build_data()
        self.weights = WeightService(keep=2)
        self.ckpt = self._checkpoint_manager(rotate_checkpoints)
        self._restore_progress(self.resume_state, resume_path)
        self.reporters = reporters if reporters is not None else self._build_reporters(self.resume_state)
        self.reporters = with_telemetry(self.reporters, self.spec)  # device/<role>/... metrics (runtime/telemetry.py)
        self._init_trace_and_marks(resume_path)
        if self.resume_state is not None:
            self.reporters.event(EVENT_RESUME, {"step": self.start_step})

    # ---- building the run --------------------------------------------------
    def _init_control(self, stop: Any, control: Control | None) -> None:
        """How the run ends and what its controller sees: nothing decided yet."""
        self.stop = stop
        self.control = control
        self.final_step = self.spec.pipeline.steps  # lowered when ``stop`` or a stop directive ends the run early
        self.outcome = OUTCOME_COMPLETED
        self.paused = False
        self.ending: str | None = None  # "stopped" | "preempted" | "cancelled" once such a directive is taken
        self.stop_acks: list[Directive] = []  # stop / preempt, acknowledged once the final checkpoint is written
        self.status_step = 0

    def _set_threads_and_seed(self) -> None:
        from runtime.devices import manual_seed_all, set_threads

        self.trainer_threads, self.rollout_threads = thread_plan(self.spec)
        set_threads(self.trainer_threads)
        manual_seed_all(self.spec.seed)

    def _build_models_and_trainer(self) -> None:
        self.models = self.workload.build_models(self.spec, self.device)
        self.trainer = self._build_trainer()

    def _build_trainer(self) -> Any:
        """This process's trainer; with ``resources.trainer_devices`` > 1 the leader of a data-parallel
        group of trainer ranks (:mod:`runtime.train.group`)."""
        build = self.workload.build_trainer
        if self.spec.resources.trainer_devices == 1:
            return build(self.spec, self.models, self.device)
        from runtime.train.group import TrainerGroup, start_group

        group, followers = start_group(self.spec, self.trainer_threads)
        try:
            local = build(self.spec, self.models, self.device, group)
            return TrainerGroup(local, followers)
        except BaseException:
            TrainerGroup.abandon(followers)
            raise

    def _build_data(self) -> None:
        """The task (training work and held-out evaluation) and the data source over its training work."""
        self.task = self.workload.build_task(self.spec)
        self.source = self.workload.build_source(self.task)

    def _checkpoint_manager(self, rotate: bool) -> CheckpointManager:
        from runtime.checkpoint import CheckpointManager

        spec = self.spec
        return CheckpointManager(
            self.out_dir / CHECKPOINT_DIR,
            keep_last=spec.checkpoint.keep_last,
            keep_best_metric=spec.checkpoint.keep_best_metric,
            keep_best_mode=spec.checkpoint.keep_best_mode,
            rotate=rotate,  # off under the platform: retention is its (runtime.managed.entry)
        )

    def _restore_progress(self, resume_state: dict | None, resume_path: Path | None) -> None:
        """Step, counters, trainer, RNG, data cursor and weight version: from zero, or the checkpoint's."""
        self.start_step = 0
        self.dropped_total = 0
        if resume_state is not None and resume_path is not None:
            self._load(resume_state, resume_path)

    def _build_reporters(self, resume_state: dict | None) -> Any:
        """The spec's reporters; a resumed run's metrics file continues from the checkpoint's cursor."""
        jsonl_cursor = resume_state["pipeline"].get("metrics_cursor") if resume_state is not None else None
        return M.build_reporters(
            self.spec.metrics,
            self.out_dir,
            self.spec.pipeline.steps,
            jsonl_cursor=jsonl_cursor,
            run_spec=self.spec,
            resumed=resume_state is not None,
        )

    def _init_trace_and_marks(self, resume_path: Path | None) -> None:
        """What this timeline consumed, evaluated and checkpointed so far."""
        # consumed: group ids per step of the current timeline (a rollback moves rewound steps to "rewound")
        self.trace: dict[str, list] = {"consumed": [], "dropped": [], "leftover": [], "rewound": []}
        self.trace_start = self.start_step  # the step before trace["consumed"][0]
        self.dropped_marks = {self.start_step: 0}  # step -> len(trace["dropped"]) when its checkpoint was saved
        self.evals: list[dict] = []
        self.last_metrics: dict[str, float] = {}
        self.eval_step = -1  # the last step evaluated (or submitted for evaluation)
        self.ckpt_step = -1  # the step of the current timeline's newest checkpoint
        self.ckpt_path: Path | None = None
        if resume_path is not None:  # the checkpoint resumed from is this timeline's newest
            self.ckpt_step, self.ckpt_path = self.start_step, resume_path

    def close_trainer(self) -> None:
        close = getattr(self.trainer, "close", None)  # a TrainerGroup's followers stop here
        if close is not None:
            close()

    # ---- state -------------------------------------------------------------
    def _load_trainer(self, state: dict, path: Path) -> None:
        """The trainer's part of the checkpoint at ``path``: with its shards when it has them (fsdp)."""
        from runtime.checkpoint import shards_dir

        shards = shards_dir(path)
        if shards is None:
            self.trainer.load_state_dict(state["trainer"])
        else:
            self.trainer.load_state_dict(state["trainer"], shards)

    def _load(self, state: dict, path: Path) -> None:
        from runtime.checkpoint import restore_rng

        self._load_trainer(state, path)
        restore_rng(state["rng"], strict=False)
        self.source.load_state_dict(state["source"])
        p = state["pipeline"]
        self.start_step = int(p["step"])
        self.dropped_total = int(p.get("dropped_total", 0))
        self.weights.load_state_dict({"version": int(p["version"])})

    def save_checkpoint(self, step: int, extra: dict[str, Any]) -> Path:
        from runtime.checkpoint import capture_rng, checkpoint_info

        verify = getattr(self.trainer, "verify", None)  # data-parallel ranks: only rank 0's state is saved
        if verify is not None:
            verify()
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

        sharded = getattr(self.trainer, "sharded", False)  # fsdp: the models are in the ranks' shards

        def hf_export(directory: Path) -> None:
            if not sharded:
                self.workload.export_policy(self.models, directory)
                return
            with self.trainer.unsharded_policy() as policy:  # the full weights, gathered once
                self.workload.export_policy(dataclasses.replace(self.models, policy=policy), directory)

        path = self.ckpt.save(
            step,
            state,
            hf_export=hf_export,
            metrics={k: v for k, v in self.last_metrics.items() if isinstance(v, int | float)},
            write_shards=self.trainer.save_shards if sharded else None,
        )
        self.ckpt_step, self.ckpt_path = step, path
        self.dropped_marks[step] = len(self.trace["dropped"])
        info = checkpoint_info(path)  # its manifest: what the platform's checkpoint browser shows
        self.reporters.event(
            EVENT_CHECKPOINT,
            {
                "step": step,
                "path": str(path),
                "weight_version": self.weights.version,
                "size": info.size,
                "metrics": info.metrics,
            },
        )
        return path

    def should_stop(self, step: int) -> bool:
        """Whether ``step`` is the last one (the spec's count, a stop directive, or the caller's stop condition)."""
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
        return self.workload.evaluate(self.spec, engine, self.task)

    def record_eval(self, step: int, metrics: dict) -> None:
        self.evals.append({"step": step, **metrics})
        self.reporters.report(step, metrics)
        headline = self.workload.eval_metric
        self.reporters.event("eval", {"step": step, headline: metrics[headline]})

    def step_metrics(
        self, trained: dict[str, float], split: dict[str, float], step_s: float, samples: list[Sample], gen_tokens: int
    ) -> dict[str, float]:
        out = dict(trained)
        out.update(split)
        gen_s = split[TIME_GENERATE]
        out[self.workload.units_per_s_metric] = gen_tokens / gen_s if gen_s > 0 else 0.0
        out[SAMPLES_PER_S] = len(samples) / step_s if step_s > 0 else 0.0
        out[BUBBLE_TRAINER] = M.bubble_fraction(split[TIME_WAIT], step_s)
        out[SAMPLES_DROPPED_STALE] = self.dropped_total
        out[WEIGHTS_VERSION] = self.weights.version
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
            "outcome": self.outcome,
        }

    # ---- control: the step boundary ------------------------------------------
    def publish_status(self, step: int | None = None, **extra: Any) -> None:
        """Status, step (the last one reported, by default), weight version and ``extra`` on the control."""
        if step is not None:
            self.status_step = step
        if self.control is None:
            return
        status = "stopping" if self.ending else "paused" if self.paused else "running"
        self.control.update(status=status, step=self.status_step, weight_version=self.weights.version, **extra)

    def boundary(self, step: int, mode: _Mode) -> int | None:
        """After ``step``'s metrics are reported: apply the pending directives, evaluate and checkpoint
        when due, wait while paused. Returns the step to continue from (``step``, or the step of a
        checkpoint rolled back to), or None when the run ends here."""
        step = self._apply_directives(step, mode)
        while True:
            if self.ending == OUTCOME_CANCELLED:
                return None
            last = self.should_stop(step)
            if self.eval_due(step) and self.eval_step != step:
                mode.evaluate(step)
                self.eval_step = step
            if self.checkpoint_due(step) and self.ckpt_step != step:
                mode.checkpoint(step)
            self._ack_stops(step)
            if last:
                return None
            if not self.paused:
                return step
            assert self.control is not None  # only a directive pauses
            self.publish_status(step)
            while True:
                mode.tick()
                if self.control.wait(PAUSE_POLL_S):
                    break
            step = self._apply_directives(step, mode)

    def _apply_directives(self, step: int, mode: _Mode) -> int:
        if self.control is None:
            return step
        for d in self.control.take():
            try:
                step = self._apply(d, step, mode)
            except Exception as exc:  # the run fails because of it: answer it, or a restart would apply it again
                self.control.finished(d, False, f"failed: {exc}")
                raise
        self.publish_status(step)
        return step

    def _apply(self, d: Directive, step: int, mode: _Mode) -> int:
        """One directive at the boundary after ``step``; returns the step the run continues from."""
        assert self.control is not None
        done = self.control.finished
        if d.kind == "cancel":
            for pending in self.stop_acks:
                done(pending, False, "cancelled before the final checkpoint")
            self.stop_acks = []
            self.ending = self.outcome = OUTCOME_CANCELLED
            self.paused = False
            done(d, True, f"cancelled at step {step}")
        elif self.ending == OUTCOME_CANCELLED:
            done(d, False, "the run is ending (cancelled)")
        elif d.kind in ("stop", "preempt"):
            if self.ending is None:  # the first one decides the outcome; a second is acknowledged with it
                self.ending = self.outcome = OUTCOME_OF_COMMAND[d.kind]
                self.final_step = step
                self.paused = False
            self.stop_acks.append(d)
        elif self.ending is not None:
            done(d, False, f"the run is ending ({self.ending})")
        elif d.kind == "pause":
            done(d, True, "already paused" if self.paused else f"paused at step {step}")
            self.paused = True
        elif d.kind == "resume":
            done(d, True, f"resumed at step {step}" if self.paused else "not paused")
            self.paused = False
        elif d.kind == "set_params":
            ok, message = self._set_params(d.args, step, mode)
            done(d, ok, message)
        elif d.kind == "rollback":
            restored, message = self._rollback(d.args, step, mode)
            done(d, restored is not None, message)
            if restored is not None:
                step = restored
        else:  # Control.submit admits only known kinds; a new kind must be handled above
            done(d, False, f"kind: {d.kind!r} is not handled by this runtime")
        return step

    def _ack_stops(self, step: int) -> None:
        if not self.stop_acks or self.ckpt_step != step:
            return
        assert self.control is not None
        for d in self.stop_acks:
            self.control.finished(d, True, f"checkpoint at step {step}: {self.ckpt_path}")
        self.stop_acks = []

    def close_control(self, error: BaseException | None) -> None:
        """The run is over. Directives it never applied are left to the controller: pending ones stay
        in the Control, and one taken but unanswered (a stop whose checkpoint failed) is not answered
        either, so that a restarted attempt can apply them (the role decides; see runtime.managed.entry)."""
        if self.control is not None and error is None:
            self.control.update(status="finished")

    def _set_params(self, args: dict[str, Any], step: int, mode: _Mode) -> tuple[bool, str]:
        """Validate every parameter first, then apply all (or none)."""
        from pydantic import ValidationError

        params = args.get("params")
        problems = live_param_problems(params)
        if problems or not isinstance(params, dict):  # no problem means a dict: this narrows its type
            return False, "; ".join(f"args.{p['field']}: {p['message']}" for p in problems)
        trial = self.spec.model_copy(deep=True)
        for key, value in params.items():
            # the kind first: a directive may come from any controller, not only the platform's checked ones
            if key == "trainer.lr":
                if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                    return False, f"args.params.{key}: must be a number > 0, got {value!r}"
            elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
                return False, f"args.params.{key}: must be an integer >= 0, got {value!r}"
            if not self.spec.acts(key):  # recorded, it would act on nothing (runtime.spec.MODE_ONLY)
                return False, f"args.params.{key}: does not act in pipeline.mode {self.spec.pipeline.mode}"
            section, name = key.split(".")
            try:  # the spec's own bounds (validate_assignment)
                setattr(getattr(trial, section), name, value)
            except ValidationError as exc:
                return False, f"args.params.{key}: {exc.errors()[0]['msg']}"
        for key, value in params.items():
            section, name = key.split(".")
            setattr(getattr(self.spec, section), name, value)
            if key == "trainer.lr":
                self.trainer.set_lr(float(value))
        mode.params_changed()
        self.reporters.event("params", {"step": step, "params": dict(params)})
        return True, "set " + ", ".join(f"{k}={v}" for k, v in params.items())

    def _rollback(self, args: dict[str, Any], step: int, mode: _Mode) -> tuple[int | None, str]:
        """Restore the full state of one of this run's checkpoints. (None, why) when refused: nothing changed."""
        from runtime.checkpoint import CheckpointError, load_checkpoint, restore_rng

        raw = args.get("path")
        if not isinstance(raw, str) or not raw:
            return None, "args.path: required, a checkpoint directory of this run"
        root = self.ckpt.root.resolve()
        path = Path(raw).resolve()  # symlinks and .. resolved before the containment check
        if path == root or not path.is_relative_to(root):
            return None, f"args.path: {raw} is not inside this run's checkpoint directory {root}"
        try:
            state = load_checkpoint(path)  # manifest and checksums: a complete checkpoint only
        except CheckpointError as exc:
            return None, f"args.path: {raw} is not a complete checkpoint ({exc})"
        missing = [k for k in ("trainer", "rng", "source", "pipeline") if k not in state]
        if missing:
            return None, f"args.path: {raw} is not a pipeline checkpoint (no {', '.join(missing)})"
        target = int(state["pipeline"]["step"])
        want = args.get("step")
        if want is not None and (isinstance(want, bool) or not isinstance(want, int) or want != target):
            return None, f"args.step: {want!r} does not match the checkpoint's step {target}"

        # From here on the state changes. Results of generation issued so far are forgotten first.
        mode.forget_in_flight()
        new_version = self.weights.version + 1  # versions stay monotonic for staleness accounting
        offset = new_version - int(state["pipeline"]["version"])
        self._load_trainer(state, path)
        self.trainer.version = new_version
        restore_rng(state["rng"], strict=False)
        self.source.load_state_dict(state["source"])
        for item in self.source.reissue:  # versions of the checkpoint's timeline, renumbered
            item.min_version += offset
        self.dropped_total = int(state["pipeline"].get("dropped_total", 0))
        mode.restore(state, offset)  # publishes the restored weights as new_version
        aside = self._set_aside_after(target)
        self._rewind_trace(target)
        self.evals = [e for e in self.evals if e["step"] <= target]
        self.ckpt_step = self.eval_step = target
        self.ckpt_path = path
        self.last_metrics = {}
        payload: dict[str, Any] = {"step": target, "path": str(path), "weight_version": new_version}
        if aside:
            payload["set_aside"] = [str(p) for p in aside]
        self.reporters.event(EVENT_ROLLBACK, payload)
        return target, f"restored step {target}"

    def _set_aside_after(self, step: int) -> list[Path]:
        """Move the checkpoints after ``step`` (an abandoned timeline) out of the manager's view.

        Left in place, resuming would pick the newest of them instead of the current timeline's,
        and retention would count them and delete the new timeline's checkpoints."""
        later = [info.path for info in self.ckpt.list() if info.step > step]
        if not later:
            return []
        from runtime.checkpoint import step_dir_name

        parent = self.ckpt.root / REWOUND_DIR
        n = 1
        while (parent / f"{n:03d}-to-{step_dir_name(step)}").exists():
            n += 1
        dest = parent / f"{n:03d}-to-{step_dir_name(step)}"
        dest.mkdir(parents=True)
        moved = []
        for path in later:
            os.rename(path, dest / path.name)
            moved.append(dest / path.name)
        return moved

    def _rewind_trace(self, step: int) -> None:
        keep = step - self.trace_start
        if keep < 0:  # a checkpoint from before this process's first step: all of its trace is rewound
            keep, self.trace_start = 0, step
        mark = self.dropped_marks.get(step, len(self.trace["dropped"]))
        self.trace["rewound"].append(
            {"step": step, "consumed": self.trace["consumed"][keep:], "dropped": self.trace["dropped"][mark:]}
        )
        self.trace["consumed"] = self.trace["consumed"][:keep]
        self.trace["dropped"] = self.trace["dropped"][:mark]
        self.dropped_marks = {s: m for s, m in self.dropped_marks.items() if s <= step}


def pack_queue(snapshot: dict[str, Any], workload: Workload) -> dict[str, Any]:
    """A queue snapshot with its samples in the workload's packed form, for a checkpoint."""
    from runtime.checkpoint import CheckpointError

    snap = dict(snapshot)
    try:
        snap["items"] = workload.pack_samples(snap["items"])
        snap["stale"] = workload.pack_samples(snap["stale"])
    except PackError as exc:
        raise CheckpointError(str(exc)) from None
    return snap


def unpack_queue(state: dict[str, Any], workload: Workload, offset: int = 0) -> dict[str, Any]:
    """A checkpoint's queue; ``offset`` renumbers the samples' weight versions (after a rollback)."""
    from runtime.checkpoint import CheckpointError

    snap = dict(state)
    try:
        snap["items"] = workload.unpack_samples(dict(snap["items"]), offset)
        snap["stale"] = workload.unpack_samples(dict(snap["stale"]), offset)
    except PackError as exc:
        raise CheckpointError(str(exc)) from None
    return snap
