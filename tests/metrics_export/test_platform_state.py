"""/metrics' figures from PostgreSQL (jobs.metrics.platform_state) against the rows each test makes.

Scraped through Django's test client and read with prometheus_client's parser
(``prometheus_client.parser.text_string_to_metric_families``); test_prometheus.py scrapes with a real
Prometheus server.
"""

from __future__ import annotations

import datetime
import math

import pytest
from django.utils import timezone

from jobs import commands, handler
from jobs.lifecycle import apply
from jobs.models import CommandKind, Run, RunRole
from jobs.models import RoleState as R
from jobs.states import RunState
from rlplatform.models import Host, HostStatus
from tests.launch.helpers import launch_captured
from tests.metrics_export.helpers import parse, value


@pytest.fixture
def scrape(client, make_scrape_token):
    token = make_scrape_token()

    def do():
        response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
        assert response.status_code == 200
        return parse(response.content.decode())

    return do


@pytest.fixture
def two_groups(make_group, make_experiment, team_a):
    """metrics-a: one host of 4 devices; metrics-b: two hosts of 2, the second offline."""
    group_a = make_group("metrics-a", hosts=[("h1", 4, "sw1")], teams=[team_a])
    group_b = make_group("metrics-b", hosts=[("h1", 2, "sw1"), ("h2", 2, "sw1")], teams=[team_a])
    Host.objects.filter(name="metrics-b-h2").update(status=HostStatus.OFFLINE)
    limits = {"max_devices": 8, "max_concurrent_runs": 8}
    return make_experiment(team_a, group_a, "exp-ma", **limits), make_experiment(team_a, group_b, "exp-mb", **limits)


def test_queue_runs_devices_admissions_and_preemptions_match_the_database(two_groups, submit, start, complete, scrape):
    exp_a, exp_b = two_groups
    first, *waiting = [submit(exp_a, devices=4) for _ in range(4)]  # the group holds one such run at a time
    assert [r.state for r in (first, *waiting)] == [RunState.ADMITTED] + [RunState.QUEUED] * 3
    Run.objects.filter(pk=waiting[0].pk).update(submitted_at=timezone.now() - datetime.timedelta(seconds=300))
    commands.create(None, start(first), CommandKind.PREEMPT)
    complete(submit(exp_b))
    assert submit(exp_b).state == RunState.ADMITTED

    samples = scrape()

    assert value(samples, "tandem_queue_depth", group="metrics-a") == 3
    assert value(samples, "tandem_queue_depth", group="metrics-b") == 0
    assert 300 <= value(samples, "tandem_queue_oldest_wait_seconds", group="metrics-a") < 360
    assert value(samples, "tandem_queue_oldest_wait_seconds", group="metrics-b") == 0
    runs_a = {s: value(samples, "tandem_runs", group="metrics-a", state=s) for s in RunState}
    assert runs_a == {s: {"QUEUED": 3, "RUNNING": 1}.get(s, 0) for s in RunState}
    assert value(samples, "tandem_runs", group="metrics-b", state="COMPLETED") == 1
    assert value(samples, "tandem_runs", group="metrics-b", state="ADMITTED") == 1

    def devices(group: str, status: str) -> float:
        return value(
            samples, "tandem_devices", group=group, device_kind="cpu", device_model="test-device", status=status
        )

    assert [devices("metrics-a", s) for s in ("allocated", "free", "unavailable")] == [4, 0, 0]
    assert [devices("metrics-b", s) for s in ("allocated", "free", "unavailable")] == [1, 1, 2]
    assert value(samples, "tandem_admissions_total", group="metrics-a") == 1
    assert value(samples, "tandem_admissions_total", group="metrics-b") == 2
    assert value(samples, "tandem_preemptions_total", group="metrics-a") == 1
    assert value(samples, "tandem_preemptions_total", group="metrics-b") == 0


def test_a_readmission_counts_as_a_second_admission(two_groups, submit, start, scrape):
    exp_a, _ = two_groups
    run = start(submit(exp_a))
    handler.transition(run, RunState.PREEMPTED, "preempted by a test")
    handler.transition(run, RunState.QUEUED, "requeued by a test")  # admitted again at once: the group has room
    run.refresh_from_db()
    assert run.state == RunState.ADMITTED
    assert value(scrape(), "tandem_admissions_total", group="metrics-a") == 2


def test_host_heartbeat_age_and_status(two_groups, scrape):
    Host.objects.filter(name="metrics-a-h1").update(last_heartbeat=timezone.now() - datetime.timedelta(seconds=42))
    samples = scrape()
    assert 42 <= value(samples, "tandem_host_heartbeat_age_seconds", group="metrics-a", host="metrics-a-h1") < 100
    never = value(samples, "tandem_host_heartbeat_age_seconds", group="metrics-b", host="metrics-b-h2")
    assert math.isinf(never)
    assert value(samples, "tandem_hosts", group="metrics-b", status="online") == 1
    assert value(samples, "tandem_hosts", group="metrics-b", status="offline") == 1
    assert value(samples, "tandem_hosts", group="metrics-a", status="lost") == 0


@pytest.fixture
def running_role(experiment, submit, settings, tmp_path, django_capture_on_commit_callbacks):
    """running_role(run=None) -> (run, its trainer role RUNNING on its current attempt)."""
    settings.TANDEM_CHECKPOINT_ROOT = tmp_path
    settings.TANDEM_HOST_FAILURE_LIMIT = 10  # restarts stay on the host

    def make(run=None):
        if run is None:
            run = submit(experiment)
            role, _ = launch_captured(run, django_capture_on_commit_callbacks)
            handler.transition(run, RunState.STARTING)
        else:
            role = RunRole.objects.get(run=run)
        RunRole.objects.filter(pk=role.pk).update(state=R.RUNNING, pid=999999, launched_at=timezone.now())
        role.refresh_from_db()
        return run, role

    return make


def test_role_restarts_and_failures_by_cause(running_role, scrape):
    run, role = running_role()
    assert apply.role_exited(role.pk, role.attempt, 137) == "restarting"
    run, role = running_role(run)
    assert apply.role_exited(role.pk, role.attempt, None, why="vanished") == "restarting"
    run, role = running_role(run)
    assert apply.host_lost(role.pk, role.attempt, role.host.name) == "requeued"
    _, other = running_role()
    assert apply.role_exited(other.pk, other.attempt, 2, "error: model.path: nope\n") == "failed"
    cancelled, last = running_role()
    handler.cancel_run(None, cancelled)
    apply.role_exited(last.pk, last.attempt, -15)  # stopped because it was cancelled: no failure

    samples = scrape()

    def failures(cause: str) -> float:
        return value(samples, "tandem_role_failures_total", 0.0, group="cpu-local", role_kind="trainer", cause=cause)

    assert [failures(c) for c in ("exit_code", "vanished", "host_lost", "bad_input")] == [1, 1, 1, 1]
    assert value(samples, "tandem_role_restarts_total", group="cpu-local", role_kind="trainer") == 2
