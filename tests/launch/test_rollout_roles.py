"""Remote rollout roles (``resources.remote_rollout_workers``): placement across hosts, what each way a
rollout role ends does to its run, stopping what an earlier admission left, and command delivery.

Decisions are tested against the database (start tasks captured, not sent); the end-to-end tests at the
bottom (slow) run uvicorn, a Celery worker per host (two hosts on this machine) and real
``python -m runtime role trainer|rollout`` processes.
"""

from __future__ import annotations

import datetime

import pytest
from django.utils import timezone

from jobs import commands, handler, launch, placement, supervisor
from jobs.ingest import handler as ingest
from jobs.lifecycle import apply, files, watchdog
from jobs.lifecycle.roles import superseded
from jobs.models import Allocation, RunEvent, RunRole
from jobs.models import RoleState as R
from jobs.states import RunState
from rlplatform.models import HostStatus
from tests.launch.helpers import e2e_spec, launch_captured, start_tasks, stop_and_wait_for_the_end


def remote_spec(workers: int = 2, *, trainer_devices: int = 1, name: str = "remote", **resources) -> str:
    extra = "".join(f"  {key}: {value}\n" for key, value in resources.items())
    return (
        f"name: {name}\npipeline:\n  mode: async\nresources:\n  device: cpu\n  trainer_devices: {trainer_devices}\n"
        f"  rollout_workers: 0\n  remote_rollout_workers: {workers}\n{extra}"
    )


# --- the pure split ------------------------------------------------------------------------------------


def _shape(trainer: int, remote: int, extras: int = 0) -> placement.Shape:
    return placement.Shape(trainer + extras + remote, trainer + extras, extras + 1)


def test_split_puts_the_trainer_share_on_the_fullest_host_and_one_device_per_rollout_instance():
    assert placement.split_roles({7: [0, 1], 3: [5]}, _shape(1, 2), {}) == ([(7, [0])], [(7, 1), (3, 5)])
    # Ties go to the lowest host id; the trainer's host is filled first, then the others by id.
    assert placement.split_roles({9: [2, 3], 4: [0, 1]}, _shape(2, 2), {}) == ([(4, [0, 1])], [(9, 2), (9, 3)])
    # The fullest host that can hold the share, not merely the fullest.
    assert placement.split_roles({1: [0, 1, 2], 2: [0, 1, 2, 3]}, _shape(4, 3), {}) == (
        [(2, [0, 1, 2, 3])],
        [(1, 0), (1, 1), (1, 2)],
    )


def test_split_refuses_what_cannot_be_divided_with_the_reason():
    # rank 0 and its 2 rollout devices must share a host
    assert placement.split_roles({1: [0, 1], 2: [0, 1]}, _shape(1, 1, extras=2), {}) == (
        "its trainer's first host needs 3 devices (rank 0 with its rollout and evaluator devices), "
        "but its 4 devices lie on 2 hosts with at most 2 on one"
    )
    assert placement.split_roles({1: [0, 1]}, _shape(1, 2), {}) == "it holds 2 devices but needs 3"


# --- fixtures ------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _roots(settings, tmp_path):
    settings.TANDEM_CHECKPOINT_ROOT = tmp_path


@pytest.fixture
def two_hosts(make_group, make_experiment, team_a, owner):
    """Two hosts of two CPU devices on one switch, and team A's experiment there."""
    group = make_group("pair", "cpu", hosts=[("h1", 2, "sw1"), ("h2", 2, "sw1")], teams=[team_a])
    return make_experiment(team_a, group, "pair")


def _roles(run) -> dict[str, RunRole]:
    return {role.name: role for role in RunRole.objects.filter(run=run).select_related("host")}


@pytest.fixture
def running(two_hosts, owner, django_capture_on_commit_callbacks):
    """running(workers=2, **resources) -> a RUNNING run whose roles all run (attempt 0)."""

    def make(workers: int = 2, **resources):
        run, _ = handler.submit_run(owner, two_hosts, remote_spec(workers, **resources))
        assert run.state == RunState.ADMITTED, run.reason
        launch_captured(run, django_capture_on_commit_callbacks)
        RunRole.objects.filter(run=run).update(state=R.RUNNING, pid=999999, launched_at=timezone.now())
        handler.transition(run, RunState.STARTING)
        handler.transition(run, RunState.RUNNING)
        return run, _roles(run)

    return make


def _exit(role, code, log="", why="", capture=None):
    role.refresh_from_db()
    if capture is None:
        return apply.role_exited(role.pk, role.attempt, code, log, why), []
    with capture(execute=False) as sent:
        decision = apply.role_exited(role.pk, role.attempt, code, log, why)
    return decision, start_tasks(sent)


