"""Experiment trackers (metrics.reporters): each one's own output read back with its own reader — TensorBoard's
event files by its EventAccumulator, an `mlflow server` queried by MlflowClient, a W&B offline run's
transaction log parsed into W&B's protobuf records — and a tracker's failure never failing a run nor losing
a metric of metrics.jsonl."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from runtime.metrics import JsonlReporter, MultiReporter, build_reporters, read_jsonl
from runtime.pipeline import run
from runtime.spec import MetricsSpec, SpecError, validate_spec
from runtime.trackers.background import TRACKER_ERROR, BackgroundTracker
from runtime.trackers.mlflow import RUN_ID_FILE, MlflowTracker
from runtime.trackers.params import clipped, flat_params
from runtime.trackers.tensorboard import TENSORBOARD_DIR
from tests.runtime.helpers import derived, tiny_spec

STEPS = [(1, {"reward/mean": 0.25, "loss/policy": -0.5}), (2, {"reward/mean": 0.5, "eval/accuracy": 1})]


def _events(path: Path) -> list[dict[str, Any]]:
    return read_jsonl(path)[1]


def _report_steps_and_a_checkpoint(reporters: Any, checkpoint: Path) -> None:
    for step, metrics in STEPS:
        reporters.report(step, metrics)
    checkpoint.mkdir(parents=True, exist_ok=True)
    (checkpoint / "manifest.json").write_text(json.dumps({"files": {"state/x.pt": {"bytes": 3, "sha256": "ab"}}}))
    reporters.event("checkpoint", {"step": 2, "path": str(checkpoint), "weight_version": 2, "size": 3})


# ---------------------------------------------------------------- the spec


def test_reporters_take_the_three_trackers_and_tensorboard_true_still_reads_as_one():
    assert validate_spec({"metrics": {"reporters": ["tensorboard", "mlflow", "wandb"]}}).metrics.reporters == [
        "tensorboard",
        "mlflow",
        "wandb",
    ]
    old = validate_spec({"metrics": {"tensorboard": True}})
    assert old.metrics.reporters == ["tensorboard"] and "tensorboard" not in old.resolved()["metrics"]
    assert validate_spec({"metrics": {"tensorboard": False}}).metrics.reporters == []
    with pytest.raises(SpecError) as caught:
        validate_spec({"metrics": {"reporters": ["wandb", "wandb", "neptune"]}})
    assert [e["field"] for e in caught.value.errors] == ["metrics.reporters.2"]
    with pytest.raises(SpecError, match="metrics.reporters: Value error, wandb listed twice"):
        validate_spec({"metrics": {"reporters": ["wandb", "wandb"]}})
    with pytest.raises(SpecError, match="metrics: .*metrics.tensorboard false contradicts metrics.reporters"):
        validate_spec({"metrics": {"tensorboard": False, "reporters": ["tensorboard"]}})


def test_a_tracker_not_installed_is_a_field_error_naming_metrics_reporters(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what importlib sees of a package that is not there
    with pytest.raises(SpecError) as caught:
        validate_spec({"metrics": {"reporters": ["tensorboard", "mlflow"]}})
    assert caught.value.errors == [
        {
            "field": "metrics.reporters",
            "message": "Value error, mlflow not installed where this spec is checked "
            "(pip install -r requirements-trackers.txt)",
        }
    ]
    validate_spec({"metrics": {"reporters": ["tensorboard"]}})  # the others are


def test_tracker_settings_are_checked_where_they_act():
    with pytest.raises(SpecError, match="metrics.mlflow_tracking_uri: Value error, 'file:///tmp/x' does not parse"):
        validate_spec({"metrics": {"reporters": ["mlflow"], "mlflow_tracking_uri": "file:///tmp/x"}})
    with pytest.raises(SpecError, match="metrics.wandb_project: Value error, must be 1 to 128 characters"):
        validate_spec({"metrics": {"reporters": ["wandb"], "wandb_project": "team/project"}})
    with pytest.raises(SpecError, match="metrics.wandb_mode: acts only with wandb in metrics.reporters"):
        validate_spec({"metrics": {"reporters": ["mlflow"], "wandb_mode": "online"}})


def test_a_run_without_trackers_imports_no_tracker_library(tmp_path):
    code = (
        "import sys; from runtime.metrics import build_reporters; from runtime.spec import MetricsSpec\n"
        f"build_reporters(MetricsSpec(progress_bar=False), {str(tmp_path)!r}).close()\n"
        "print(sorted(m for m in ('mlflow', 'wandb', 'tensorboard', 'torch.utils.tensorboard') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_the_spec_becomes_flat_parameters_clipped_to_a_limit():
    params = flat_params({"trainer": {"lr": 0.001}, "env": {"kwargs": {"g": 9.8}}, "resources": {"x": None}})
    assert params == {"trainer.lr": "0.001", "env.kwargs.g": "9.8", "resources.x": "null"}
    assert flat_params({"m": {"reporters": ["a", "b"], "flag": True, "empty": {}}}) == {
        "m.reporters": '["a", "b"]',
        "m.flag": "true",
        "m.empty": "{}",
    }
    long = "x" * 7000
    cut = clipped(long, 6000)
    assert len(cut) <= 6000 and cut.startswith("x" * 5900) and cut.endswith("more characters]")
    assert clipped("short", 6000) == "short"


# ---------------------------------------------------------------- failures never reach the run


class _Failing:
    """A tracker whose library raises at its second step."""

    name = "flaky"

    def __init__(self):
        self.steps: list[int] = []

    def start(self):
        pass

    def log_metrics(self, step, metrics):
        if self.steps:
            raise ConnectionError("server went away")
        self.steps.append(step)

    def log_event(self, kind, payload):
        pass

    def finish(self):
        pass


def test_a_failing_tracker_is_an_event_and_the_run_loses_no_metric(tmp_path):
    multi = MultiReporter()
    tracker = _Failing()
    guarded = BackgroundTracker(tracker, notify=multi.event)
    multi.reporters += [guarded, JsonlReporter(tmp_path / "metrics.jsonl")]
    for step in range(1, 6):
        multi.report(step, {"reward/mean": float(step)})
        deadline = time.monotonic() + 10
        while step == 2 and guarded.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)  # wait for the thread to reach the failure, so that steps 3-5 see it
    multi.close()
    steps, events = read_jsonl(tmp_path / "metrics.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert [(e["event"], e["payload"]) for e in events] == [
        (TRACKER_ERROR, {"tracker": "flaky", "error": "ConnectionError: server went away"})
    ]
    assert tracker.steps == [1]


def test_a_stuck_tracker_neither_blocks_the_run_nor_holds_its_end(tmp_path):
    release = threading.Event()

    class Stuck(_Failing):
        name = "stuck"

        def start(self):
            release.wait(30)

    multi = MultiReporter()
    guarded = BackgroundTracker(Stuck(), notify=multi.event, queue_limit=2, close_wait_s=0.2)
    multi.reporters += [guarded, JsonlReporter(tmp_path / "metrics.jsonl")]
    began = time.monotonic()
    for step in range(1, 6):
        multi.report(step, {"reward/mean": 1.0})
    multi.close()
    release.set()
    assert time.monotonic() - began < 5
    steps, events = read_jsonl(tmp_path / "metrics.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    errors = [e["payload"]["error"] for e in events if e["event"] == TRACKER_ERROR]
    assert errors == [
        "2 records behind: it drops records until it catches up",
        "still sending after 0.2 s at the end of the run: its last records are missing",
    ]


def test_an_unreachable_mlflow_server_is_an_event_and_the_run_goes_on(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = MetricsSpec(progress_bar=False, reporters=["mlflow"], mlflow_tracking_uri=f"http://127.0.0.1:{port}")
    reporters = build_reporters(spec, tmp_path)
    _report_steps_and_a_checkpoint(reporters, tmp_path / "checkpoints" / "step-00000002")
    reporters.close()
    steps, events = read_jsonl(tmp_path / "metrics.jsonl")
    assert [s["step"] for s in steps] == [1, 2]
    errors = [e["payload"] for e in events if e["event"] == TRACKER_ERROR]
    assert len(errors) == 1 and errors[0]["tracker"] == "mlflow"
    assert f"the MLflow tracking server http://127.0.0.1:{port} does not answer" in errors[0]["error"]


# ---------------------------------------------------------------- TensorBoard


def _tensorboard(log_dir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _text(acc: Any, tag: str) -> list[tuple[int, str]]:
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(f"{tag}/text_summary")]


def test_tensorboard_event_files_hold_the_scalars_the_spec_and_the_checkpoint(tmp_path):
    spec = validate_spec({"name": "tb", "metrics": {"progress_bar": False, "reporters": ["tensorboard"]}})
    reporters = build_reporters(spec.metrics, tmp_path, run_spec=spec)
    _report_steps_and_a_checkpoint(reporters, tmp_path / "checkpoints" / "step-00000002")
    reporters.close()
    acc = _tensorboard(tmp_path / TENSORBOARD_DIR)
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/accuracy")] == [(2, 1.0)]
    ((step, table),) = _text(acc, "spec")
    assert step == 0 and "| trainer.lr | 0.0001 |" in table and '| metrics.reporters | ["tensorboard"] |' in table
    ((step, checkpoint),) = _text(acc, "event/checkpoint")
    assert step == 2 and json.loads(checkpoint)["path"] == str(tmp_path / "checkpoints" / "step-00000002")


# ---------------------------------------------------------------- MLflow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """An `mlflow server` on a free port with a store of its own, up once its health check answers."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}"]
    command += ["--artifacts-destination", str(root / "artifacts")]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no background job runner
    log = open(root / "server.log", "wb")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
            time.sleep(0.2)  # polling its health check, not a guess of its start-up time
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and its uvicorn worker: the group it leads
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(30)
        log.close()


