"""jobs.supervisor and jobs/rolewrap.py with real processes.

The role's command is a small Python stand-in here (it exits, sleeps or prints its environment), so
each supervision rule is exercised in a second or two; tests/launch/test_runs_e2e.py runs the real
``python -m runtime role trainer`` under a real Celery worker.
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
import yaml

from jobs import commands, handler, launch, supervisor
from jobs.lifecycle import files
from jobs.models import RoleState as R
from jobs.states import RunState
from tests.launch.helpers import wait_for

ROLEWRAP = Path(supervisor.__file__).with_name("rolewrap.py")
PRINT_ENV = (
    "import json, os, sys; "
    "print(json.dumps({k: os.environ.get(k) for k in sys.argv[1:]})); "
    "print(json.dumps({'outcome': 'completed', 'steps': 1, 'checkpoint': None}))"
)
ENV_NAMES = ["TANDEM_RUN_TOKEN", "TANDEM_RUN_ID", "TANDEM_ATTEMPT", "TANDEM_ROLE", "DATABASE_URL", "SECRET_KEY"]


def test_rolewrap_records_pid_log_and_exit_status(tmp_path):
    role_dir = tmp_path / "r"
    subprocess.run([sys.executable, ROLEWRAP, role_dir, "--", sys.executable, "-c", "print('hi'); exit(3)"], check=True)
    assert wait_for(lambda: (role_dir / "exit_code").exists(), "exit_code")
    assert (role_dir / "exit_code").read_text() == "3\n"
    assert (role_dir / "log").read_text() == "hi\n"
    assert int((role_dir / "pid").read_text()) > 1

    killed = tmp_path / "k"
    subprocess.run([sys.executable, ROLEWRAP, killed, "--", "sleep", "30"], check=True)
    pid = wait_for(lambda: (killed / "pid").exists() and int((killed / "pid").read_text()), "pid")
    child = wait_for(lambda: _children(pid), "the child")
    os.kill(child[0], signal.SIGKILL)
    assert wait_for(lambda: (killed / "exit_code").exists(), "exit_code")
    assert (killed / "exit_code").read_text() == "137\n"  # 128 + SIGKILL, as a shell reports it


def test_rolewrap_refuses_a_bad_command_line(tmp_path):
    result = subprocess.run([sys.executable, ROLEWRAP, tmp_path], capture_output=True, text=True)
    assert result.returncode == 2 and "usage: rolewrap.py ROLE_DIR -- COMMAND" in result.stderr


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


@pytest.fixture
def stand_in(monkeypatch, settings, tmp_path):
    """stand_in(code) -> use this Python source as the role's command."""
    settings.TANDEM_CHECKPOINT_ROOT = tmp_path / "runs"
    settings.TANDEM_ROLE_HANG_S = 600.0

    def use(source: str, *args: str):
        monkeypatch.setattr(supervisor, "role_command", lambda spec, workdir: [sys.executable, "-c", source, *args])

    return use


@pytest.fixture
def admitted_role(experiment, submit, django_capture_on_commit_callbacks):
    run = submit(experiment)
    with django_capture_on_commit_callbacks(execute=False):
        role = launch.launch_run(run.pk)
    return run, role


def _host_supervisor(role) -> supervisor.Supervisor:
    return supervisor.Supervisor(role.host.name, period_s=0.1)


def _exited(role) -> bool:
    return (files.role_dir(role) / "exit_code").exists()


def test_start_claims_once_and_gives_the_role_its_environment_and_spec(stand_in, admitted_role, monkeypatch, owner):
    monkeypatch.setenv("DATABASE_URL", "postgres://secret@db/x")
    monkeypatch.setenv("SECRET_KEY", "do-not-leak")
    stand_in(PRINT_ENV, *ENV_NAMES)
    run, role = admitted_role
    commands.create(owner, run, "set_params", {"params": {"trainer.lr": 3e-4}})
    assert supervisor.start_role(role.pk, 0) == "started"
    assert supervisor.start_role(role.pk, 0) == "not-claimed"  # a redelivered task starts nothing
    role.refresh_from_db()
    run.refresh_from_db()
    assert role.state == R.RUNNING and role.pid and role.claimed_by == supervisor.worker_id()
    assert run.state == RunState.STARTING
    wait_for(lambda: _exited(role), "the stand-in to exit")
    env = json.loads((files.role_dir(role) / "log").read_text().splitlines()[0])
    assert env["TANDEM_RUN_TOKEN"].startswith("tdr_")
    assert (env["TANDEM_RUN_ID"], env["TANDEM_ATTEMPT"], env["TANDEM_ROLE"]) == (str(run.pk), "0", "trainer-0")
    assert env["DATABASE_URL"] is None and env["SECRET_KEY"] is None  # the platform's secrets stay home
    spec = yaml.safe_load((Path(role.workdir) / "spec.yaml").read_text())
    assert spec["output_dir"] == role.workdir and spec["name"] == run.resolved_spec["name"]
    assert spec["trainer"]["lr"] == 3e-4  # the live change made before the start is in force

    assert _host_supervisor(role).pass_once()["exited"] == 1
    run.refresh_from_db()
    role.refresh_from_db()
    assert run.state == RunState.COMPLETED and (role.state, role.exit_code) == (R.EXITED, 0)


