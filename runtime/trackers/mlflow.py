"""MLflow: a run in ``metrics.mlflow_experiment`` on a tracking server (``metrics.mlflow_tracking_uri``) or,
unset, in a local store under the output directory (``mlflow.db``, artifacts in ``mlartifacts/``: MLflow
3 refuses its old file store). Parameters are the resolved spec's fields (values clipped to MLflow's limit)
and ``spec.json``; each checkpoint is an artifact: its manifest (every file's size and sha256) and where it
lies, not its files (see :meth:`MlflowTracker.log_event`).
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runtime.trackers.background import CHECKPOINT_MANIFEST, EVENT_CHECKPOINT, previous_run
from runtime.trackers.params import clipped

LOCAL_STORE = "mlflow.db"
LOCAL_ARTIFACTS = "mlartifacts"
RUN_ID_FILE = "mlflow_run.json"  # the MLflow run of this output directory, continued by a resumed run
CHECKPOINT_ARTIFACTS = "checkpoints"
PROBE_TIMEOUT_S = 10.0
# MLflow's own limits (mlflow.utils.validation), read from the library when it has them
PARAM_VALUE_LIMIT = 6000
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000
KEY_LIMIT = 250
_NOT_IN_A_NAME = re.compile(r"[^\w./\- :]")  # what MLflow refuses in a metric or parameter name


def metric_key(name: str) -> str:
    """``name`` as MLflow accepts it (a plug-in's odd characters become ``_``)."""
    return _NOT_IN_A_NAME.sub("_", name)[:KEY_LIMIT]


def probe(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Fail fast, saying so, when the tracking server does not answer its health check (MLflow's own client
    retries for minutes before it gives up)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout_s) as reply:
            reply.read(64)
    except (OSError, urllib.error.URLError) as exc:
        raise ConnectionError(f"the MLflow tracking server {url} does not answer ({exc})") from None


class MlflowTracker:
    name = "mlflow"

    def __init__(
        self,
        output_dir: str | Path,
        tracking_uri: str | None,
        experiment: str,
        run_name: str,
        params: Mapping[str, str],
        resolved_spec: Mapping[str, Any] | None,
        resumed: bool,
    ):
        self.output_dir = Path(output_dir).absolute()
        self.server = tracking_uri
        self.tracking_uri = tracking_uri or f"sqlite:///{self.output_dir / LOCAL_STORE}"
        self.experiment = experiment
        self.run_name = run_name
        self._params = dict(params)
        self._spec = dict(resolved_spec) if resolved_spec is not None else None
        self._resumed = resumed
        self._client: Any = None
        self.run_id: str | None = None

    # ---- start ---------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.server is not None:
            probe(self.server)
        from mlflow.tracking import MlflowClient  # only for a run that asks for mlflow

        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        self.run_id = self._resumed_run_id() or self._new_run_id()
        (self.output_dir / RUN_ID_FILE).write_text(
            json.dumps({"run_id": self.run_id, "tracking_uri": self.tracking_uri, "experiment": self.experiment})
        )
        self._log_params()
        if self._spec is not None:
            self._client.log_dict(self.run_id, self._spec, "spec.json")

    def _experiment_id(self) -> str:
        found = self._client.get_experiment_by_name(self.experiment)
        if found is not None:
            return str(found.experiment_id)
        # a local store keeps its artifacts beside it; a server chooses its own artifact root
        location = None if self.server else (self.output_dir / LOCAL_ARTIFACTS).as_uri()
        return str(self._client.create_experiment(self.experiment, artifact_location=location))

    def _new_run_id(self) -> str:
        run = self._client.create_run(
            self._experiment_id(), run_name=self.run_name, tags={"tandem.output_dir": str(self.output_dir)}
        )
        return str(run.info.run_id)

    def _resumed_run_id(self) -> str | None:
        """The run this output directory logged to before, when resuming into the same store and experiment."""
        before = previous_run(self.output_dir / RUN_ID_FILE, self._resumed)
        if before is None:
            return None
        if before.get("tracking_uri") != self.tracking_uri or before.get("experiment") != self.experiment:
            return None
        run_id = str(before.get("run_id"))
        self._client.update_run(run_id, status="RUNNING")
        return run_id

    def _log_params(self) -> None:
        from mlflow.entities import Param
        from mlflow.utils import validation

        limit = int(getattr(validation, "MAX_PARAM_VAL_LENGTH", PARAM_VALUE_LIMIT))
        per_batch = int(getattr(validation, "MAX_PARAMS_TAGS_PER_BATCH", PARAMS_PER_BATCH))
        # MLflow refuses a parameter logged twice with another value: a resumed run adds only new ones
        logged = self._client.get_run(self.run_id).data.params if self._resumed else {}
        params = [
            Param(metric_key(key), clipped(value, limit))
            for key, value in sorted(self._params.items())
            if metric_key(key) not in logged
        ]
        for i in range(0, len(params), per_batch):
            self._client.log_batch(self.run_id, params=params[i : i + per_batch])

    # ---- the run -------------------------------------------------------------------------------------
    def log_metrics(self, step: int, metrics: Mapping[str, float | int]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(metric_key(key), float(value), now, step) for key, value in metrics.items()]
        for i in range(0, len(batch), METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=batch[i : i + METRICS_PER_BATCH])

    def log_event(self, kind: str, payload: Mapping[str, Any]) -> None:
        """A checkpoint becomes the artifacts ``checkpoints/<step dir>/manifest.json`` (every file's size and
        sha256: which bytes the checkpoint is) and ``checkpoint.json`` (where it lies, its step, size, metrics).
        Not its files: they are the policy, reference and optimizer state, gigabytes a save, written every
        ``checkpoint.interval`` steps; a copy per save would double the storage, hold this tracker's queue
        for minutes, and escape the platform's retention (pins, deletes). Other events carry nothing the
        step metrics do not."""
        if kind != EVENT_CHECKPOINT or not payload.get("path"):
            return
        checkpoint = Path(str(payload["path"]))
        where = f"{CHECKPOINT_ARTIFACTS}/{checkpoint.name}"
        self._client.log_dict(self.run_id, dict(payload), f"{where}/checkpoint.json")
        manifest = checkpoint / CHECKPOINT_MANIFEST
        if manifest.is_file():
            self._client.log_artifact(self.run_id, str(manifest), artifact_path=where)

    def finish(self) -> None:
        if self._client is not None and self.run_id is not None:
            client, self._client = self._client, None
            client.set_terminated(self.run_id, status="FINISHED")
