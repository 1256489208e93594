"""The role watchdog (jobs.tasks.watch_roles, celery beat): what the hosts' supervisors cannot report.

A host whose supervisor stopped renewing its roles' leases is gone (unless its agent is still online:
then its supervisor catches up); a start task the broker lost is sent again; an admitted run whose
launch was missed is launched.
"""

from __future__ import annotations

import datetime

from django.conf import settings
from django.utils import timezone

from jobs import launch
from jobs.lifecycle.apply import IGNORED, host_lost
from jobs.models import RoleState as R
from jobs.models import Run, RunRole
from jobs.states import RunState
from rlplatform.models import HostStatus


def watch() -> dict[str, int]:
    """One watchdog pass: hosts that stopped supervising their roles, start tasks the broker lost,
    admitted runs never launched. Idempotent; returns counts."""
    now = timezone.now()
    grace = datetime.timedelta(seconds=settings.TANDEM_HOST_GRACE_S)
    launch_timeout = datetime.timedelta(seconds=settings.TANDEM_LAUNCH_TIMEOUT_S)
    counts = {"lost": 0, "resent": 0, "launched": 0}
    stale = RunRole.objects.filter(state__in=[R.LAUNCHING, R.RUNNING], supervised_at__lt=now - grace)
    for role_id, attempt, host_name, status in stale.values_list("pk", "attempt", "host__name", "host__status"):
        if status != HostStatus.ONLINE:  # an online host's agent is alive: its supervisor catches up
            counts["lost"] += host_lost(role_id, attempt, host_name) != IGNORED
    pending = RunRole.objects.filter(state=R.PENDING, queued_at__lt=now - launch_timeout)
    for role_id, attempt, host_name, status in pending.values_list("pk", "attempt", "host__name", "host__status"):
        if status == HostStatus.ONLINE:
            counts["resent"] += launch.resend_start(role_id)
        else:
            counts["lost"] += host_lost(role_id, attempt, host_name) != IGNORED
    missed = Run.objects.filter(state=RunState.ADMITTED, admitted_at__lt=now - launch_timeout).exclude(
        roles__state__in=[R.PENDING, R.LAUNCHING, R.RUNNING]
    )
    for run_id in missed.values_list("pk", flat=True):
        counts["launched"] += launch.launch_run(run_id) is not None
    return counts
