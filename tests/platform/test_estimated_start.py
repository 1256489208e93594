"""A queued run's estimated start (jobs.start_estimate), its API (GET /api/runs/<id>/start-estimate/) and the
run page: the runs holding devices end after their remaining steps, the queue then starts in order.

Every expected time is computed from jobs.planning.step_time on the same calibration, with the clock
passed in: no assertion depends on how long anything takes.
"""

from __future__ import annotations

import datetime

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from jobs import handler, planning, start_estimate
from jobs.models import MetricPoint, Run
from jobs.states import RunState
from tests.platform.capacity_costs import write_calibration

pytestmark = pytest.mark.django_db

NOW = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.UTC)


@pytest.fixture(autouse=True)
def calibration(settings, tmp_path):
    path = write_calibration(tmp_path, "queue-cpu", "written by tests/platform/test_estimated_start.py")
    settings.TANDEM_CAPACITY_CALIBRATIONS = {"cpu": str(path)}


@pytest.fixture
def pair(make_group, make_experiment, team_a, owner):
    """A two-device group with an experiment allowed to use all of it."""
    group = make_group("pair", hosts=[("h1", 2, None)], teams=[team_a])
    return group, make_experiment(team_a, group, "pair-exp", max_devices=2)


def _spec(devices: int, steps: int, name: str = "r") -> str:
    return f"name: {name}\npipeline:\n  steps: {steps}\nresources:\n  trainer_devices: {devices}\n"


def _submit(owner, experiment, devices, steps, **kwargs):
    run, _ = handler.submit_run(owner, experiment, _spec(devices, steps), **kwargs)
    return run


def _step_s(run, group) -> float:
    return planning.step_time(run.resolved_spec, planning.Group.of(group))[0]


def _estimate(run):
    return start_estimate.estimate(Run.objects.select_related("experiment__group").get(pk=run.pk), NOW)


def test_runs_behind_a_running_one_start_when_it_ends_then_in_queue_order(pair, owner, start):
    group, exp = pair
    running = start(_submit(owner, exp, 2, 50))  # holds both devices
    MetricPoint.objects.create(run=running, attempt=0, step=10, time=timezone.now(), metrics={"reward/mean": 0.1})
    second = _submit(owner, exp, 1, 20)
    third = _submit(owner, exp, 2, 30)
    assert (second.state, third.state) == (RunState.QUEUED, RunState.QUEUED)
    ends_at = NOW + datetime.timedelta(seconds=(50 - 10) * _step_s(running, group))
    found = _estimate(second)
    assert found.start == ends_at and found.start > NOW
    assert (found.runs_ahead, found.holding) == (0, 1)
    assert found.calibrations == [{"name": "queue-cpu", "source": "written by tests/platform/test_estimated_start.py"}]
    # the third needs both devices: it waits for the second's whole run too
    behind = _estimate(third)
    assert behind.start == ends_at + datetime.timedelta(seconds=20 * _step_s(second, group))
    assert behind.runs_ahead == 1
    assert behind.reason == "after 1 runs ahead and the 1 runs holding devices end, at their predicted speed"


def test_a_run_that_fits_beside_the_one_ahead_starts_with_it(make_group, make_experiment, team_a, owner, start):
    group = make_group("four", hosts=[("h1", 4, None)], teams=[team_a])
    exp = make_experiment(team_a, group, "four-exp", max_devices=8)
    holder = start(_submit(owner, exp, 3, 40))
    head, beside = _submit(owner, exp, 2, 10), _submit(owner, exp, 1, 10)
    assert (head.state, beside.state) == (RunState.QUEUED, RunState.QUEUED)  # the head holds the queue back
    at = NOW + datetime.timedelta(seconds=40 * _step_s(holder, group))
    # both wait for the holder (1 device free; the head needs 2 and goes first), then start together
    assert (_estimate(head).start, _estimate(beside).start) == (at, at)