def _state(run) -> str:
    run.refresh_from_db()
    return run.state


def _snapshot(role) -> tuple:
    role.refresh_from_db()
    return (role.state, role.attempt, role.restarts, role.host_id, role.device_indices)


# --- placement -----------------------------------------------------------------------------------------


def test_launch_places_the_trainer_on_one_host_and_each_rollout_role_on_a_device_of_its_own(
    two_hosts, owner, django_capture_on_commit_callbacks
):
    run, _ = handler.submit_run(owner, two_hosts, remote_spec(2))
    allocated = sorted(Allocation.objects.active().filter(run=run).values_list("device__host__name", "device__index"))
    assert allocated == [("pair-h1", 0), ("pair-h1", 1), ("pair-h2", 0)]  # admission spread it over two hosts

    trainer, sent = launch_captured(run, django_capture_on_commit_callbacks)

    roles = _roles(run)
    assert trainer.name == "trainer-0"
    placed = {name: (r.host.name, r.device_indices, r.state, r.attempt) for name, r in roles.items()}
    assert placed == {
        "trainer-0": ("pair-h1", [0], R.PENDING, 0),
        "rollout-0": ("pair-h1", [1], R.PENDING, 0),
        "rollout-1": ("pair-h2", [0], R.PENDING, 0),
    }
    assert len(sent) == 3  # one start task per role, each to its host's queue, after commit
    assert {r.workdir for r in roles.values()} == {str(files.run_dir(run.pk))}  # one shared run directory
    queued = RunEvent.objects.filter(run=run, kind="role_queued").values_list("payload", flat=True)
    assert sorted(p["role"] for p in queued) == ["rollout-0", "rollout-1", "trainer-0"]

    # Idempotent: a redelivered launch task changes nothing and sends nothing.
    again, sent_again = launch_captured(run, django_capture_on_commit_callbacks)
    assert again is None and sent_again == []
    assert {name: (r.host.name, r.device_indices, r.attempt) for name, r in _roles(run).items()} == {
        name: (host, indices, attempt) for name, (host, indices, _state, attempt) in placed.items()
    }


def test_a_run_whose_first_trainer_host_fits_no_host_waits_in_the_queue(
    two_hosts, owner, django_capture_on_commit_callbacks
):
    # rank 0 and its 2 rollout devices must share a host (they are processes of trainer-0): 3 do not fit
    # on hosts of 2, so the run waits instead of being admitted across hosts and failing at launch
    run, _ = handler.submit_run(owner, two_hosts, remote_spec(1, rollout_devices=2))
    run.refresh_from_db()
    assert run.state == RunState.QUEUED
    assert run.reason.startswith("no free cpu devices in group")
    trainer, sent = launch_captured(run, django_capture_on_commit_callbacks)
    assert trainer is None and sent == []
    assert not RunRole.objects.filter(run=run).exists()
    assert not Allocation.objects.active().filter(run=run).exists()


# --- the start: command line and environment ------------------------------------------------------------


def test_a_rollout_role_runs_role_rollout_with_the_runs_shared_key(running, settings):
    run, roles = running(2)
    path = files.run_dir(run.pk) / "spec.yaml"
    assert supervisor._command(roles["rollout-1"], path)[1:] == [
        "-m",
        "runtime",
        "role",
        "rollout",
        "--spec",
        str(path),
        "--workdir",
        roles["rollout-1"].workdir,
    ]
    assert supervisor._command(roles["trainer-0"], path)[4] == "trainer"

    envs = {name: supervisor._role_env(run, role, "tdr_x") for name, role in roles.items()}
    keys = {env["TANDEM_ROLLOUT_KEY"] for env in envs.values()}
    assert len(keys) == 1 and len(keys.pop()) == 64  # the same secret for every role of the run
    assert envs["rollout-1"]["TANDEM_ROLE"] == "rollout-1"
    assert envs["rollout-1"]["TANDEM_HOST_NAME"] == "pair-h2"
    assert envs["trainer-0"]["TANDEM_HOST_ADDRESS"] == roles["trainer-0"].host.address == "127.0.0.1"
    # Another run has another key; a run without remote rollout roles has none.
    assert supervisor.rollout_key(run.pk + 1) != envs["trainer-0"]["TANDEM_ROLLOUT_KEY"]
    settings.SECRET_KEY = "another-secret-key-of-another-platform-0123456789"
    assert supervisor.rollout_key(run.pk) != envs["trainer-0"]["TANDEM_ROLLOUT_KEY"]


