"""Gang admission: which queued runs get devices now, and why the others wait.

One pass per resource group, under the group's row lock (then its quotas'),
so concurrent submits and releases are serialised and can never over-allocate
a device or exceed a quota. The partial unique constraint on active
allocations per device is the database's own backstop.

Order: jobs.queue_order's — effective priority descending (the run's own
priority capped at its quota's: a submitter may lower a run's priority, never
lift it above what the platform administrators granted the quota; else the
quota's), then submission time, then id. A run is admitted only when its quota (budget,
concurrent runs, devices, rollout workers) and the group's free healthy
devices on online hosts allow all of its devices at once; devices are chosen
by jobs.placement. Decisions are made in memory, then written in bulk under
the same locks: one conditional UPDATE moves the admitted runs from QUEUED,
one INSERT creates their allocations, and one UPDATE stores the reason of
every run left queued whose reason changed (the two UPDATEs are jobs.sql's
``mark_admitted`` and ``write_reasons``). Queue positions are not stored
(jobs.queue_order derives them when read), and the reason of a run held back
names no other run, so a cancel or an admission at the head of the queue
rewrites nothing for the runs behind it. A pass over a thousand queued runs
is a handful of queries, whether it admits none of them or all.

The pass returns what it changed (:class:`Pass`); its callers (jobs.handler,
jobs.tasks) request the admitted runs' launch (jobs.lifecycle.dispatch) and
tell the live UI (jobs.stream), so admission knows nothing of either.

Unless ``TANDEM_ADMISSION_BACKFILL`` is on, the first run that fits its quota
but finds too few free devices holds back every run after it in the group,
so small runs cannot starve a large gang.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from jobs import placement, queue_order, sql
from jobs.models import Allocation
from jobs.quota_usage import QuotaUsage, usage_by_quota
from rlplatform import locks
from rlplatform.models import Device, Host, HostStatus, Quota, ResourceGroup

WAITING_FOR_ADMISSION = "waiting for admission"


@dataclass(frozen=True)
class Pass:
    """What one admission pass changed."""

    admitted: list[int] = field(default_factory=list)  # run ids moved to ADMITTED, in admission order
    new_reasons: list[int] = field(default_factory=list)  # runs left QUEUED whose reason changed
    queued: int = 0  # runs of the group still QUEUED after the pass

    @property
    def moved_queue(self) -> bool:
        """Whether runs left the queue or a queued run's reason changed (the runs behind moved up)."""
        return bool(self.admitted or self.new_reasons)


def admit_group(group_id: int, now: datetime.datetime | None = None) -> Pass:
    """Run one admission pass over a group in its own transaction (the caller requests the launch of the
    runs it admitted)."""
    with transaction.atomic():
        group = locks.lock_group(group_id)
        quotas = locks.lock_group_quotas(group_id)
        # The clock is read under the lock, so allocation times follow the order the lock imposes.
        return admit_locked(group, quotas, now or timezone.now())


def _usage(quotas: dict[int, Quota], now: datetime.datetime) -> dict[int, QuotaUsage]:
    """Each quota's usage by quota id: jobs.quota_usage's count, the one the quotas page shows too."""
    return usage_by_quota(quotas.values(), now)


def _free_devices(group_id: int) -> tuple[dict[int, list[int]], dict[int, int], dict[int, str | None], int]:
    """Free devices by host, each free device's host, each host's switch, and how many could ever be scheduled."""
    schedulable = Device.objects.filter(host__group_id=group_id, healthy=True, host__status=HostStatus.ONLINE)
    busy = Allocation.objects.active().values("device_id")
    free_by_host: dict[int, list[int]] = {}
    host_of: dict[int, int] = {}
    switch_of: dict[int, str | None] = {}
    rows = schedulable.exclude(pk__in=busy).order_by("host_id", "index").values_list("pk", "host_id", "host__labels")
    for device_id, host_id, labels in rows:
        free_by_host.setdefault(host_id, []).append(device_id)
        host_of[device_id] = host_id
        switch = (labels or {}).get("switch") if isinstance(labels, dict) else None
        switch_of[host_id] = str(switch) if switch not in (None, "") else None
    return free_by_host, host_of, switch_of, schedulable.count()


def _host_names(host_ids: list[int]) -> str:
    names = Host.objects.filter(pk__in=host_ids).order_by("name").values_list("name", flat=True)
    return ", ".join(names) or "excluded hosts"