def _mlflow_tracker(tmp_path: Path, url: str, params: dict[str, str], resumed: bool) -> MlflowTracker:
    return MlflowTracker(
        tmp_path,
        tracking_uri=url,
        experiment="tandem-test",
        run_name="server-run",
        params=params,
        resolved_spec={"trainer": {"lr": 0.001}},
        resumed=resumed,
    )


def test_an_mlflow_server_gets_the_metrics_params_and_checkpoint_artifacts(tmp_path, mlflow_server):
    from mlflow.tracking import MlflowClient

    params = {"trainer.lr": "0.001", "task.system_prompt": "p" * 7000}
    multi = MultiReporter()
    tracker = _mlflow_tracker(tmp_path, mlflow_server, params, resumed=False)
    multi.reporters.append(BackgroundTracker(tracker, notify=multi.event))
    _report_steps_and_a_checkpoint(multi, tmp_path / "checkpoints" / "step-00000002")
    multi.close()
    assert tracker.run_id is not None

    client = MlflowClient(tracking_uri=mlflow_server)
    got = client.get_run(tracker.run_id)
    assert got.info.status == "FINISHED" and got.info.run_name == "server-run"
    assert got.data.params["trainer.lr"] == "0.001"
    assert len(got.data.params["task.system_prompt"]) <= 6000
    assert got.data.params["task.system_prompt"].endswith("more characters]")
    history = client.get_metric_history(tracker.run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.5)]
    assert [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, "eval/accuracy")] == [(2, 1.0)]
    assert {a.path for a in client.list_artifacts(tracker.run_id)} == {"spec.json", "checkpoints"}
    where = "checkpoints/step-00000002"
    assert {a.path for a in client.list_artifacts(tracker.run_id, where)} == {
        f"{where}/checkpoint.json",
        f"{where}/manifest.json",
    }
    local = Path(client.download_artifacts(tracker.run_id, f"{where}/checkpoint.json", str(tmp_path / "dl")))
    assert json.loads(local.read_text())["path"] == str(tmp_path / "checkpoints" / "step-00000002")

    # a resumed run continues the same MLflow run (its parameters are not logged again)
    multi = MultiReporter()
    again = _mlflow_tracker(tmp_path, mlflow_server, {**params, "new.field": "1"}, resumed=True)
    multi.reporters.append(BackgroundTracker(again, notify=multi.event))
    multi.report(3, {"reward/mean": 0.75})
    multi.close()
    assert again.run_id == tracker.run_id == json.loads((tmp_path / RUN_ID_FILE).read_text())["run_id"]
    assert [m.step for m in client.get_metric_history(tracker.run_id, "reward/mean")] == [1, 2, 3]
    assert client.get_run(tracker.run_id).data.params["new.field"] == "1"