def test_start_role_runs_each_role_with_its_kind_and_the_runs_key(
    two_hosts, owner, monkeypatch, django_capture_on_commit_callbacks
):
    """Real role processes (a stand-in that prints what it was given) through the real wrapper."""
    import json
    import sys
    from pathlib import Path

    from tests.launch.helpers import wait_for

    names = ["TANDEM_ROLE", "TANDEM_ROLLOUT_KEY", "TANDEM_HOST_ADDRESS", "TANDEM_ATTEMPT", "SECRET_KEY"]
    source = "import json, os, sys; print(json.dumps([sys.argv[1], {k: os.environ.get(k) for k in sys.argv[2:]}]))"
    monkeypatch.setattr(
        supervisor,
        "role_command",
        lambda spec, workdir, kind="trainer": [sys.executable, "-c", source, kind, *names],
    )
    run, _ = handler.submit_run(owner, two_hosts, remote_spec(1))
    launch_captured(run, django_capture_on_commit_callbacks)
    seen = {}
    for name, role in _roles(run).items():
        assert supervisor.start_role(role.pk, 0) == "started"
        log = files.role_dir(role) / "log"
        wait_for(lambda role=role: (files.role_dir(role) / "exit_code").exists(), f"{name} to exit")
        seen[name] = json.loads(log.read_text().splitlines()[0])
    assert [seen["trainer-0"][0], seen["rollout-0"][0]] == ["trainer", "rollout"]
    trainer_env, rollout_env = seen["trainer-0"][1], seen["rollout-0"][1]
    assert trainer_env["TANDEM_ROLLOUT_KEY"] == rollout_env["TANDEM_ROLLOUT_KEY"] == supervisor.rollout_key(run.pk)
    assert (rollout_env["TANDEM_ROLE"], rollout_env["TANDEM_ATTEMPT"]) == ("rollout-0", "0")
    assert rollout_env["TANDEM_HOST_ADDRESS"] == "127.0.0.1" and rollout_env["SECRET_KEY"] is None
    # One spec file in the run directory, written whole (no partial file left behind).
    assert sorted(p.name for p in Path(files.run_dir(run.pk)).iterdir()) == ["roles", "spec.yaml"]


def test_a_run_without_remote_rollout_roles_gets_no_rollout_key(experiment, submit, django_capture_on_commit_callbacks):
    run = submit(experiment)
    trainer, _ = launch_captured(run, django_capture_on_commit_callbacks)
    env = supervisor._role_env(run, trainer, "tdr_x")
    assert "TANDEM_ROLLOUT_KEY" not in env and env["TANDEM_HOST_ADDRESS"] == trainer.host.address
    assert list(RunRole.objects.filter(run=run).values_list("name", flat=True)) == ["trainer-0"]


# --- how a rollout role ends ----------------------------------------------------------------------------


def test_a_crashed_rollout_role_restarts_on_its_devices_until_its_budget_is_spent(
    running, django_capture_on_commit_callbacks
):
    run, roles = running(2, rollout_restarts=2)
    rollout, trainer = roles["rollout-1"], roles["trainer-0"]
    trainer_before, other_before = _snapshot(trainer), _snapshot(roles["rollout-0"])
    for n in (1, 2):
        decision, sent = _exit(rollout, 137, capture=django_capture_on_commit_callbacks)
        assert decision == "restarting" and len(sent) == 1
        assert _snapshot(rollout) == (R.PENDING, n, n, rollout.host_id, [0])
        rollout.refresh_from_db()
        assert rollout.message == "restarting after: exit code 137"
        RunRole.objects.filter(pk=rollout.pk).update(state=R.RUNNING, pid=999999)
        assert _state(run) == RunState.RUNNING  # the run goes on
    assert _snapshot(trainer) == trainer_before and _snapshot(roles["rollout-0"]) == other_before

    decision, sent = _exit(
        rollout, 3, "error: no trainer reachable for 600 s\n", capture=django_capture_on_commit_callbacks
    )
    assert decision == "failed" and sent == []
    run.refresh_from_db()
    assert run.state == RunState.FAILED
    assert run.reason == "rollout-1 failed after 2 restarts: no trainer reachable for 600 s"
    assert RunEvent.objects.filter(run=run, kind="role_restarted").count() == 2


def test_a_vanished_rollout_role_is_restarted_too(running, django_capture_on_commit_callbacks):
    run, roles = running(1)
    decision, sent = _exit(
        roles["rollout-0"], None, why="the process vanished", capture=django_capture_on_commit_callbacks
    )
    assert decision == "restarting" and len(sent) == 1
    roles["rollout-0"].refresh_from_db()
    assert roles["rollout-0"].message == "restarting after: the process vanished"


