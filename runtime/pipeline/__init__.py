"""The pipeline: :func:`run` drives a spec to its end in the mode it names.

``driver`` holds what every mode shares (:class:`~runtime.pipeline.driver.RunContext`: the trainer,
weights, checkpoints, metrics and directives of one run); ``inline`` runs sync and colocated
(generation inside the trainer process), ``async_mode`` the disaggregated pipeline (rollout
processes, remote instances, bounded staleness). The modes build on the driver; only this entry
point knows them all.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime import processes
from runtime.control import Control
from runtime.pipeline.async_mode import AsyncMode
from runtime.pipeline.driver import RunContext
from runtime.pipeline.inline import InlineMode
from runtime.spec import RunSpec


def run(
    spec: RunSpec,
    resume: str | Path | None = None,
    reporters: Any = None,
    stop: Callable[[int, dict[str, float]], bool] | None = None,
    control: Control | None = None,
    rotate_checkpoints: bool = True,
) -> dict[str, Any]:
    """Run ``spec`` to ``pipeline.steps`` (continuing from the checkpoint ``resume`` when given).

    ``stop(step, metrics)``, checked after every step, ends the run early as if that step were
    the last (final evaluation and checkpoint included): a wall-clock budget, for instance.
    ``control`` brings directives (pause, stop, rollback, ...), applied at step boundaries, and
    receives the run's status. Returns the final step's metrics, the evaluations, the outcome
    (completed, stopped, preempted, cancelled), and a trace of the issue indices consumed per
    step / dropped / left over (queue and in flight) at the end. ``rotate_checkpoints=False`` leaves
    every checkpoint in place (``spec.checkpoint`` still recorded as written): the caller owns retention.
    """
    processes.warm_up_for(spec)  # children fork from it; its imports overlap building the trainer
    ctx = RunContext(spec, Path(resume) if resume is not None else None, reporters, stop, control, rotate_checkpoints)
    error: BaseException | None = None
    try:
        if ctx.spec.pipeline.mode == "async":
            return AsyncMode(ctx).run()
        return InlineMode(ctx).run()
    except BaseException as exc:
        error = exc
        raise
    finally:
        ctx.close_trainer()
        ctx.close_control(error)
        ctx.reporters.close()


__all__ = ["run"]
