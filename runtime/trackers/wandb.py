"""Weights & Biases: a run in ``metrics.wandb_project``, ``offline`` (written to ``<output_dir>/wandb/`` for a
later ``wandb sync``: no network needed) or ``online`` (streamed; needs network and ``WANDB_API_KEY``).
The config is the resolved spec's fields; each checkpoint is a version of the run's ``checkpoint`` artifact:
its manifest, plus a reference to the directory (not uploaded; why in :mod:`runtime.trackers.mlflow`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from runtime.trackers.background import CHECKPOINT_MANIFEST, EVENT_CHECKPOINT, previous_run

RUN_ID_FILE = "wandb_run.json"  # the W&B run of this output directory, continued by a resumed run
STEP_KEY = "step"  # the x axis of every metric: the run's own step, which may go back (resume, late evaluation)


class WandbTracker:
    name = "wandb"

    def __init__(
        self,
        output_dir: str | Path,
        project: str,
        mode: Literal["offline", "online"],
        run_name: str,
        params: Mapping[str, str],
        resumed: bool,
    ):
        self.output_dir = Path(output_dir).absolute()
        self.project = project
        self.mode = mode
        self.run_name = run_name
        self._params = dict(params)
        self._resumed = resumed
        self._run: Any = None

    def start(self) -> None:
        import wandb  # only for a run that asks for wandb

        self.output_dir.mkdir(parents=True, exist_ok=True)
        run_id = self._resumed_run_id()
        self._run = wandb.init(
            project=self.project,
            name=self.run_name,
            mode=self.mode,
            dir=str(self.output_dir),
            config=self._params,
            id=run_id,
            resume="allow" if run_id else None,
            reinit="create_new",  # a second run in one process (tests, a notebook) is a run of its own
            # the run's stdout is the runtime's progress line: W&B must not wrap it
            settings=wandb.Settings(console="off", silent=True),
        )
        (self.output_dir / RUN_ID_FILE).write_text(json.dumps({"run_id": self._run.id, "project": self.project}))
        # W&B's own step must only grow; the run's step goes back on a resume and an async evaluation may
        # come late, so every metric is drawn against STEP_KEY instead
        self._run.define_metric(STEP_KEY)
        self._run.define_metric("*", step_metric=STEP_KEY)

    def _resumed_run_id(self) -> str | None:
        before = previous_run(self.output_dir / RUN_ID_FILE, self._resumed)
        if before is None:
            return None
        return str(before["run_id"]) if before.get("project") == self.project and before.get("run_id") else None

    def log_metrics(self, step: int, metrics: Mapping[str, float | int]) -> None:
        self._run.log({**metrics, STEP_KEY: step})

    def log_event(self, kind: str, payload: Mapping[str, Any]) -> None:
        if kind != EVENT_CHECKPOINT or not payload.get("path"):
            return
        import wandb

        checkpoint = Path(str(payload["path"]))
        artifact = wandb.Artifact(f"checkpoint-{self._run.id}", type="checkpoint", metadata=dict(payload))
        manifest = checkpoint / CHECKPOINT_MANIFEST
        if manifest.is_file():
            artifact.add_file(str(manifest), name=CHECKPOINT_MANIFEST)
        artifact.add_reference(checkpoint.absolute().as_uri(), name="checkpoint", checksum=False)
        step = payload.get("step")
        self._run.log_artifact(artifact, aliases=["latest", f"step-{step}"] if step is not None else ["latest"])

    def finish(self) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run.finish()