def test_a_rollout_role_that_exits_zero_is_done_and_not_restarted(running, django_capture_on_commit_callbacks):
    run, roles = running(2)
    decision, sent = _exit(roles["rollout-0"], 0, capture=django_capture_on_commit_callbacks)
    assert decision == "done" and sent == []
    assert _snapshot(roles["rollout-0"])[:3] == (R.EXITED, 0, 0)
    assert _state(run) == RunState.RUNNING  # the run follows its trainer, not a rollout role
    assert RunEvent.objects.filter(run=run, kind="role_done").values_list("payload", flat=True).get() == {
        "role": "rollout-0",
        "attempt": 0,
    }
    assert apply.role_exited(roles["rollout-0"].pk, 0, 0) == "ignored"  # reported twice: once only


def test_bad_input_of_a_rollout_role_fails_the_run_at_once(running):
    run, roles = running(2, rollout_restarts=5)
    decision, _ = _exit(roles["rollout-1"], 2, "error: TANDEM_ROLLOUT_KEY: required\n")
    assert decision == "failed"
    run.refresh_from_db()
    assert run.state == RunState.FAILED
    assert run.reason == "rollout-1 rejected its input: TANDEM_ROLLOUT_KEY: required"
    assert roles["rollout-1"].restarts == 0


def test_a_trainer_restart_leaves_the_rollout_roles_running(running, settings, django_capture_on_commit_callbacks):
    settings.TANDEM_HOST_FAILURE_LIMIT = 10
    run, roles = running(2)
    before = {name: _snapshot(roles[name]) for name in ("rollout-0", "rollout-1")}
    decision, sent = _exit(
        roles["trainer-0"], 1, "error: RuntimeError: boom\n", capture=django_capture_on_commit_callbacks
    )
    assert decision == "restarting" and len(sent) == 1  # the trainer's start task only
    assert _snapshot(roles["trainer-0"])[:3] == (R.PENDING, 1, 1)
    assert {name: _snapshot(roles[name]) for name in ("rollout-0", "rollout-1")} == before
    assert _state(run) == RunState.RUNNING


def test_the_runs_end_follows_the_trainer_and_ends_the_rollout_roles(running):
    run, roles = running(1)
    assert _exit(roles["trainer-0"], 0, '{"outcome": "completed", "steps": 3}\n')[0] == "completed"
    assert _state(run) == RunState.COMPLETED
    rollout = roles["rollout-0"]
    rollout.refresh_from_db()
    sup = supervisor.Supervisor(rollout.host.name, 0.1)
    now = timezone.now()
    assert sup._should_stop(rollout, now) is False  # it is released by the trainer: a moment to exit by itself
    later = now + datetime.timedelta(seconds=supervisor.ROLLOUT_STOP_GRACE_S + 0.5)
    assert sup._should_stop(rollout, later) is True
    # The trainer of a stopped run keeps its longer grace (a final checkpoint).
    assert sup._should_stop(roles["trainer-0"], later) is False
    assert _exit(rollout, 143)[0] == "ended"
    assert _state(run) == RunState.COMPLETED


def test_a_rollout_roles_short_grace_counts_from_the_trainers_exit_not_the_runs_end(running):
    """A stop is acknowledged (the run is COMPLETED) before trainer-0 shuts down and releases its rollout
    roles; on a loaded machine that takes longer than a rollout role's grace, which must not run out first."""
    run, roles = running(1)
    handler.transition(run, RunState.COMPLETED)  # the stop's acknowledgement; trainer-0 still shutting down
    rollout, trainer = roles["rollout-0"], roles["trainer-0"]
    rollout.refresh_from_db()
    sup = supervisor.Supervisor(rollout.host.name, 0.1)
    ended = timezone.now()
    past_short = ended + datetime.timedelta(seconds=supervisor.ROLLOUT_STOP_GRACE_S + 0.5)
    assert sup._should_stop(rollout, past_short) is False  # not released yet: trainer-0 lives
    past_long = ended + datetime.timedelta(seconds=supervisor.STOP_GRACE_S + 0.5)
    assert sup._should_stop(rollout, past_long) is True  # nor waited for beyond the trainer's own grace
    assert _exit(trainer, 0, '{"outcome": "stopped", "steps": 3}\n')[0] == "ended"
    trainer.refresh_from_db()
    assert sup._should_stop(rollout, trainer.exited_at) is False  # released now: a moment to exit by itself
    later = trainer.exited_at + datetime.timedelta(seconds=supervisor.ROLLOUT_STOP_GRACE_S + 0.5)
    assert sup._should_stop(rollout, later) is True


# --- a requeued run: every role of the new admission, none of the old ----------------------------------


