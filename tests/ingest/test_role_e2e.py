"""The real `python -m runtime role trainer` subprocess against the real ingest API (pytest-django's live_server).

Each test runs a tiny sync spec (tiny-qwen2, 4 steps of 2 prompts x 2 samples) on the CPU. The run
is created RUNNING with the `submit`/`start` fixtures: the platform's launcher and its heartbeat-driven
STARTING -> RUNNING transition are not part of these tests. A small forwarding proxy can lose the
command acknowledgements on their way, to force the platform to redeliver a command.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs import commands
from jobs.ingest.tokens import mint_run_token
from jobs.models import CheckpointRecord, Command, MetricPoint, RoleHeartbeat, RunEvent, RunStreamEntry
from jobs.states import RunState
from runtime.contract import HEARTBEAT_PATH
from runtime.managed.command_desk import Acknowledger, CommandDesk, CommandLog, RoleControl
from runtime.managed.reporter import HttpReporter, JsonPoster
from runtime.metrics import read_jsonl
from tests.ingest.helpers import Proxy

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
SPEC = f"""\
name: role-e2e
seed: 0
model:
  builtin: tiny-qwen2
task:
  name: reverse
  min_len: 1
  max_len: 4
  train_size: 64
  eval_size: 4
algorithm:
  name: grpo
  group_size: 2
rollout:
  max_new_tokens: 4
pipeline:
  mode: sync
  steps: {STEPS}
  prompts_per_step: 2
  eval_interval: 0
checkpoint:
  interval: 0
resources:
  threads_per_process: 1
