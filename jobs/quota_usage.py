"""What each quota uses now: the one count behind admission's limits and the quotas page.

Devices are the quota's active allocations (what admission hands out and
releases), runs and rollout workers those of its runs that hold devices
(ADMITTED to PAUSED), and device time what accounting has accrued plus what
the active allocations have held since their last accrual.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass

from django.db.models import Count

from jobs import accounting
from jobs.models import Allocation, Run
from rlplatform.models import Quota


@dataclass
class QuotaUsage:
    devices: int = 0  # devices held by the quota's runs
    runs: int = 0  # runs holding devices
    rollout_workers: int = 0  # of those runs
    accrued_seconds: float = 0.0  # device time accounting has added to the quota
    unaccrued_seconds: float = 0.0  # device time held since each active allocation's last accrual
    queued: int = 0  # runs waiting for admission (counted when asked for)

    @property
    def device_hours(self) -> float:
        """Device time used, as the budget check counts it."""
        return (self.accrued_seconds + self.unaccrued_seconds) / 3600.0


def usage_by_quota(
    quotas: Iterable[Quota], now: datetime.datetime, *, count_queued: bool = False
) -> dict[int, QuotaUsage]:
    """Usage of each of ``quotas`` by quota id, at ``now``: a few queries whatever the number of quotas."""
    usage = {quota.pk: QuotaUsage(accrued_seconds=quota.device_seconds_used) for quota in quotas}
    ids = list(usage)
    active_runs = Run.objects.active().filter(experiment__quota_id__in=ids)
    for quota_id, workers in active_runs.values_list("experiment__quota_id", "rollout_workers"):
        usage[quota_id].runs += 1
        usage[quota_id].rollout_workers += workers
    allocations = Allocation.objects.active().filter(run__experiment__quota_id__in=ids)
    for quota_id, accounted_until in allocations.values_list("run__experiment__quota_id", "accounted_until"):
        usage[quota_id].devices += 1
        usage[quota_id].unaccrued_seconds += accounting.unaccrued_seconds(accounted_until, now)
    if count_queued:
        queued = Run.objects.queued().filter(experiment__quota_id__in=ids)
        # (order_by() drops Run's default ordering, which would split the groups)
        for row in queued.order_by().values("experiment__quota_id").annotate(n=Count("pk")):
            usage[row["experiment__quota_id"]].queued = row["n"]
    return usage