def test_a_preempted_run_is_launched_again_once_its_earlier_rollout_roles_ended(
    running, django_capture_on_commit_callbacks
):
    run, roles = running(2)
    decision, _ = _exit(roles["trainer-0"], 0, '{"outcome": "preempted", "steps": 4}\n')
    assert decision == "preempted"
    assert _state(run) == RunState.ADMITTED  # requeued and admitted again at once (the group has room)

    # Its rollout roles of the earlier admission still live: nothing is launched yet, and their
    # supervisors stop them.
    assert launch_captured(run, django_capture_on_commit_callbacks) == (None, [])
    rollout0, rollout1 = roles["rollout-0"], roles["rollout-1"]
    rollout0.refresh_from_db()
    assert superseded(rollout0, run) is True
    assert supervisor.Supervisor(rollout0.host.name, 0.1)._should_stop(rollout0, timezone.now()) is True

    assert _exit(rollout0, 0, capture=django_capture_on_commit_callbacks) == ("superseded", [])
    files.run_dir(run.pk).mkdir(parents=True)
    (files.run_dir(run.pk) / launch.ENDPOINT_FILE).write_text('{"ended": true}')
    with django_capture_on_commit_callbacks(execute=False) as sent_all:
        decision = apply.role_exited(rollout1.pk, 0, 143)
    sent = start_tasks(sent_all)
    assert decision == "superseded" and len(sent) == 3  # the last one out launches every role again
    # The earlier trainer's run-ended marker goes before the new roles start (they would leave at once).
    endpoint = files.run_dir(run.pk) / launch.ENDPOINT_FILE
    forget = [c for c in sent_all if "_forget_endpoint" in c.__qualname__]
    assert endpoint.exists() and len(forget) == 1
    assert sent_all.index(forget[0]) < sent_all.index(sent[0])  # after commit, before the start tasks
    forget[0]()
    assert not endpoint.exists()
    relaunched = {name: (r.state, r.attempt, r.restarts) for name, r in _roles(run).items()}
    assert relaunched == {
        "trainer-0": (R.PENDING, 1, 0),
        "rollout-0": (R.PENDING, 1, 0),
        "rollout-1": (R.PENDING, 1, 0),
    }
    assert RunEvent.objects.filter(run=run, kind="role_restarted").count() == 0  # a preemption is no failure


def test_a_restart_still_pending_when_the_run_was_admitted_again_is_never_started(
    running, django_capture_on_commit_callbacks
):
    run, roles = running(1)
    rollout = roles["rollout-0"]
    _exit(rollout, 137, capture=django_capture_on_commit_callbacks)  # its restart is queued (attempt 1) ...
    _exit(roles["trainer-0"], 0, '{"outcome": "preempted", "steps": 2}\n')  # ... when the run is requeued
    assert _state(run) == RunState.ADMITTED
    with django_capture_on_commit_callbacks(execute=False) as sent:
        assert supervisor.start_role(rollout.pk, 1) == "superseded"
    assert len(start_tasks(sent)) == 2  # it was the last live attempt: every role is launched again
    assert {name: (r.state, r.attempt, r.pid) for name, r in _roles(run).items()} == {
        "trainer-0": (R.PENDING, 1, None),
        "rollout-0": (R.PENDING, 2, None),
    }


def test_a_freshly_launched_rollout_role_is_not_taken_for_a_leftover(
    two_hosts, owner, django_capture_on_commit_callbacks
):
    run, _ = handler.submit_run(owner, two_hosts, remote_spec(2))
    launch_captured(run, django_capture_on_commit_callbacks)
    roles = _roles(run)
    assert _state(run) == RunState.ADMITTED
    assert not any(superseded(role, run) for role in roles.values())
    # A start that fails while the run is still ADMITTED is a failure of this admission: restarted.
    decision, sent = _exit(roles["rollout-0"], None, why="could not start", capture=django_capture_on_commit_callbacks)
    assert decision == "restarting" and len(sent) == 1


