"""Runs end to end: submit -> admitted -> a real Celery worker starts ``python -m runtime role trainer``
-> the runtime reports to a real uvicorn -> the run completes; and what happens when parts die.

Every run is a tiny model on the CPU, a few seconds of work. Marked slow: the module takes a couple of
minutes on a loaded 2-core machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from jobs.client import TandemClient as Client
from jobs.models import CheckpointRecord, Command, MetricPoint, RoleHeartbeat, Run, RunEvent, RunRole, RunStreamEntry
from jobs.states import RunState
from tests.launch.helpers import ROOT, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

RUN_S = 180.0  # ceiling for one tiny run on a loaded machine (typically 10-30 s)


def spec_text(name: str, *, mode: str = "sync", steps: int = 6, interval: int = 2, **sections) -> str:
    spec = {
        "name": name,
        "seed": 1,
        "model": {"builtin": "tiny-qwen2"},
        "task": {"name": "reverse", "min_len": 1, "max_len": 4, "train_size": 256, "eval_size": 8},
        "algorithm": {"name": "grpo", "group_size": 4, "entropy_coef": 0.01},
        "trainer": {"lr": 1e-3},
        "rollout": {"max_new_tokens": 6, "max_batch_size": 16},
        "pipeline": {"mode": mode, "steps": steps, "prompts_per_step": 4, "eval_interval": 0},
        "resources": {"threads_per_process": 1},
        "checkpoint": {"interval": interval, "keep_last": 10},
        "metrics": {"progress_bar": False},
    }
    for section, values in sections.items():
        if section == "task":  # a whole task: a built-in task's sizes do not act on a jsonl one
            spec["task"] = dict(values)
        else:
            spec.setdefault(section, {}).update(values)
    return yaml.safe_dump(spec)


def _api(platform, cluster) -> Client:
    """The REST API as CI sees it. Everything that changes a run goes through the server, so the tasks it
    sends (launch, start) reach this platform's broker and worker."""
    return Client(platform.url, cluster["token"])


def _submit(platform, cluster, text: str) -> Run:
    created, body = _api(platform, cluster).submit("e2e", text)
    assert created
    return Run.objects.get(pk=body["id"])


def _state(run: Run) -> str:
    run.refresh_from_db()
    return run.state


def _wait_state(platform, run: Run, *states: str, timeout: float = RUN_S) -> str:
    return wait_for(
        lambda: _state(run) in states and run.state,
        f"run {run.pk} to reach {states}",
        timeout,
        platform.logs + _role_logs(run),
    )


def _role_logs(run: Run) -> list[Path]:
    workdirs = RunRole.objects.filter(run=run).values_list("workdir", flat=True)
    return [log for workdir in workdirs for log in sorted(Path(workdir).glob("roles/*/attempt-*/log"))]


def _live_steps(run: Run) -> list[int]:
    return sorted(MetricPoint.objects.filter(run=run).live().values_list("step", flat=True))


def _runtime_pid(role: RunRole) -> int | None:
    """The runtime process: the child of the role's wrapper (whose pid the role row records)."""
    try:
        children = Path(f"/proc/{role.pid}/task/{role.pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def _trainer(run: Run) -> RunRole:
    return RunRole.objects.get(run=run, name="trainer-0")


def test_ci_submits_with_the_cli_and_waits_for_a_completed_run(platform, cluster, tmp_path):
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(spec_text("ci", steps=6))
    cli = [sys.executable, "-m", "jobs.client", "--url", platform.url, "--token", cluster["token"]]
    cli += [
        "submit",
        str(spec_file),
        "--experiment",
        "e2e",
        "--submission-id",
        "ci-1",
        "--wait",
        "--timeout",
        str(RUN_S),
    ]
    done = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=RUN_S + 30)
    run = Run.objects.get(submission_id="ci-1")
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n" + "".join(
        p.read_text()[-2000:] for p in _role_logs(run)
    )
    assert run.state == RunState.COMPLETED

    assert _live_steps(run) == [1, 2, 3, 4, 5, 6]  # every step's metrics, each once
    assert sorted(CheckpointRecord.objects.filter(run=run).values_list("step", flat=True)) == [2, 4, 6]
    role = _trainer(run)
    assert (role.state, role.exit_code, role.attempt, role.restarts) == ("exited", 0, 0, 0)
    states = [
        e["state"]
        for e in RunStreamEntry.objects.filter(run=run, type="state").order_by("seq").values_list("data", flat=True)
    ]
    assert [s for s in states if s in ("ADMITTED", "STARTING", "RUNNING", "COMPLETED")] == [
        "ADMITTED",
        "STARTING",
        "RUNNING",
        "COMPLETED",
    ]
    assert RoleHeartbeat.objects.filter(run=run, role="trainer-0", attempt=0).exists()
    assert not run.tokens.filter(revoked_at__isnull=True).exists()  # the run ended: its tokens with it