# ---------------------------------------------------------------- W&B


def wandb_records(run_dir: Path, wait_s: float = 30.0) -> list[Any]:
    """The records of a W&B offline run's transaction log, once it holds the run's ``exit`` record: W&B's core
    process may write the log after ``finish()`` returns."""
    deadline = time.monotonic() + wait_s
    while True:
        records = _transaction_log(run_dir)
        if any(r.HasField("exit") for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def _transaction_log(run_dir: Path) -> list[Any]:
    """``run-<id>.wandb``: a 7-byte W&B header, then LevelDB-log framing (32 KiB blocks; per chunk crc32,
    length, type full/first/middle/last) around ``wandb_internal.Record`` protobufs. W&B reads it in its Go
    core only, so here with W&B's own protobufs."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding, to the block's end
            pos += left
            continue
        if pos + 7 + length > len(data):  # a record still being written
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(records: list[Any]) -> list[dict[str, Any]]:
    rows = [
        {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.HasField("history")
    ]
    return [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows]


def wandb_config(records: list[Any]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for r in records:
        updates = r.run.config.update if r.HasField("run") else r.config.update if r.HasField("config") else []
        config.update({u.key: json.loads(u.value_json) for u in updates})
    return config


def _offline_run_dir(output_dir: Path) -> Path:
    (run_dir,) = (output_dir / "wandb").glob("offline-run-*")
    return run_dir


def test_a_wandb_offline_run_holds_the_metrics_config_and_checkpoint_artifact(tmp_path):
    spec = validate_spec({"name": "wb", "metrics": {"progress_bar": False, "reporters": ["wandb"]}})
    reporters = build_reporters(spec.metrics, tmp_path, run_spec=spec)
    _report_steps_and_a_checkpoint(reporters, tmp_path / "checkpoints" / "step-00000002")
    reporters.close()
    assert not [e for e in _events(tmp_path / "metrics.jsonl") if e["event"] == TRACKER_ERROR]
    records = wandb_records(_offline_run_dir(tmp_path))
    assert wandb_history(records) == [
        {"step": 1, "reward/mean": 0.25, "loss/policy": -0.5},
        {"step": 2, "reward/mean": 0.5, "eval/accuracy": 1},
    ]
    run_record = next(r.run for r in records if r.HasField("run"))
    assert (run_record.project, run_record.display_name) == ("tandem", "wb")
    config = wandb_config(records)
    assert config["trainer.lr"] == "0.0001" and config["metrics.wandb_mode"] == "offline"
    (artifact,) = [r.artifact for r in records if r.HasField("artifact")]
    assert (artifact.type, json.loads(artifact.metadata)["step"]) == ("checkpoint", 2)
    assert set(artifact.aliases) >= {"latest", "step-2"}
    entries = {e.path: e for e in artifact.manifest.contents}
    # the manifest is in the artifact; the checkpoint's files are references to where they lie (not uploaded)
    assert set(entries) == {"manifest.json", "checkpoint/manifest.json"} and not entries["manifest.json"].ref
    assert entries["checkpoint/manifest.json"].ref == (tmp_path / "checkpoints/step-00000002/manifest.json").as_uri()


# ---------------------------------------------------------------- a real run


def test_a_tiny_run_logs_the_same_metrics_to_all_three_trackers(tmp_path):
    from mlflow.tracking import MlflowClient

    metrics = {"progress_bar": False, "reporters": ["tensorboard", "mlflow", "wandb"]}
    spec = tiny_spec(tmp_path, "tracked", derived(metrics=metrics), pipeline__steps=2, checkpoint__interval=1)
    out = Path(run(spec)["output_dir"])
    steps, events = read_jsonl(out / "metrics.jsonl")
    assert [s["step"] for s in steps] == [1, 2]
    assert not [e for e in events if e["event"] == TRACKER_ERROR]
    checkpoints = [Path(e["payload"]["path"]).name for e in events if e["event"] == "checkpoint"]
    assert checkpoints == ["step-00000001", "step-00000002"]
    jsonl = {(s["step"], k): v for s in steps for k, v in s.items() if k not in ("step", "time") and v is not None}

    acc = _tensorboard(out / TENSORBOARD_DIR)
    tensorboard = {(e.step, tag): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    assert tensorboard.keys() == jsonl.keys()
    assert all(tensorboard[k] == pytest.approx(v, rel=1e-6) for k, v in jsonl.items())  # float32 on disk
    assert [step for step, _ in _text(acc, "event/checkpoint")] == [1, 2]

    ml_run = json.loads((out / RUN_ID_FILE).read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    got = client.get_run(ml_run["run_id"])
    mlflow = {
        (m.step, key): m.value for key in got.data.metrics for m in client.get_metric_history(got.info.run_id, key)
    }
    assert mlflow == pytest.approx(jsonl)
    assert got.data.params["model.builtin"] == "tiny-qwen2" and got.data.params["pipeline.steps"] == "2"
    assert {a.path for a in client.list_artifacts(got.info.run_id, "checkpoints")} == {
        f"checkpoints/{name}" for name in checkpoints
    }

    history = wandb_history(wandb_records(_offline_run_dir(out)))
    wandb = {(row["step"], k): v for row in history for k, v in row.items() if k != "step"}
    assert wandb == pytest.approx(jsonl)