def test_a_lost_host_requeues_the_run_and_every_live_attempt_of_it_ends(
    running, settings, django_capture_on_commit_callbacks
):
    settings.TANDEM_HOST_GRACE_S = 5
    run, roles = running(1)  # trainer-0 on pair-h1 [0], rollout-0 on pair-h1 [1]
    h1 = roles["trainer-0"].host
    # Move the rollout role to the other host, which is then lost.
    h2 = run.experiment.group.hosts.exclude(pk=h1.pk).get()
    RunRole.objects.filter(pk=roles["rollout-0"].pk).update(host=h2, device_indices=[0])
    RunRole.objects.filter(run=run).update(supervised_at=timezone.now() - datetime.timedelta(seconds=60))
    RunRole.objects.filter(pk=roles["trainer-0"].pk).update(supervised_at=timezone.now())
    h2.status = HostStatus.LOST
    h2.save()

    with django_capture_on_commit_callbacks(execute=False):
        assert watchdog.watch()["lost"] == 1
    rollout = RunRole.objects.get(pk=roles["rollout-0"].pk)
    assert (rollout.state, rollout.message, rollout.restarts) == (R.EXITED, "host pair-h2 lost", 1)
    run.refresh_from_db()
    assert run.state == RunState.ADMITTED  # requeued, admitted again on what is left of the group
    assert set(Allocation.objects.active().filter(run=run).values_list("device__host_id", flat=True)) == {h1.pk}

    # The trainer of the earlier admission lives on h1: its supervisor stops it; its end relaunches.
    trainer = RunRole.objects.select_related("run").get(pk=roles["trainer-0"].pk)
    assert supervisor.Supervisor(h1.name, 0.1)._should_stop(trainer, timezone.now()) is True
    decision, sent = _exit(trainer, 143, capture=django_capture_on_commit_callbacks)
    assert decision == "superseded" and len(sent) == 2
    assert {name: (r.host_id, r.state, r.attempt) for name, r in _roles(run).items()} == {
        "trainer-0": (h1.pk, R.PENDING, 1),
        "rollout-0": (h1.pk, R.PENDING, 1),
    }


# --- commands ride on the trainer's heartbeats only ----------------------------------------------------


def test_a_rollout_roles_heartbeat_never_takes_the_trainers_commands(running, owner):
    from jobs.ingest.tokens import authenticate_run_token, mint_run_token
    from jobs.models import Command

    run, _ = running(1)
    command = commands.create(owner, run, "pause")
    rollout_token = authenticate_run_token(mint_run_token(run, 0))

    reply = ingest.heartbeat(rollout_token, {"role": "rollout-0", "status": "waiting for the trainer"})

    assert reply == {"commands": []}
    assert Command.objects.get(pk=command.pk).state == "pending"  # not marked delivered
    trainer_token = authenticate_run_token(mint_run_token(run, 0))
    reply = ingest.heartbeat(trainer_token, {"role": "trainer-0", "status": "running"})
    assert [c["id"] for c in reply["commands"]] == [command.pk]
    assert Command.objects.get(pk=command.pk).state == "delivered"


# --- end to end: a real worker per host, real runtime processes -----------------------------------------