def test_the_head_of_the_queue_with_free_devices_starts_now(make_group, make_experiment, team_a, owner):
    group = make_group("roomy", hosts=[("h1", 4, None)], teams=[team_a])
    exp = make_experiment(team_a, group, "one-at-a-time", max_concurrent_runs=1)
    _submit(owner, exp, 1, 10)  # admitted: the quota allows one run at a time
    waiting = _submit(owner, exp, 1, 10)
    assert waiting.state == RunState.QUEUED
    found = _estimate(waiting)
    assert found.start == NOW
    assert found.reason == "devices are free now: the next admission pass starts it"


def test_no_estimate_behind_a_paused_run_or_one_whose_time_cannot_be_predicted(pair, owner, start):
    group, exp = pair
    holder = start(_submit(owner, exp, 2, 50))
    waiting = _submit(owner, exp, 1, 10)
    handler.transition(holder, RunState.PAUSED)
    found = _estimate(waiting)
    assert (found.start, found.reason) == (None, f"run {holder.pk} is paused: it holds its devices until it is resumed")
    handler.transition(holder, RunState.RUNNING)
    Run.objects.filter(pk=holder.pk).update(resolved_spec={**holder.resolved_spec, "workload": "gym"})
    found = _estimate(waiting)
    assert found.start is None
    assert found.reason == f"run {holder.pk}'s time cannot be predicted: {planning.GYM_REASON}"


def test_only_a_queued_run_has_an_estimate(pair, owner, start):
    _group, exp = pair
    running = start(_submit(owner, exp, 1, 10))
    assert (_estimate(running).start, _estimate(running).reason) == (None, "only a queued run has an estimated start")


def test_a_run_bigger_than_the_healthy_group_has_no_estimate(pair, owner, start):
    from rlplatform.models import Device

    group, exp = pair
    start(_submit(owner, exp, 1, 10))
    waiting = _submit(owner, exp, 2, 10)
    Device.objects.filter(host__group=group, index=1).update(healthy=False)
    found = _estimate(waiting)
    assert (found.start, found.reason) == (None, "it needs more than the group's 1 healthy devices on online hosts")


def test_the_api_answers_for_the_callers_teams_in_a_bounded_number_of_queries(
    pair, owner, outsider, start, django_assert_max_num_queries
):
    _group, exp = pair
    start(_submit(owner, exp, 2, 50))
    queue = [_submit(owner, exp, 1, 10) for _ in range(8)]
    client = APIClient()
    client.force_authenticate(owner)
    counts = []
    for run in (queue[0], queue[-1]):
        with django_assert_max_num_queries(12) as captured:
            reply = client.get(f"/api/runs/{run.pk}/start-estimate/")
        counts.append(len(captured.captured_queries))
        assert reply.status_code == 200
    assert counts[0] == counts[1]  # not one query per run ahead
    body = reply.json()
    assert (body["run"], body["state"]) == (queue[-1].pk, "QUEUED")
    assert datetime.datetime.fromisoformat(body["estimated_start"]) > timezone.now()
    basis = body["estimate_basis"]
    assert (basis["estimate"], basis["runs_ahead"], basis["runs_holding_devices"]) == (True, 7, 1)
    assert basis["calibrations"][0]["name"] == "queue-cpu"
    assert basis["note"].startswith(planning.ESTIMATE_NOTE)
    other = APIClient()
    other.force_authenticate(outsider)
    assert other.get(f"/api/runs/{queue[0].pk}/start-estimate/").status_code == 404


def test_the_run_page_shows_a_queued_runs_estimated_start_and_its_calibration(client, pair, owner, start):
    _group, exp = pair
    start(_submit(owner, exp, 2, 50))
    waiting = _submit(owner, exp, 1, 10)
    client.force_login(owner)
    html = client.get(f"/runs/{waiting.pk}/").content.decode()
    assert '<dt id="estimated-start-row">Estimated start</dt>' in html
    assert "UTC</time>, an estimate from calibration queue-cpu</dd>" in html
    running = Run.objects.filter(experiment=exp, state=RunState.RUNNING).get()
    assert "Estimated start" not in client.get(f"/runs/{running.pk}/").content.decode()