def test_a_spec_the_runtime_rejects_fails_the_run_at_starting_with_its_message(platform, cluster):
    cluster["team"].data_roots = ["/nonexistent"]  # confinement passes; the runtime finds nothing there
    cluster["team"].save(update_fields=["data_roots"])
    run = _submit(platform, cluster, spec_text("bad", model={"builtin": None, "path": "/nonexistent/model"}))
    _wait_state(platform, run, RunState.FAILED)
    assert run.reason.startswith("trainer-0 rejected its input: model.path")
    assert "/nonexistent/model" in run.reason
    assert run.started_at is None  # it never ran
    assert _trainer(run).exit_code == 2


def test_a_killed_trainer_resumes_from_its_last_checkpoint(platform, cluster):
    run = _submit(platform, cluster, spec_text("kill-trainer", steps=14, interval=2))
    wait_for(
        lambda: CheckpointRecord.objects.filter(run=run, step__gte=2).exists(), "a checkpoint", RUN_S, platform.logs
    )
    role = _trainer(run)
    os.kill(_runtime_pid(role), signal.SIGKILL)
    _wait_state(platform, run, RunState.COMPLETED, RunState.FAILED)
    assert run.state == RunState.COMPLETED, run.reason
    role.refresh_from_db()
    assert (role.attempt, role.restarts, role.exit_code) == (1, 1, 0)
    assert _live_steps(run) == list(range(1, 15))  # each step once: the killed attempt's later steps rewound
    assert RunEvent.objects.filter(run=run, kind="role_restarted").count() == 1
    resumed = RunEvent.objects.get(run=run, attempt=1, kind="resume")
    assert resumed.payload["step"] in CheckpointRecord.objects.filter(run=run, attempt=0).values_list("step", flat=True)


def test_a_killed_rollout_process_is_replaced_while_the_run_goes_on(platform, cluster):
    run = _submit(
        platform, cluster, spec_text("kill-rollout", mode="async", steps=14, resources={"rollout_workers": 2})
    )

    def rollout_pids():
        beat = RoleHeartbeat.objects.filter(run=run, role="trainer-0").order_by("-last_seen").first()
        pids = (beat.info or {}).get("rollout_pids") if beat else None
        return pids if pids and (beat.info or {}).get("step", 0) >= 1 else None

    pids = wait_for(rollout_pids, "rollout processes to report", RUN_S, platform.logs)
    os.kill(pids[0], signal.SIGKILL)
    _wait_state(platform, run, RunState.COMPLETED, RunState.FAILED)
    assert run.state == RunState.COMPLETED, run.reason
    assert _trainer(run).restarts == 0  # the trainer never went down
    assert RunEvent.objects.filter(run=run, kind="rollout_restarted").count() == 1
    assert _live_steps(run) == list(range(1, 15))


def _command(platform, cluster, run, kind, args=None) -> Command:
    status, body = _api(platform, cluster).request(
        "POST", f"/api/runs/{run.pk}/commands/", {"kind": kind, "args": args or {}}
    )
    assert status == 201, body
    wait_for(
        lambda: Command.objects.filter(pk=body["id"], state__in=["done", "failed"]).exists(),
        f"the runtime to complete {kind}",
        RUN_S,
        platform.logs,
    )
    return Command.objects.get(pk=body["id"])


def test_commands_round_trip_through_the_runtime(platform, cluster):
    # every checkpoint kept: the rollback goes to the first one, which a fast run would otherwise have
    # rotated out (keep_last) while the other commands ran
    run = _submit(platform, cluster, spec_text("commands", steps=400, interval=2, checkpoint={"keep_last": 400}))
    _wait_state(platform, run, RunState.RUNNING)
    wait_for(
        lambda: CheckpointRecord.objects.filter(run=run, step__gte=4).exists(), "checkpoints", RUN_S, platform.logs
    )

    assert _command(platform, cluster, run, "pause").state == "done"
    assert _state(run) == RunState.PAUSED
    assert _command(platform, cluster, run, "set_params", {"params": {"trainer.lr": 5e-4}}).state == "done"
    assert _command(platform, cluster, run, "resume").state == "done"
    assert _state(run) == RunState.RUNNING

    target = CheckpointRecord.objects.filter(run=run).order_by("step").first()
    reported = max(_live_steps(run))
    assert reported > target.step
    rollback = _command(platform, cluster, run, "rollback", {"checkpoint": target.pk})
    assert rollback.state == "done", rollback.message
    rewound = set(MetricPoint.objects.filter(run=run, rewound=True).values_list("step", flat=True))
    assert set(range(target.step + 1, reported + 1)) <= rewound  # what ran after the checkpoint is rewound

    stop = _command(platform, cluster, run, "stop")
    assert stop.state == "done", stop.message
    _wait_state(platform, run, RunState.COMPLETED)
    final = max(_live_steps(run))
    assert final < 400  # stopped early
    assert CheckpointRecord.objects.filter(run=run, step=final).exists()  # with a checkpoint at its last step
    steps = _live_steps(run)
    assert steps == sorted(set(steps))  # no step twice among the live points