RUN_S = 180.0  # ceiling for the whole run on a loaded machine


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_run_with_remote_rollout_roles_on_two_hosts_goes_on_through_a_killed_rollout_role(
    platform, cluster, second_host
):
    """trainer-0 and rollout-0 on the first host, rollout-1 on the second; rollout-1 is SIGKILLed while the
    run goes on, restarted by the platform on its host, and reconnects; then the run is stopped (a run long
    enough to outlast any restart, ended by a command, so the test does not depend on this machine's speed)."""
    import os
    import signal
    from pathlib import Path

    import yaml

    from jobs.client import TandemClient
    from jobs.models import Experiment, MetricPoint, RoleHeartbeat, Run
    from rlplatform.models import Quota
    from tests.launch.helpers import wait_for

    quota = Quota.objects.create(
        team=cluster["team"], group=cluster["group"], name="remote", max_devices=3, max_concurrent_runs=1
    )
    Experiment.objects.create(team=cluster["team"], name="remote", group=cluster["group"], quota=quota)
    spec = e2e_spec("remote-rollout", {"remote_rollout_workers": 2}, {"interval": 0})
    api = TandemClient(platform.url, cluster["token"])
    created, body = api.submit("remote", yaml.safe_dump(spec))
    assert created, body
    run = Run.objects.get(pk=body["id"])
    logs = [*platform.logs, second_host["log"]]

    def role_logs() -> list[Path]:  # the workers' run directory (this process's settings point elsewhere)
        workdirs = set(RunRole.objects.filter(run=run).values_list("workdir", flat=True))
        return sorted(log for workdir in workdirs for log in Path(workdir).glob("roles/*/attempt-*/log"))

    # Admission spreads its three devices: two on the first host, one on the second.
    roles = wait_for(lambda: len(_roles(run)) == 3 and _roles(run), "the roles to be placed", 60, logs)
    assert {name: r.host.name for name, r in roles.items()} == {
        "trainer-0": platform.host_name,
        "rollout-0": platform.host_name,
        "rollout-1": second_host["name"],
    }

    def serving(attempt: int):
        """rollout-1's ``attempt`` connected to the trainer (its heartbeat says so) while the run goes on."""
        assert _state(run) in (RunState.ADMITTED, RunState.STARTING, RunState.RUNNING), run.reason
        role = RunRole.objects.get(run=run, name="rollout-1")
        beat = RoleHeartbeat.objects.filter(run=run, role="rollout-1", attempt=attempt, status="running").exists()
        trained = MetricPoint.objects.filter(run=run).exists()
        return role.attempt == attempt and role.state == R.RUNNING and beat and trained and role

    victim = wait_for(lambda: serving(0), "rollout-1 to serve the trainer", RUN_S, logs + role_logs())
    children = Path(f"/proc/{victim.pid}/task/{victim.pid}/children").read_text().split()
    os.kill(int(children[0]), signal.SIGKILL)  # the runtime process, under its wrapper
    wait_for(lambda: serving(1), "the restarted rollout-1 to reconnect", RUN_S, logs + role_logs())

    stop_and_wait_for_the_end(api, run, logs + role_logs(), RUN_S)
    ended = {r.name: (r.attempt, r.restarts, r.exit_code, r.host.name) for r in _roles(run).values()}
    assert ended == {
        "trainer-0": (0, 0, 0, platform.host_name),  # the trainer never went down
        "rollout-0": (0, 0, 0, platform.host_name),  # released by the trainer at the end
        "rollout-1": (1, 1, 0, second_host["name"]),  # restarted once, on its host, then released
    }
    restarted = RunEvent.objects.filter(run=run, kind="role_restarted").values_list("payload", flat=True)
    assert [(p["role"], p["attempt"]) for p in restarted] == [("rollout-1", 1)]
    # The trainer saw rank 1 go and come back (rank 0 and rank 1 connected, rank 1 again).
    runtime_events = RunEvent.objects.filter(run=run, role="trainer-0")
    assert runtime_events.filter(kind="rollout_disconnected").count() == 1
    assert sorted(e.payload["rank"] for e in runtime_events.filter(kind="rollout_connected")) == [0, 1, 1]
    live = sorted(MetricPoint.objects.filter(run=run).live().values_list("step", flat=True))
    assert live == list(range(1, live[-1] + 1))  # every step once, up to the one it stopped at


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_preempted_run_with_a_remote_rollout_role_resumes_with_every_role(platform, cluster):
    """The preempted trainer leaves the run-ended marker in the endpoint file and releases its rollout role;
    the run is admitted again at once and both roles start again: the new rollout role must wait for the
    new trainer, not leave on the earlier one's marker."""
    import yaml

    from jobs.client import TandemClient
    from jobs.models import CheckpointRecord, MetricPoint, RoleHeartbeat, Run
    from tests.launch.helpers import wait_for

    spec = e2e_spec(
        "remote-preempt", {"remote_rollout_workers": 1, "preemptible": True}, {"interval": 5, "keep_last": 1000}
    )
    api = TandemClient(platform.url, cluster["token"])
    created, body = api.submit("e2e", yaml.safe_dump(spec))
    assert created, body
    run = Run.objects.get(pk=body["id"])
    logs = platform.logs
    wait_for(lambda: CheckpointRecord.objects.filter(run=run).exists(), "a checkpoint", RUN_S, logs)
    commands.create(None, run, "preempt")  # what jobs.preemption sends for a waiting higher-priority run

    wait_for(
        lambda: RoleHeartbeat.objects.filter(run=run, role="rollout-0", attempt=1, status="running").exists(),
        "the new admission's rollout role to connect to the new trainer",
        RUN_S,
        logs,
    )
    stop_and_wait_for_the_end(api, run, logs, RUN_S)
    assert {r.name: (r.attempt, r.restarts, r.exit_code) for r in _roles(run).values()} == {
        "trainer-0": (1, 0, 0),  # a preemption is not a failure
        "rollout-0": (1, 0, 0),
    }
    resumed = RunEvent.objects.get(run=run, role="trainer-0", attempt=1, kind="resume")
    assert CheckpointRecord.objects.filter(run=run, attempt=0, step=resumed.payload["step"]).exists()
    live = sorted(MetricPoint.objects.filter(run=run).live().values_list("step", flat=True))
    assert live == list(range(1, live[-1] + 1))


# --- the remote evaluator: a role of its own, like a rollout role ---------------------------------------


def test_a_remote_evaluator_gets_a_device_and_a_role_of_its_own(two_hosts, owner, django_capture_on_commit_callbacks):
    run, _ = handler.submit_run(owner, two_hosts, remote_spec(1, remote_evaluator="true"))
    assert run.devices_requested == 3
    trainer, sent = launch_captured(run, django_capture_on_commit_callbacks)
    roles = _roles(run)
    assert {name: (r.host.name, r.device_indices) for name, r in roles.items()} == {
        "trainer-0": ("pair-h1", [0]),
        "rollout-0": ("pair-h1", [1]),
        "evaluator": ("pair-h2", [0]),
    }
    assert len(sent) == 3
    path = files.run_dir(run.pk) / "spec.yaml"
    assert supervisor._command(roles["evaluator"], path)[4] == "evaluator"
    env = supervisor._role_env(run, roles["evaluator"], "tdr_x")
    assert env["TANDEM_ROLLOUT_KEY"] == supervisor.rollout_key(run.pk) and env["TANDEM_ROLE"] == "evaluator"


