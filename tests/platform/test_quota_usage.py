"""jobs.quota_usage: the one count of what a quota uses, read by admission and by the quotas page."""

from __future__ import annotations

import datetime

import pytest
from django.utils import timezone

from jobs import admission
from jobs.models import Allocation
from jobs.quota_usage import QuotaUsage, usage_by_quota
from jobs.states import RunState
from rlplatform.models import Quota


@pytest.fixture
def busy_quota(make_experiment, team_a, cpu_group, submit, start, complete):
    """Team A's quota with one RUNNING 2-device run, one queued run and one finished run; an hour accrued."""
    exp = make_experiment(team_a, cpu_group, "busy", max_concurrent_runs=1)
    finished = complete(submit(exp, 1))
    running = start(submit(exp, 2))
    waiting = submit(exp, 1)
    assert (finished.state, running.state, waiting.state) == (RunState.COMPLETED, RunState.RUNNING, RunState.QUEUED)
    Quota.objects.filter(pk=exp.quota_id).update(device_seconds_used=3600.0)
    return Quota.objects.get(pk=exp.quota_id), running


def test_usage_counts_held_devices_active_runs_queued_runs_and_device_time(
    busy_quota, make_experiment, team_b, cpu_group
):
    quota, running = busy_quota
    idle = make_experiment(team_b, cpu_group, "idle").quota
    now = timezone.now()
    Allocation.objects.filter(run=running).update(accounted_until=now - datetime.timedelta(minutes=90))

    usage = usage_by_quota([quota, idle], now, count_queued=True)

    assert usage == {
        quota.pk: QuotaUsage(
            devices=2, runs=1, rollout_workers=1, accrued_seconds=3600.0, unaccrued_seconds=2 * 5400.0, queued=1
        ),
        idle.pk: QuotaUsage(),
    }
    assert usage[quota.pk].device_hours == 4.0  # one accrued, 2 devices x 1.5 h held since
    # queued runs are counted only when asked for (admission has them already)
    assert usage_by_quota([quota], now)[quota.pk].queued == 0


def test_admission_and_the_quotas_page_read_the_same_usage(busy_quota, superuser, client):
    quota, _running = busy_quota
    now = timezone.now()
    expected = usage_by_quota([quota], now, count_queued=True)[quota.pk]

    assert admission._usage({quota.pk: quota}, now) == {quota.pk: QuotaUsage(**{**vars(expected), "queued": 0})}
    client.force_login(superuser)
    response = client.get("/quotas/")
    assert response.status_code == 200
    (row,) = [q for q in response.context["quotas"] if q.pk == quota.pk]
    shown = row.usage
    assert (shown.devices, shown.runs, shown.rollout_workers, shown.queued) == (2, 1, 1, 1)
    assert shown.accrued_seconds == expected.accrued_seconds
