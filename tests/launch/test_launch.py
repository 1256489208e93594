"""jobs.launch: placing a run's role, and what each way a role process ends does to its run.

The start tasks are captured (not sent): tests/launch/test_runs_e2e.py runs the real thing.
"""

from __future__ import annotations

import datetime

import pytest
from django.utils import timezone

from jobs import commands, handler, launch
from jobs.handler import InvalidInput
from jobs.lifecycle import apply, events, files, watchdog
from jobs.models import Allocation, MetricPoint, RunEvent, RunRole, RunToken
from jobs.models import RoleState as R
from jobs.states import RunState
from rlplatform.models import HostStatus
from tests.launch.helpers import launch_captured, start_tasks


@pytest.fixture(autouse=True)
def _roots(settings, tmp_path):
    settings.TANDEM_CHECKPOINT_ROOT = tmp_path


def test_launch_places_the_trainer_on_the_runs_devices(experiment, submit, django_capture_on_commit_callbacks):
    run = submit(experiment, devices=2)
    assert run.state == RunState.ADMITTED
    role, sent = launch_captured(run, django_capture_on_commit_callbacks)
    devices = list(Allocation.objects.active().filter(run=run).values_list("device__host_id", "device__index"))
    assert {h for h, _ in devices} == {role.host_id}
    assert (role.name, role.state, role.attempt, role.restarts) == ("trainer-0", R.PENDING, 0, 0)
    assert role.device_indices == sorted(i for _, i in devices)
    assert role.workdir == str(files.run_dir(run.pk))
    assert len(sent) == 1  # the start task, to the host's queue, after commit
    assert RunEvent.objects.filter(run=run, role=events.PLATFORM_ROLE, kind="role_queued").count() == 1
    # Idempotent: a second launch (a redelivered launch task) changes nothing and sends nothing.
    again, sent_again = launch_captured(run, django_capture_on_commit_callbacks)
    assert again is None and sent_again == []
    assert RunRole.objects.filter(run=run).count() == 1


def test_a_run_that_is_not_admitted_is_not_launched(experiment, submit, start, django_capture_on_commit_callbacks):
    run = start(submit(experiment))
    role, sent = launch_captured(run, django_capture_on_commit_callbacks)
    assert role is None and sent == [] and not RunRole.objects.filter(run=run).exists()


@pytest.fixture
def launched(experiment, submit, django_capture_on_commit_callbacks):
    """A run whose trainer role is started (RUNNING) on attempt 0."""

    def make(**spec_resources):
        run = submit(experiment)
        if spec_resources:
            run.resolved_spec["resources"].update(spec_resources)
            run.save(update_fields=["resolved_spec"])
        role, _ = launch_captured(run, django_capture_on_commit_callbacks)
        RunRole.objects.filter(pk=role.pk).update(state=R.RUNNING, pid=999999, launched_at=timezone.now())
        handler.transition(run, RunState.STARTING)
        role.refresh_from_db()
        return run, role

    return make


def _exit(role, code, log="", why="", capture=None):
    if capture is None:
        return apply.role_exited(role.pk, role.attempt, code, log, why)
    with capture(execute=False) as sent:
        decision = apply.role_exited(role.pk, role.attempt, code, log, why)
    return decision, start_tasks(sent)


def test_exit_zero_completes_the_run_and_revokes_its_tokens(launched):
    run, role = launched()
    from jobs.ingest.tokens import mint_run_token

    mint_run_token(run, 0)
    log = 'step 3\n{"outcome": "completed", "steps": 3, "checkpoint": null}\n'
    assert _exit(role, 0, log) == "completed"
    run.refresh_from_db()
    role.refresh_from_db()
    assert run.state == RunState.COMPLETED  # walked STARTING -> RUNNING -> COMPLETED
    assert (role.state, role.exit_code) == (R.EXITED, 0)
    assert not RunToken.objects.filter(run=run, revoked_at__isnull=True).exists()
    assert not Allocation.objects.active().filter(run=run).exists()
    assert _exit(role, 0, log) == "ignored"  # reported twice (a supervisor restarted): once only


def test_bad_input_fails_the_run_at_starting_with_the_runtimes_message(launched):
    run, role = launched()
    log = "error: model.path: no such directory: /nope\n"
    assert _exit(role, 2, log) == "failed"
    run.refresh_from_db()
    assert run.state == RunState.FAILED
    assert run.reason == "trainer-0 rejected its input: model.path: no such directory: /nope"


