"""Device-hour accounting: accrued while held, on release and by the periodic tick, never twice."""

import datetime

import pytest
from django.utils import timezone

from jobs import accounting, handler, tasks
from jobs.models import Allocation
from jobs.states import RunState
from rlplatform.models import HostStatus, Quota

pytestmark = pytest.mark.django_db

HOUR = datetime.timedelta(hours=1)


def _used(quota):
    return Quota.objects.get(pk=quota.pk).device_seconds_used


def test_tick_accrues_each_second_once(experiment, submit):
    run = submit(experiment, 2)
    start = timezone.now() - 3 * HOUR
    Allocation.objects.filter(run=run).update(accounted_until=start)
    accounting.accrue_group(experiment.group_id, now=start + HOUR)
    assert _used(experiment.quota) == 2 * 3600.0
    accounting.accrue_group(experiment.group_id, now=start + HOUR)  # same instant again: nothing new
    assert _used(experiment.quota) == 2 * 3600.0
    accounting.accrue_group(experiment.group_id, now=start + 2 * HOUR)
    assert _used(experiment.quota) == 4 * 3600.0


def test_release_accrues_the_last_stretch_and_stops(experiment, submit):
    run = submit(experiment, 1)
    Allocation.objects.filter(run=run).update(accounted_until=timezone.now() - HOUR)
    handler.cancel_run(None, run)
    used = _used(experiment.quota)
    assert 3600.0 <= used < 3600.0 + 60
    [allocation] = Allocation.objects.filter(run=run)
    assert allocation.released_at is not None and allocation.accounted_until == allocation.released_at
    tasks.accrue_device_time()  # released allocations accrue nothing more
    assert _used(experiment.quota) == used


def test_budget_reached_by_running_runs_queues_new_ones(make_group, make_experiment, team_a, submit):
    group = make_group("g", hosts=[("h1", 4, None)], teams=[team_a])
    exp = make_experiment(team_a, group, "e", device_hour_budget=2.0)
    holder = submit(exp, 2)
    Allocation.objects.filter(run=holder).update(accounted_until=timezone.now() - HOUR)
    # Not yet accrued, but admission counts the held time: 2 devices x 1 h = the whole budget.
    waiting = submit(exp, 1)
    assert waiting.state == RunState.QUEUED
    assert waiting.reason == "device-hour budget exhausted (2.0/2.0 h)"
    # The running run is not stopped by its exhausted budget.
    holder.refresh_from_db()
    assert holder.state == RunState.ADMITTED


def test_periodic_tasks_admit_and_accrue(make_group, make_experiment, team_a, submit):
    group = make_group("g", hosts=[("h1", 1, None)], teams=[team_a])
    exp = make_experiment(team_a, group, "e")
    group.hosts.update(status=HostStatus.LOST)
    waiting = submit(exp, 1)
    assert waiting.state == RunState.QUEUED
    assert tasks.admit_pending() == 0
    # The host comes back (heartbeats update rows, no admission call): the periodic pass admits.
    group.hosts.update(status=HostStatus.ONLINE)
    assert tasks.admit_pending() == 1
    waiting.refresh_from_db()
    assert waiting.state == RunState.ADMITTED
    Allocation.objects.filter(run=waiting).update(accounted_until=timezone.now() - HOUR)
    assert 3600.0 <= tasks.accrue_device_time() < 3600.0 + 60