def _quota_reason(quota: Quota, usage: QuotaUsage, need: int, workers: int) -> str | None:
    if quota.device_hour_budget is not None:
        used_h = (quota.device_seconds_used + usage.unaccrued_seconds) / 3600.0
        if used_h >= quota.device_hour_budget:
            return f"device-hour budget exhausted ({used_h:.1f}/{quota.device_hour_budget:.1f} h)"
    if usage.runs + 1 > quota.max_concurrent_runs:
        return f"quota: {usage.runs}/{quota.max_concurrent_runs} concurrent runs"
    if usage.devices + need > quota.max_devices:
        return f"quota: {usage.devices}/{quota.max_devices} devices in use, run needs {need}"
    if usage.rollout_workers + workers > quota.max_rollout_workers:
        return f"quota: {usage.rollout_workers}/{quota.max_rollout_workers} rollout workers in use, run needs {workers}"
    return None


def admit_locked(group: ResourceGroup, quotas: dict[int, Quota], now: datetime.datetime) -> Pass:
    """The admission pass proper. Caller holds the locks of ``group`` and ``quotas`` (all of the group's),
    and requests the admitted runs' launch."""
    queued = queue_order.queued_in_order(group.pk).values_list(
        "pk",
        "experiment__quota_id",
        "devices_requested",
        "rollout_workers",
        "reason",
        "excluded_hosts",
        "resolved_spec__resources",
    )
    rows = list(queued)
    if not rows:
        return Pass()
    usage = _usage(quotas, now)
    free_by_host, host_of, switch_of, schedulable = _free_devices(group.pk)
    free_count = sum(len(devices) for devices in free_by_host.values())
    backfill = settings.TANDEM_ADMISSION_BACKFILL

    # Admissions are decided in memory and written together after the loop: one conditional
    # UPDATE for the runs' states, one INSERT for their allocations (the group lock keeps
    # the decisions true until commit).
    chosen_for: dict[int, list[int]] = {}
    changed: list[tuple[int, str]] = []
    held_back = False
    for run_id, quota_id, need, workers, old_reason, excluded, resources in rows:
        # its trainer's ranks on one host, then one switch; its remote rollout roles anywhere
        shape = placement.shape_of(resources, need)
        quota = quotas.get(quota_id)
        if quota is None:
            reason = "the experiment's quota belongs to another resource group"
        else:
            reason = _quota_reason(quota, usage[quota_id], need, workers)
        if reason is None and need > schedulable:
            # Unhealthy devices or offline hosts: it cannot fit now, but must not block the queue.
            reason = f"needs {need} devices; group {group.name} has {schedulable} healthy devices on online hosts"
        elif reason is None and held_back and not backfill:
            # No run named: the runs behind keep their reason when the one holding them back leaves.
            reason = f"waiting behind an earlier run for free {group.kind} devices"
        elif reason is None:
            allowed = {h: d for h, d in free_by_host.items() if h not in excluded} if excluded else free_by_host
            chosen = placement.place_run(shape, allowed, switch_of)
            if chosen is None:
                reason = f"no free {group.kind} devices in group {group.name} (need {need}, free {free_count})"
                if excluded:
                    reason += f"; not on {_host_names(excluded)}, where it kept failing"
                if not excluded or placement.place_run(shape, free_by_host, switch_of) is None:
                    # (a run kept off a host only by its exclusion must not hold the queue behind it)
                    held_back = True
            else:
                placement.take(free_by_host, host_of, chosen)
                free_count -= need
                chosen_for[run_id] = chosen
                usage[quota_id].devices += need
                usage[quota_id].runs += 1
                usage[quota_id].rollout_workers += workers
                continue
        if reason != old_reason:
            changed.append((run_id, reason))
    admitted = sql.mark_admitted(list(chosen_for), now) if chosen_for else []
    if admitted:
        Allocation.objects.bulk_create(
            Allocation(run_id=run_id, device_id=device_id, created_at=now, accounted_until=now)
            for run_id in admitted
            for device_id in chosen_for[run_id]
        )
    if changed:
        sql.write_reasons(changed)
    return Pass(admitted=admitted, new_reasons=[run_id for run_id, _ in changed], queued=len(rows) - len(admitted))