def test_a_crash_restarts_the_trainer_until_the_budget_is_spent(launched, settings, django_capture_on_commit_callbacks):
    settings.TANDEM_HOST_FAILURE_LIMIT = 10  # all on one host here (moving hosts: the test below)
    run, role = launched(max_restarts=2)
    for attempt in (1, 2):
        decision, sent = _exit(role, 137, "", capture=django_capture_on_commit_callbacks)
        role.refresh_from_db()
        assert decision == "restarting" and len(sent) == 1
        assert (role.state, role.attempt, role.restarts) == (R.PENDING, attempt, attempt)
        RunRole.objects.filter(pk=role.pk).update(state=R.RUNNING, pid=999999)
        role.refresh_from_db()
    run.refresh_from_db()
    assert run.state == RunState.STARTING  # a restart keeps the run and its devices
    assert Allocation.objects.active().filter(run=run).count() == 1
    assert _exit(role, 1, "error: RuntimeError: out of memory\n") == "failed"
    run.refresh_from_db()
    assert run.state == RunState.FAILED
    assert run.reason == "trainer-0 failed after 2 restarts: RuntimeError: out of memory"
    kinds = list(RunEvent.objects.filter(run=run, role=events.PLATFORM_ROLE).values_list("kind", flat=True))
    assert kinds.count("role_restarted") == 2 and kinds.count("role_exited") == 3


def test_a_preempted_exit_requeues_the_run(launched):
    run, role = launched()
    handler.transition(run, RunState.RUNNING)
    assert _exit(role, 0, '{"outcome": "preempted", "steps": 4, "checkpoint": "x"}\n') == "preempted"
    run.refresh_from_db()
    # Requeued, then admitted again at once (the group has room): a new attempt follows.
    assert run.state in (RunState.QUEUED, RunState.ADMITTED)
    assert RunEvent.objects.filter(run=run, kind="role_exited").count() == 1


def test_the_exit_of_a_cancelled_run_only_records_the_role(launched):
    run, role = launched()
    handler.cancel_run(None, run)
    assert _exit(role, 143) == "ended"
    run.refresh_from_db()
    role.refresh_from_db()
    assert run.state == RunState.CANCELLED and role.state == R.EXITED and role.exit_code == 143


def test_a_lost_host_requeues_the_run_and_the_watchdog_finds_it(launched, settings):
    settings.TANDEM_HOST_GRACE_S = 5
    run, role = launched()
    handler.transition(run, RunState.RUNNING)
    long_ago = timezone.now() - datetime.timedelta(seconds=60)
    RunRole.objects.filter(pk=role.pk).update(supervised_at=long_ago)
    role.host.status = HostStatus.ONLINE
    role.host.save()
    assert watchdog.watch()["lost"] == 0  # its agent is alive: a late supervisor is not a lost host
    role.host.status = HostStatus.LOST
    role.host.save()
    assert watchdog.watch()["lost"] == 1
    run.refresh_from_db()
    role.refresh_from_db()
    assert role.state == R.EXITED and role.message == f"host {role.host.name} lost"
    assert role.restarts == 1
    assert run.state in (RunState.QUEUED, RunState.ADMITTED)


def test_the_watchdog_resends_a_start_task_nobody_claimed(launched, settings, django_capture_on_commit_callbacks):
    settings.TANDEM_LAUNCH_TIMEOUT_S = 5
    run, role = launched()
    RunRole.objects.filter(pk=role.pk).update(state=R.PENDING, queued_at=timezone.now() - datetime.timedelta(60))
    role.host.status = HostStatus.ONLINE
    role.host.save()
    with django_capture_on_commit_callbacks(execute=False) as sent:
        counts = watchdog.watch()
    assert counts["resent"] == 1 and len(start_tasks(sent)) == 1
    role.refresh_from_db()
    assert (timezone.now() - role.queued_at).total_seconds() < 5


def test_a_restarted_attempt_rewinds_the_earlier_attempts_steps_after_its_checkpoint(run):
    from jobs.ingest import handler as ingest
    from jobs.ingest.tokens import authenticate_run_token, mint_run_token

    first = authenticate_run_token(mint_run_token(run, 0))
    ingest.ingest_batch(first, {"points": [{"step": s, "metrics": {"reward/mean": s}} for s in range(1, 7)]})
    second = authenticate_run_token(mint_run_token(run, 1))
    ingest.ingest_batch(second, {"events": [{"seq": 1, "kind": "resume", "payload": {"step": 4}}]})
    live = sorted(MetricPoint.objects.filter(run=run).live().values_list("attempt", "step"))
    assert live == [(0, 1), (0, 2), (0, 3), (0, 4)]
    assert sorted(MetricPoint.objects.filter(run=run, rewound=True).values_list("step", flat=True)) == [5, 6]


def test_the_first_running_heartbeat_moves_a_starting_run_to_running(experiment, submit):
    from jobs.ingest import handler as ingest
    from jobs.ingest.tokens import authenticate_run_token, mint_run_token

    run = submit(experiment)
    handler.transition(run, RunState.STARTING)
    token = authenticate_run_token(mint_run_token(run, 0))
    ingest.heartbeat(token, {"role": "trainer-0", "status": "starting"})
    run.refresh_from_db()
    assert run.state == RunState.STARTING
    ingest.heartbeat(token, {"role": "trainer-0", "status": "running"})
    run.refresh_from_db()
    assert run.state == RunState.RUNNING and run.started_at is not None