def test_a_run_with_only_a_remote_evaluator_shares_the_key_with_it(
    two_hosts, owner, django_capture_on_commit_callbacks
):
    spec = remote_spec(0, remote_evaluator="true").replace("rollout_workers: 0\n", "rollout_workers: 1\n", 1)
    run, _ = handler.submit_run(owner, two_hosts, spec)
    launch_captured(run, django_capture_on_commit_callbacks)
    roles = _roles(run)
    assert sorted(roles) == ["evaluator", "trainer-0"]
    keys = {supervisor._role_env(run, role, "tdr_x")["TANDEM_ROLLOUT_KEY"] for role in roles.values()}
    assert len(keys) == 1


def test_a_crashed_evaluator_restarts_while_the_run_goes_on_until_its_budget_is_spent(
    running, django_capture_on_commit_callbacks
):
    run, roles = running(1, remote_evaluator="true", rollout_restarts=1)
    evaluator = roles["evaluator"]
    decision, sent = _exit(evaluator, 1, capture=django_capture_on_commit_callbacks)
    assert (decision, len(sent)) == ("restarting", 1)
    assert _snapshot(evaluator)[:3] == (R.PENDING, 1, 1)
    assert _state(run) == RunState.RUNNING
    RunRole.objects.filter(pk=evaluator.pk).update(state=R.RUNNING)
    assert _exit(evaluator, 1)[0] == "failed"
    assert _state(run) == RunState.FAILED
    assert run.reason == "evaluator failed after 1 restarts: exit code 1"


def test_an_evaluator_that_exits_zero_is_done(running):
    run, roles = running(1, remote_evaluator="true")
    assert _exit(roles["evaluator"], 0)[0] == "done"
    assert _state(run) == RunState.RUNNING


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_remote_evaluator_role_evaluates_for_the_trainer_and_is_restarted_after_a_kill(platform, cluster):
    """trainer-0 and the evaluator role on this host's two devices: the evaluator's results arrive as the
    run's eval metrics; its process is SIGKILLed, the platform restarts it while the run goes on, and
    evaluations arrive again; then the run is stopped and the evaluator leaves with exit 0."""
    import os
    import signal
    from pathlib import Path

    import yaml

    from jobs.client import TandemClient
    from jobs.models import MetricPoint, RoleHeartbeat, Run
    from tests.launch.helpers import wait_for

    spec = e2e_spec("remote-eval", {"rollout_workers": 1, "remote_evaluator": True}, {"interval": 0})
    spec["pipeline"]["eval_interval"] = 2
    api = TandemClient(platform.url, cluster["token"])
    created, body = api.submit("e2e", yaml.safe_dump(spec))
    assert created, body
    run = Run.objects.get(pk=body["id"])
    logs = platform.logs

    def evaluations() -> int:
        return MetricPoint.objects.filter(run=run, metrics__has_key="eval/accuracy").count()

    def serving(attempt: int, after: int):
        assert _state(run) in (RunState.ADMITTED, RunState.STARTING, RunState.RUNNING), run.reason
        role = RunRole.objects.filter(run=run, name="evaluator", attempt=attempt, state=R.RUNNING).first()
        beat = RoleHeartbeat.objects.filter(run=run, role="evaluator", attempt=attempt, status="running").exists()
        return role is not None and beat and evaluations() > after and role

    victim = wait_for(lambda: serving(0, 0), "the evaluator's first results", RUN_S, logs)
    before = evaluations()
    children = Path(f"/proc/{victim.pid}/task/{victim.pid}/children").read_text().split()
    os.kill(int(children[0]), signal.SIGKILL)  # the runtime process, under its wrapper
    wait_for(lambda: serving(1, before), "the restarted evaluator's results", RUN_S, logs)

    stop_and_wait_for_the_end(api, run, logs, RUN_S)
    roles = _roles(run).values()
    assert {r.name: (r.attempt, r.restarts, r.exit_code) for r in roles} == {
        "trainer-0": (0, 0, 0),
        "evaluator": (1, 1, 0),  # restarted once, then released by the trainer
    }, {r.name: r.message for r in roles}
    connected = RunEvent.objects.filter(run=run, role="trainer-0", kind="evaluator_connected").count()
    assert connected == 2
