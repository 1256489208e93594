"""Periodic control-plane tasks (queue ``default``; beat schedule in settings).

Both are idempotent and safe to overlap: every pass takes the group lock,
and accounting moves each allocation's ``accounted_until`` mark.
"""

from __future__ import annotations

from celery import shared_task

from jobs import accounting, admission
from jobs.models import Allocation, Run


@shared_task(name="jobs.tasks.admit_pending", soft_time_limit=60, time_limit=90)
def admit_pending() -> int:
    """Admission pass over every group with queued runs (catches anything a submit or release missed)."""
    group_ids = sorted(set(Run.objects.queued().values_list("experiment__group_id", flat=True)))
    return sum(len(admission.admit_group(group_id)) for group_id in group_ids)


@shared_task(name="jobs.tasks.accrue_device_time", soft_time_limit=60, time_limit=90)
def accrue_device_time() -> float:
    """Add the device time of every active allocation to its quota; returns the seconds added."""
    group_ids = sorted(set(Allocation.objects.active().values_list("device__host__group_id", flat=True)))
    return sum(sum(accounting.accrue_group(group_id).values()) for group_id in group_ids)