def test_a_killed_trainer_is_restarted_as_a_new_attempt(stand_in, admitted_role, django_capture_on_commit_callbacks):
    stand_in("import time; time.sleep(60)")
    run, role = admitted_role
    supervisor.start_role(role.pk, 0)
    role.refresh_from_db()
    sup = _host_supervisor(role)
    assert sup.pass_once()["renewed"] == 1
    child = wait_for(lambda: _children(role.pid), "the role process")
    os.kill(child[0], signal.SIGKILL)
    wait_for(lambda: _exited(role), "the exit status")
    with django_capture_on_commit_callbacks(execute=False):
        assert sup.pass_once()["exited"] == 1
    role.refresh_from_db()
    assert (role.state, role.attempt, role.restarts) == (R.PENDING, 1, 1)
    assert role.message == "restarting after: exit code 137"


def test_the_processes_of_a_cancelled_run_are_stopped(stand_in, admitted_role):
    stand_in("import time; time.sleep(60)")
    run, role = admitted_role
    supervisor.start_role(role.pk, 0)
    role.refresh_from_db()
    sup = _host_supervisor(role)
    handler.cancel_run(None, run)
    assert sup.pass_once()["killed"] == 1  # SIGTERM to the role's process group
    wait_for(lambda: not supervisor.process_alive(role.pid, str(files.role_dir(role))), "the process group to end")
    sup.pass_once()
    role.refresh_from_db()
    run.refresh_from_db()
    assert role.state == R.EXITED and run.state == RunState.CANCELLED


def test_a_live_process_that_stopped_heartbeating_is_killed_as_hung(stand_in, admitted_role, settings):
    stand_in("import time; time.sleep(60)")
    run, role = admitted_role
    supervisor.start_role(role.pk, 0)
    role.refresh_from_db()
    hung_pid, hung_dir = role.pid, str(files.role_dir(role))
    sup = _host_supervisor(role)
    assert sup.pass_once()["renewed"] == 1  # alive, and not yet silent for long: left alone
    settings.TANDEM_ROLE_HANG_S = 1.0
    time.sleep(1.2)
    assert sup.pass_once()["killed"] == 1
    role.refresh_from_db()
    assert (role.state, role.attempt) == (R.PENDING, 1)
    assert role.message == "restarting after: hung: no heartbeat for 1 s"
    wait_for(lambda: not supervisor.process_alive(hung_pid, hung_dir), "the hung process to die")


def test_a_vanished_process_is_reported_without_an_exit_code(stand_in, admitted_role):
    stand_in("import time; time.sleep(60)")
    run, role = admitted_role
    supervisor.start_role(role.pk, 0)
    role.refresh_from_db()
    os.killpg(role.pid, signal.SIGKILL)  # wrapper and role together: nobody writes exit_code
    wait_for(lambda: not supervisor.process_alive(role.pid, str(files.role_dir(role))), "the group to die")
    assert _host_supervisor(role).pass_once()["exited"] == 1
    role.refresh_from_db()
    assert role.message == "restarting after: the process vanished"


