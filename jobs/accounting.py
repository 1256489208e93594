"""Device-hour accounting: quotas accrue the seconds their runs hold devices.

Each allocation remembers ``accounted_until``; accruing adds (now -
accounted_until) to the quota and moves the mark to now, so the periodic tick
and the final release never count the same second twice. Callers hold the
group lock (rlplatform.locks), which serialises all of this per group.
"""

from __future__ import annotations

import datetime
from collections import defaultdict

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from jobs.models import Allocation
from rlplatform import locks
from rlplatform.models import Quota


def unaccrued_seconds(accounted_until: datetime.datetime, now: datetime.datetime) -> float:
    return max(0.0, (now - accounted_until).total_seconds())


def _accrue(allocations, now: datetime.datetime, *, release: bool) -> dict[int, float]:
    """Add the unaccrued time of ``allocations`` (a queryset of active rows) to their quotas."""
    rows = list(allocations.values_list("pk", "run__experiment__quota_id", "accounted_until"))
    per_quota: dict[int, float] = defaultdict(float)
    for _pk, quota_id, accounted_until in rows:
        per_quota[quota_id] += unaccrued_seconds(accounted_until, now)
    for quota_id, seconds in per_quota.items():
        if seconds > 0:
            Quota.objects.filter(pk=quota_id).update(device_seconds_used=F("device_seconds_used") + seconds)
    fields = {"accounted_until": now}
    if release:
        fields["released_at"] = now
    Allocation.objects.filter(pk__in=[r[0] for r in rows]).update(**fields)
    return dict(per_quota)


def release_run(run_id: int, now: datetime.datetime) -> dict[int, float]:
    """Release a run's devices and accrue their last stretch. Caller holds the group lock."""
    return _accrue(Allocation.objects.active().filter(run_id=run_id), now, release=True)


def accrue_group(group_id: int, now: datetime.datetime | None = None) -> dict[int, float]:
    """The periodic tick for one group: accrue every active allocation up to now."""
    with transaction.atomic():
        locks.lock_group(group_id)
        locks.lock_group_quotas(group_id)
        now = now or timezone.now()
        return _accrue(Allocation.objects.active().filter(device__host__group_id=group_id), now, release=False)