def test_users_cannot_send_preempt(run, owner):
    with pytest.raises(InvalidInput, match="preempt is issued by the platform's scheduler only"):
        commands.create(owner, run, "preempt")
    assert not run.commands.exists()


def test_a_role_that_keeps_failing_on_a_host_is_moved_to_another(
    launched, settings, django_capture_on_commit_callbacks
):
    settings.TANDEM_HOST_FAILURE_LIMIT = 2
    run, role = launched(max_restarts=5)
    first_host = role.host
    assert _exit(role, 1, "error: RuntimeError: device error\n") == "restarting"
    role.refresh_from_db()
    RunRole.objects.filter(pk=role.pk).update(state=R.RUNNING, pid=999999)
    role.refresh_from_db()
    with django_capture_on_commit_callbacks(execute=False):
        assert _exit(role, 1, "error: RuntimeError: device error\n") == "requeued"
    run.refresh_from_db()
    assert run.excluded_hosts == [first_host.pk]
    assert run.state == RunState.ADMITTED  # requeued, and admitted at once on the group's other host
    device_hosts = set(Allocation.objects.active().filter(run=run).values_list("device__host_id", flat=True))
    assert device_hosts and first_host.pk not in device_hosts
    assert RunEvent.objects.filter(run=run, kind="host_excluded").count() == 1
    with django_capture_on_commit_callbacks(execute=False):
        moved = launch.launch_run(run.pk)
    assert moved.host_id != first_host.pk and moved.attempt == role.attempt + 1 and moved.restarts == 2


def test_a_run_kept_off_its_only_host_waits_without_holding_the_queue(make_group, make_experiment, team_a, owner):
    from jobs.models import Run

    group = make_group("single", "cpu", hosts=[("h1", 4, "sw1")], teams=[team_a])
    experiment = make_experiment(team_a, group, "single")
    host = group.hosts.get()
    kept_off, _ = handler.submit_run(owner, experiment, "name: a\n")
    Run.objects.filter(pk=kept_off.pk).update(excluded_hosts=[host.pk])
    handler.transition(kept_off, RunState.PREEMPTED, "failed twice on h1")
    handler.requeue_run(kept_off)
    kept_off.refresh_from_db()
    assert kept_off.state == RunState.QUEUED
    assert kept_off.reason == (
        f"no free cpu devices in group single (need 1, free 4); not on {host.name}, where it kept failing"
    )
    later, _ = handler.submit_run(owner, experiment, "name: b\n")
    assert later.state == RunState.ADMITTED  # not held back behind the run kept off the host


def test_checkpoint_records_follow_the_checkpoints_a_rollback_set_aside(run):
    from jobs.ingest import handler as ingest
    from jobs.ingest.tokens import authenticate_run_token, mint_run_token
    from jobs.models import CheckpointRecord

    root = f"{files.run_dir(run.pk)}/checkpoints"  # records are accepted only inside the run's own directory
    for step in (2, 4, 6):
        CheckpointRecord.objects.create(run=run, step=step, path=f"{root}/step-{step:08d}")
    token = authenticate_run_token(mint_run_token(run, 0))
    aside = [f"{root}/rewound/001-to-step-00000002/step-{step:08d}" for step in (4, 6)]
    event = {"seq": 1, "kind": "rollback", "payload": {"step": 2, "path": f"{root}/step-00000002", "set_aside": aside}}
    ingest.ingest_batch(token, {"events": [event]})
    assert sorted(CheckpointRecord.objects.filter(run=run).values_list("step", "path")) == [
        (2, f"{root}/step-00000002"),
        (4, aside[0]),
        (6, aside[1]),
    ]


def test_what_an_ended_role_could_not_deliver_is_stored_from_its_spool(launched):
    from pathlib import Path

    from jobs.ingest.tokens import mint_run_token
    from runtime.contract import spool_dir
    from runtime.managed.reporter import HttpReporter

    run, role = launched()
    handler.transition(run, RunState.RUNNING)
    token = mint_run_token(run, 0)
    # The platform was unreachable when the role ended: its last points are still in its spool.
    reporter = HttpReporter(
        "http://127.0.0.1:9", token, spool_dir(Path(role.workdir), 0), run=str(run.pk), role="trainer-0"
    )
    for step in (1, 2, 3):
        reporter.report(step, {"reward/mean": step / 10})
    reporter.event("checkpoint", {"step": 3, "path": f"{role.workdir}/checkpoints/step-00000003"})
    reporter.close(timeout=0.2)
    assert not MetricPoint.objects.filter(run=run).exists()

    assert _exit(role, 0, '{"outcome": "completed", "steps": 3}\n') == "completed"
    assert sorted(MetricPoint.objects.filter(run=run).values_list("step", flat=True)) == [1, 2, 3]
    assert run.checkpoints.get().step == 3
    run.refresh_from_db()
    assert run.state == RunState.COMPLETED