def test_an_exit_written_between_the_supervisors_two_looks_keeps_its_code(stand_in, admitted_role, monkeypatch):
    """The supervisor reads exit_code (none yet), then finds the wrapper gone: the wrapper wrote its code
    and exited in between (a busy host pauses the supervisor there). The clean exit keeps its code 0 —
    the CI failure where a completed run's trainer-0 was stored with exit code None."""
    stand_in("import time; time.sleep(60)")
    run, role = admitted_role
    supervisor.start_role(role.pk, 0)
    role.refresh_from_db()
    directory = files.role_dir(role)
    os.killpg(role.pid, signal.SIGKILL)
    wait_for(lambda: not supervisor.process_alive(role.pid, str(directory)), "the group to die")
    real_alive = supervisor.process_alive

    def wrapper_finishes_meanwhile(pid, marker):  # the wrapper's last two acts, between the two looks
        (directory / "exit_code").write_text("0\n")
        return real_alive(pid, marker)

    monkeypatch.setattr(supervisor, "process_alive", wrapper_finishes_meanwhile)
    assert _host_supervisor(role).pass_once()["exited"] == 1
    role.refresh_from_db()
    run.refresh_from_db()
    assert (role.state, role.exit_code) == (R.EXITED, 0)
    assert run.state == RunState.COMPLETED


def test_a_fork_starts_from_its_parent_checkpoints_policy_and_never_outside_the_root(stand_in, admitted_role, settings):
    run, role = admitted_role
    root = Path(settings.TANDEM_CHECKPOINT_ROOT)
    parent = root / "run-1" / "checkpoints" / "step-00000004"
    run.parent_checkpoint = str(parent)
    run.save(update_fields=["parent_checkpoint"])
    assert supervisor._role_spec(run, role)["model"]["path"] == str(parent / "policy")
    own = run.resolved_spec["model"].get("path")
    (Path(role.workdir) / "checkpoints").mkdir(parents=True)  # a restarted fork resumes its own checkpoints
    assert supervisor._role_spec(run, role)["model"].get("path") == own
    (Path(role.workdir) / "checkpoints").rmdir()
    run.parent_checkpoint = "/etc"  # outside the checkpoint root: never handed to a role
    assert supervisor._role_spec(run, role)["model"].get("path") == own


def test_a_lora_fork_of_a_lora_run_keeps_its_base_and_starts_from_the_parents_adapters(
    stand_in, admitted_role, settings
):
    run, role = admitted_role
    # another run's checkpoint: creating it must not create this run's own checkpoints directory
    parent = Path(settings.TANDEM_CHECKPOINT_ROOT) / f"run-{run.pk + 1}" / "checkpoints" / "step-00000004"
    run.resolved_spec = {**run.resolved_spec, "model": {"builtin": "tiny-qwen2", "lora": {"r": 4}}}
    run.parent_checkpoint = str(parent)
    run.save(update_fields=["resolved_spec", "parent_checkpoint"])
    # a parent trained in full: the fork's adapters start fresh on the parent's policy
    assert supervisor._role_spec(run, role)["model"] == {
        "builtin": "tiny-qwen2",
        "lora": {"r": 4},
        "path": str(parent / "policy"),
    }
    (parent / "policy" / "adapter").mkdir(parents=True)  # a LoRA parent exports its adapters beside the merge
    assert supervisor._role_spec(run, role)["model"] == {
        "builtin": "tiny-qwen2",
        "lora": {"r": 4, "init_path": str(parent / "policy" / "adapter")},
    }


def test_a_gym_fork_starts_its_learner_from_the_parent_checkpoints_networks(stand_in, admitted_role, settings):
    run, role = admitted_role
    parent = Path(settings.TANDEM_CHECKPOINT_ROOT) / "run-1" / "checkpoints" / "step-00000004"
    run.resolved_spec = {"workload": "gym", "env": {"id": "CartPole-v1"}, "agent": {"algorithm": "ppo"}}
    run.parent_checkpoint = str(parent)
    run.save(update_fields=["resolved_spec", "parent_checkpoint"])
    spec = supervisor._role_spec(run, role)
    assert spec["agent"] == {"algorithm": "ppo", "init_path": str(parent)} and "model" not in spec


def test_the_role_spec_keeps_the_runs_own_checkpoint_retention(admitted_role):
    run, role = admitted_role
    # jobs.checkpoints.apply_retention deletes by the run's keep_last, sparing pinned checkpoints, fork
    # parents and pending rollback targets; the managed trainer role turns the runtime's own rotation off
    # (tests/runtime/test_contract.py), so the role's spec carries the user's value unchanged
    assert (
        supervisor._role_spec(run, role)["checkpoint"]["keep_last"] == run.resolved_spec["checkpoint"]["keep_last"] == 3
    )