"""


@pytest.fixture
def proxy(live_server):
    p = Proxy(live_server.url)
    yield p
    p.stop()


@pytest.fixture
def workdir(run, tmp_path, settings) -> Path:
    """The run's own directory under a checkpoint root of its own: the only place ingest records its
    checkpoints (jobs.confinement), as the platform lays it out."""
    settings.TANDEM_CHECKPOINT_ROOT = tmp_path
    return tmp_path / f"run-{run.pk}"


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC)
    return path


class Role:
    """One `python -m runtime role trainer` subprocess; its output goes to files (no pipe to fill)."""

    def __init__(self, url, run, attempt, token, spec_file, workdir, *extra):
        self.workdir = workdir
        self.out = open(workdir.parent / f"role-{attempt}.out", "w+")
        self.err = open(workdir.parent / f"role-{attempt}.err", "w+")
        env = {
            **os.environ,
            "TANDEM_PLATFORM_URL": url,
            "TANDEM_RUN_TOKEN": token,
            "TANDEM_RUN_ID": str(run.pk),
            "TANDEM_ATTEMPT": str(attempt),
            "TANDEM_HOST_NAME": "test-host",
            "TANDEM_HEARTBEAT_S": "0.2",
        }
        argv = ["role", "trainer", "--spec", str(spec_file), "--workdir", str(workdir), *extra]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime", *argv], cwd=ROOT, env=env, stdout=self.out, stderr=self.err
        )

    def finish(self, timeout=120) -> tuple[int, dict, str]:
        """(exit status, the last stdout line as JSON, stderr)."""
        try:
            code = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self.out.seek(0)
        self.err.seek(0)
        out, err = self.out.read(), self.err.read()
        self.out.close()
        self.err.close()
        lines = out.strip().splitlines()
        return code, (json.loads(lines[-1]) if code == 0 and lines else {}), err


def _wait(predicate, what, role: Role | None = None, timeout=90.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if role is not None and role.proc.poll() is not None:
            code, _, err = role.finish()
            pytest.fail(f"the role exited ({code}) while waiting for {what}: {err[-2000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _stored(run, attempt=0, rewound=False) -> list[tuple[int, dict]]:
    """(step, metrics) of the live (or rewound) rows of one attempt."""
    rows = MetricPoint.objects.filter(run=run, attempt=attempt, rewound=rewound).order_by("step")
    return list(rows.values_list("step", "metrics"))


def _jsonl_steps(workdir: Path) -> list[tuple[int, dict]]:
    steps, _events = read_jsonl(workdir / "metrics.jsonl")
    return [(r["step"], {k: v for k, v in r.items() if k not in ("step", "time")}) for r in steps]


def _stream(run, type_: str, key: str) -> list:
    entries = RunStreamEntry.objects.filter(run=run, type=type_).order_by("seq").values_list("data", flat=True)
    return [data[key] for data in entries]


def _heartbeat_statuses(run) -> list[str]:
    """The statuses heartbeats reported, in order (the ingest API streams each change; the launcher's own
    ``role`` entries, which carry no ``last_seen``, are not heartbeats)."""
    entries = RunStreamEntry.objects.filter(run=run, type="role").order_by("seq").values_list("data", flat=True)
    return [data["status"] for data in entries if "last_seen" in data]


def _handled(workdir: Path) -> list[dict]:
    path = workdir / "commands.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def _checkpoint(workdir: Path, step: int) -> Path:
    return workdir / "checkpoints" / f"step-{step:08d}"


def test_pause_and_resume_round_trip_and_a_redelivered_command_is_acted_on_once(
    run, owner, proxy, spec_file, workdir, settings
):
    settings.TANDEM_COMMAND_REDELIVER_S = 0.3  # an unacknowledged command rides out again after 0.3 s
    workdir.mkdir()
    pause = commands.create(owner, run, "pause")
    proxy.lose.add("/api/ingest/command_result")  # the pause's result gets lost on the way
    role = Role(proxy.url, run, 0, mint_run_token(run, 0), spec_file, workdir)

    _wait(lambda: [c["id"] for c in _handled(workdir)] == [pause.pk], "the runtime to handle the pause", role)
    handled_at = Command.objects.get(pk=pause.pk).deliveries
    _wait(lambda: Command.objects.get(pk=pause.pk).deliveries > handled_at, "the pause to be redelivered", role)
    _wait(lambda: proxy.lost >= 2, "the result to be sent again", role)
    run.refresh_from_db()
    assert run.state == RunState.RUNNING  # no acknowledgement has arrived: the platform has not moved the run
    assert _jsonl_steps(workdir)[-1][0] == 1  # paused at the first step boundary

    proxy.lose.clear()
    _wait(lambda: Command.objects.get(pk=pause.pk).state == "done", "the pause's result to arrive", role)
    run.refresh_from_db()
    assert run.state == RunState.PAUSED
    assert [c["id"] for c in _handled(workdir)] == [pause.pk]  # acted on once, however often delivered
    assert [step for step, _ in _jsonl_steps(workdir)] == [1]  # still paused: no step after the boundary

    resume = commands.create(owner, run, "resume")
    code, summary, err = role.finish()

    assert code == 0, err
    assert summary == {"outcome": "completed", "steps": STEPS, "checkpoint": str(_checkpoint(workdir, STEPS))}
    assert [(c["id"], c["kind"], c["state"]) for c in _handled(workdir)] == [
        (pause.pk, "pause", "done"),
        (resume.pk, "resume", "done"),
    ]
    assert Command.objects.get(pk=resume.pk).state == "done"
    assert _stream(run, "state", "state")[-2:] == [RunState.PAUSED, RunState.RUNNING]
    statuses = _heartbeat_statuses(run)
    assert statuses[0] == "starting" and statuses[-1] == "finished"
    assert "paused" in statuses and "running" in statuses[statuses.index("paused") :]
    assert _stored(run) == _jsonl_steps(workdir) and len(_stored(run)) == STEPS


def test_stop_ends_the_run_early_with_a_final_checkpoint(run, owner, live_server, spec_file, workdir):
    workdir.mkdir()
    stop = commands.create(owner, run, "stop")
    role = Role(live_server.url, run, 0, mint_run_token(run, 0), spec_file, workdir)
    code, summary, err = role.finish()

    assert code == 0, err
    assert summary == {"outcome": "stopped", "steps": 1, "checkpoint": str(_checkpoint(workdir, 1))}
    stop.refresh_from_db()
    assert stop.state == "done"
    run.refresh_from_db()
    assert run.state == RunState.COMPLETED
    record = CheckpointRecord.objects.get(run=run)  # registered before the stop was acknowledged
    assert (record.step, record.path) == (1, str(_checkpoint(workdir, 1)))
    assert [step for step, _ in _stored(run)] == [1]
    # what the checkpoint browser shows: the weight version, the bytes on disk, the run's metrics at that step
    manifest = json.loads((_checkpoint(workdir, 1) / "manifest.json").read_text())
    assert record.weight_version == 1
    assert record.size == sum(f["bytes"] for f in manifest["files"].values()) > 0
    point = MetricPoint.objects.get(run=run, step=1).metrics
    assert record.metrics and record.metrics == {k: point[k] for k in record.metrics}
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == [_checkpoint(workdir, 1).name]


def test_a_new_attempt_drains_the_old_spool_resumes_and_reports_heartbeats_steps_and_checkpoint(
    run, live_server, spec_file, workdir
):
    # Attempt 0 ran two steps and checkpointed, but never reached the platform: its records are in its spool.
    first = subprocess.run(
        [sys.executable, "-m", "runtime", "run", str(spec_file), f"output_dir={workdir}", "pipeline.steps=2"]
        + ["metrics.progress_bar=false"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert first.returncode == 0, first.stderr
    old_token = mint_run_token(run, 0)
    spool = workdir / "spool" / "attempt-0"
    spool.mkdir(parents=True)
    (spool / "token").write_text(old_token)
    down = HttpReporter("http://127.0.0.1:9", old_token, spool, run=str(run.pk), attempt=0, role="trainer-0")
    for step, metrics in _jsonl_steps(workdir):
        down.report(step, metrics)
    down.close(timeout=0.0)
    attempt0 = _jsonl_steps(workdir)
    assert [step for step, _ in attempt0] == [1, 2] and MetricPoint.objects.count() == 0

    token = mint_run_token(run, 1)
    role = Role(live_server.url, run, 1, token, spec_file, workdir)
    code, summary, err = role.finish()

    assert code == 0, err
    assert summary == {"outcome": "completed", "steps": STEPS, "checkpoint": str(_checkpoint(workdir, STEPS))}
    assert _stored(run, attempt=0) == attempt0  # delivered with attempt 0's own token
    assert (spool / "spool.jsonl").stat().st_size == 0
    # Continued after the step-2 checkpoint: every later step arrived once, as the runtime wrote it to its
    # own JSONL (which was cut back to the checkpoint and continued).
    assert [step for step, _ in _stored(run, attempt=1)] == [3, 4]
    assert _stored(run, attempt=0) + _stored(run, attempt=1) == _jsonl_steps(workdir)
    assert (workdir / "spool" / "attempt-1" / "spool.jsonl").stat().st_size == 0  # nothing left undelivered
    assert RunEvent.objects.get(run=run, attempt=1, kind="resume").payload == {"step": 2}
    record = CheckpointRecord.objects.get(run=run)
    assert (record.attempt, record.step, record.path) == (1, STEPS, str(_checkpoint(workdir, STEPS)))
    # Heartbeats: the role's status changes in order, then its last sign of life.
    statuses = _heartbeat_statuses(run)
    assert statuses[0] == "starting" and statuses[-1] == "finished" and "running" in statuses
    beat = RoleHeartbeat.objects.get(run=run)
    assert (beat.role, beat.attempt, beat.status) == ("trainer-0", 1, "finished")
    assert (beat.info["host"], beat.info["pid"], beat.info["step"]) == ("test-host", role.proc.pid, STEPS)
    assert set(beat.info) == {"host", "pid", "step", "weight_version", "rollout_pids", "rollout_restarts"}
    # This attempt's token, kept for a later attempt to drain its spool, readable by the owner only.
    token_file = workdir / "spool" / "attempt-1" / "token"
    assert (token_file.read_text(), token_file.stat().st_mode & 0o777) == (token, 0o600)
    assert _handled(workdir) == []


def test_sigterm_while_paused_exits_promptly_with_143_and_says_stopping(run, owner, live_server, spec_file, workdir):
    workdir.mkdir()
    pause = commands.create(owner, run, "pause")
    role = Role(live_server.url, run, 0, mint_run_token(run, 0), spec_file, workdir)
    _wait(lambda: Command.objects.get(pk=pause.pk).state == "done", "the run to pause", role)

    role.proc.send_signal(signal.SIGTERM)
    code, summary, err = role.finish()

    assert code == 143, err
    assert "Traceback" not in err
    beat = RoleHeartbeat.objects.get(run=run)
    assert beat.status == "stopping"  # its last word: not finished, not failed
    assert [step for step, _ in _stored(run)] == [1]
    assert not (workdir / "checkpoints").exists() or not any((workdir / "checkpoints").iterdir())


def test_a_rollback_is_acknowledged_after_the_points_before_it_and_before_the_steps_after_it(
    run, owner, live_server, tmp_path
):
    """The role's command desk with the real reporter and platform; the test plays the pipeline's part, since a
    subprocess cannot be made to reach step 3 before the rollback arrives. Steps 2 and 3 are reported again
    after rolling back to step 1: they must land as new live rows, the old ones marked rewound."""
    token = mint_run_token(run, 0)
    desk: CommandDesk
    # A POST at most every 30 s unless flushed: what is reported stays in the spool until someone flushes.
    http = HttpReporter(
        live_server.url,
        token,
        tmp_path / "spool",
        run=str(run.pk),
        role="trainer-0",
        min_interval_s=30.0,
        on_reply=lambda reply: desk.receive(reply),
    )
    control = RoleControl(lambda d, ok, message: desk.finished(d, ok, message), lambda status: None)
    acks = Acknowledger(JsonPoster(live_server.url, token), lambda reply: desk.receive(reply), http.flush)
    desk = CommandDesk(control, CommandLog(tmp_path / "commands.jsonl"), acks)
    http.report(1, {"reward": 0.1})
    http.event("checkpoint", {"step": 1, "path": f"run-{run.pk}/checkpoints/step-00000001"})
    assert http.flush(timeout=30)
    rollback = commands.create(owner, run, "rollback", {"checkpoint": CheckpointRecord.objects.get(run=run).pk})
    http.report(2, {"reward": 0.2})
    http.report(3, {"reward": 0.3})
    assert http.pending() == 2  # not delivered when the rollback arrives

    desk.receive(JsonPoster(live_server.url, token).post(HEARTBEAT_PATH, {"role": "trainer-0"}))
    (directive,) = control.take()
    assert (directive.id, directive.kind, directive.args["step"]) == (rollback.pk, "rollback", 1)
    control.finished(directive, True, "restored step 1")  # returns once the platform has it
    rollback.refresh_from_db()
    assert (rollback.state, rollback.message) == ("done", "restored step 1")
    http.report(2, {"reward": 0.25})
    http.report(3, {"reward": 0.35})
    assert http.flush(timeout=30)
    http.close()
    assert acks.close(1.0) == []

    assert _stored(run) == [(1, {"reward": 0.1}), (2, {"reward": 0.25}), (3, {"reward": 0.35})]
    assert _stored(run, rewound=True) == [(2, {"reward": 0.2}), (3, {"reward": 0.3})]
    assert [(c["id"], c["state"]) for c in _handled(tmp_path)] == [(rollback.pk, "done")]
