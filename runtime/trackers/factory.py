"""The trackers a ``MetricsSpec`` names (``metrics.reporters``), each as a :class:`BackgroundTracker`.

The tracker modules are imported here, but none imports its library before its thread starts it: a run
without trackers loads none of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runtime.trackers.background import BackgroundTracker, Notify, Tracker
from runtime.trackers.mlflow import MlflowTracker
from runtime.trackers.params import flat_params
from runtime.trackers.tensorboard import TENSORBOARD_DIR, TensorBoardTracker
from runtime.trackers.wandb import WandbTracker


def make_tracker(
    name: str,
    metrics_spec: Any,
    output_dir: Path,
    run_name: str,
    resolved: Mapping[str, Any] | None,
    resumed: bool,
) -> Tracker:
    """The tracker ``name`` with its settings from ``metrics_spec`` (read here, on the run's thread)."""
    params = flat_params(resolved or {})
    if name == "tensorboard":
        return TensorBoardTracker(output_dir / TENSORBOARD_DIR, params)
    if name == "mlflow":
        return MlflowTracker(
            output_dir,
            tracking_uri=metrics_spec.mlflow_tracking_uri,
            experiment=metrics_spec.mlflow_experiment,
            run_name=run_name,
            params=params,
            resolved_spec=resolved,
            resumed=resumed,
        )
    if name == "wandb":
        return WandbTracker(
            output_dir,
            project=metrics_spec.wandb_project,
            mode=metrics_spec.wandb_mode,
            run_name=run_name,
            params=params,
            resumed=resumed,
        )
    raise ValueError(f"metrics.reporters: no tracker {name!r}")  # the spec's Literal admits no other


def tracker_reporters(
    metrics_spec: Any, output_dir: Path, run_spec: Any, notify: Notify, resumed: bool = False
) -> list[BackgroundTracker]:
    """One :class:`BackgroundTracker` per name in ``metrics_spec.reporters``; ``run_spec`` (a ``RunSpec``,
    or None) gives the run's name and its resolved fields, the trackers' parameters."""
    names = list(metrics_spec.reporters)
    if not names:
        return []
    run_name = run_spec.name if run_spec is not None else "run"
    resolved = run_spec.resolved() if run_spec is not None else None
    return [
        BackgroundTracker(make_tracker(name, metrics_spec, output_dir, run_name, resolved, resumed), notify)
        for name in names
    ]