def test_cancel_stops_the_role_processes(platform, cluster):
    run = _submit(platform, cluster, spec_text("cancel", steps=400))
    _wait_state(platform, run, RunState.RUNNING)
    role = _trainer(run)
    _api(platform, cluster).cancel(run.pk)
    wait_for(
        lambda: RunRole.objects.filter(pk=role.pk, state="exited").exists(), "the role to be stopped", 60, platform.logs
    )
    assert not Path(f"/proc/{role.pid}").exists() or "State:\tZ" in Path(f"/proc/{role.pid}/status").read_text()
    assert _state(run) == RunState.CANCELLED


def test_metrics_survive_the_web_server_going_away_during_a_run(platform, cluster):
    run = _submit(platform, cluster, spec_text("outage", steps=20, interval=0))
    wait_for(lambda: len(_live_steps(run)) >= 2, "the first metrics", RUN_S, platform.logs)
    platform.stop_server()
    try:
        time.sleep(3)  # steps happen meanwhile; the reporter spools them
    finally:
        platform.start_server()
    _wait_state(platform, run, RunState.COMPLETED, RunState.FAILED)
    assert run.state == RunState.COMPLETED, run.reason
    wait_for(lambda: len(_live_steps(run)) == 20, "every metric point", 60, platform.logs)
    assert _live_steps(run) == list(range(1, 21))


def test_a_higher_priority_run_preempts_a_preemptible_one_which_resumes_later(platform, cluster):
    from jobs.models import Experiment
    from rlplatform.models import Quota

    urgent_quota = Quota.objects.create(
        team=cluster["team"], group=cluster["group"], name="urgent", max_devices=2, max_concurrent_runs=1, priority=10
    )
    Experiment.objects.create(team=cluster["team"], name="urgent", group=cluster["group"], quota=urgent_quota)
    two_devices = {"rollout_devices": 1}  # (async: the mode rollout devices act in)
    low = _submit(
        platform, cluster, spec_text("low", mode="async", steps=40, resources={**two_devices, "preemptible": True})
    )
    _wait_state(platform, low, RunState.RUNNING)
    wait_for(lambda: CheckpointRecord.objects.filter(run=low).exists(), "a checkpoint", RUN_S, platform.logs)
    # Paused, so the preemption finds it mid-run however fast this machine is.
    assert _command(platform, cluster, low, "pause").state == "done"
    created, body = _api(platform, cluster).submit(
        "urgent", spec_text("high", mode="async", steps=4, resources=two_devices)
    )
    high = Run.objects.get(pk=body["id"])

    _wait_state(platform, high, RunState.COMPLETED, RunState.FAILED)
    assert high.state == RunState.COMPLETED, high.reason
    preempt = Command.objects.get(run=low, kind="preempt")
    assert preempt.state == "done" and preempt.created_by is None
    _wait_state(platform, low, RunState.COMPLETED, RunState.FAILED)
    assert low.state == RunState.COMPLETED, low.reason
    states = [
        e["state"]
        for e in RunStreamEntry.objects.filter(run=low, type="state").order_by("seq").values_list("data", flat=True)
    ]
    assert "PREEMPTED" in states and states.index("PREEMPTED") < len(states) - 1
    role = _trainer(low)
    assert (role.attempt, role.restarts) == (1, 0)  # a preemption is not a failure
    resumed = RunEvent.objects.get(run=low, attempt=1, kind="resume")
    assert CheckpointRecord.objects.filter(run=low, attempt=0, step=resumed.payload["step"]).exists()
    assert _live_steps(low) == list(range(1, 41))


def test_a_worker_restart_neither_loses_nor_doubles_a_running_role(platform, cluster):
    run = _submit(platform, cluster, spec_text("worker-restart", steps=60, interval=0))
    _wait_state(platform, run, RunState.RUNNING)
    role = _trainer(run)
    platform.stop_worker()  # the role process lives on: it is detached from the worker
    assert Path(f"/proc/{role.pid}").exists()
    platform.start_worker()  # a new worker adopts it (reads the roles of its host, not its memory)
    _wait_state(platform, run, RunState.COMPLETED, RunState.FAILED)
    assert run.state == RunState.COMPLETED, run.reason
    role.refresh_from_db()
    assert (role.attempt, role.restarts, role.exit_code) == (0, 0, 0)  # the same process, to the end
    assert _live_steps(run) == list(range(1, 61))
