"""What PostgreSQL holds, read when Prometheus scrapes: a custom collector of a few aggregate queries.

Read at scrape time, these figures are the database's own: the same in whichever process answers, for
events made on any machine (host agents included), and never drifting from the rows they count.

    tandem_queue_depth{group}                           queued runs
    tandem_queue_oldest_wait_seconds{group}             since the oldest queued run's submission (0: none)
    tandem_runs{group,state}                            runs in each state (jobs.states.RunState)
    tandem_devices{group,device_kind,device_model,status}   allocated / free / unavailable (unhealthy
                                                        or on a host not online; admission's rule)
    tandem_admissions_total{group}                      admissions: one per run per admission, from the
                                                        Allocation rows it writes (kept as history)
    tandem_preemptions_total{group}                     preempt commands (jobs.preemption)
    tandem_role_restarts_total{group,role_kind}         ``role_restarted`` platform events
    tandem_role_failures_total{group,role_kind,cause}   ``role_failed`` platform events
                                                        (jobs.lifecycle.decide.failure_cause)
    tandem_hosts{group,status}                          hosts by status
    tandem_host_heartbeat_age_seconds{group,host}       since its last heartbeat (+Inf: never)

Counts derived from rows go down if rows are deleted (a run deleted in the admin takes its events and
allocations along): Prometheus' rate() reads such a drop as a counter reset.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator

from django.db import connection
from django.db.models import Count, Min
from django.db.models.fields.json import KeyTextTransform
from django.utils import timezone
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from jobs.lifecycle.events import PLATFORM_ROLE
from jobs.lifecycle.names import role_kind
from jobs.models import Allocation, Command, CommandKind, Experiment, Run, RunEvent
from jobs.states import RunState
from rlplatform.models import Device, Host, HostStatus, ResourceGroup

EVENT_RESTARTED = "role_restarted"  # jobs.lifecycle.apply._restart
EVENT_FAILED = "role_failed"  # jobs.lifecycle.apply._decide_and_apply


class PlatformStateCollector:
    """A prometheus_client collector (``collect`` only: registered without describe, it runs at scrape time)."""

    def collect(self) -> Iterator[Metric]:
        groups = dict(ResourceGroup.objects.values_list("pk", "name"))
        yield from _runs(groups)
        yield from _devices(groups)
        yield from _admissions_and_preemptions(groups)
        yield from _restarts_and_failures(groups)
        yield from _hosts(groups)


def _runs(groups: dict[int, str]) -> Iterator[Metric]:
    rows = Run.objects.values_list("experiment__group_id", "state").annotate(n=Count("pk"), oldest=Min("submitted_at"))
    counts: dict[tuple[int, str], int] = defaultdict(int)
    oldest: dict[int, float] = {}
    now = timezone.now()
    for group_id, state, n, first in rows.order_by():
        counts[group_id, state] = n
        if state == RunState.QUEUED:
            oldest[group_id] = (now - first).total_seconds()
    depth = GaugeMetricFamily("tandem_queue_depth", "Queued runs in the resource group.", labels=["group"])
    wait = GaugeMetricFamily(
        "tandem_queue_oldest_wait_seconds",
        "Seconds since the oldest queued run of the group was submitted (0 when none waits).",
        labels=["group"],
    )
    by_state = GaugeMetricFamily("tandem_runs", "Runs of the resource group in each state.", labels=["group", "state"])
    for group_id, name in groups.items():
        depth.add_metric([name], counts[group_id, RunState.QUEUED.value])
        wait.add_metric([name], max(oldest.get(group_id, 0.0), 0.0))
        for state in RunState:
            by_state.add_metric([name, state.value], counts[group_id, state.value])
    yield from (depth, wait, by_state)


# One row per device (at most one active allocation each: allocation_one_active_per_device).
DEVICES_SQL = f"""
SELECT h.group_id, d.kind, d.model,
       SUM(CASE WHEN a.id IS NOT NULL THEN 1 ELSE 0 END),
       SUM(CASE WHEN a.id IS NULL AND d.healthy AND h.status = %s THEN 1 ELSE 0 END),
       COUNT(*)
FROM {Device._meta.db_table} d
JOIN {Host._meta.db_table} h ON h.id = d.host_id
LEFT JOIN {Allocation._meta.db_table} a ON a.device_id = d.id AND a.released_at IS NULL
GROUP BY h.group_id, d.kind, d.model
"""


def _devices(groups: dict[int, str]) -> Iterator[Metric]:
    family = GaugeMetricFamily(
        "tandem_devices",
        "Devices by group and device type: allocated to a run, free (healthy, host online, not allocated), "
        "or unavailable (unhealthy or on a host not online, not allocated).",
        labels=["group", "device_kind", "device_model", "status"],
    )
    with connection.cursor() as cursor:
        cursor.execute(DEVICES_SQL, [str(HostStatus.ONLINE)])
        rows = cursor.fetchall()
    for group_id, kind, model, allocated, free, total in rows:
        labels = [groups.get(group_id, str(group_id)), kind, model]
        family.add_metric([*labels, "allocated"], int(allocated))
        family.add_metric([*labels, "free"], int(free))
        family.add_metric([*labels, "unavailable"], int(total) - int(allocated) - int(free))
    yield family


# An admission writes all its allocations of a run at one instant (jobs.admission.admit_locked).
ADMISSIONS_SQL = f"""
SELECT e.group_id, COUNT(*)
FROM (SELECT DISTINCT run_id, created_at FROM {Allocation._meta.db_table}) a
JOIN {Run._meta.db_table} r ON r.id = a.run_id
JOIN {Experiment._meta.db_table} e ON e.id = r.experiment_id
GROUP BY e.group_id
"""


def _admissions_and_preemptions(groups: dict[int, str]) -> Iterator[Metric]:
    with connection.cursor() as cursor:
        cursor.execute(ADMISSIONS_SQL)
        admitted = dict(cursor.fetchall())
    preempted = dict(
        Command.objects.filter(kind=CommandKind.PREEMPT)
        .values_list("run__experiment__group_id")
        .annotate(n=Count("pk"))
        .order_by()
    )
    admissions = CounterMetricFamily(
        "tandem_admissions", "Runs admitted (each admission of a run once).", labels=["group"]
    )
    preemptions = CounterMetricFamily(
        "tandem_preemptions", "Runs asked to yield their devices to a higher-priority run.", labels=["group"]
    )
    for group_id, name in groups.items():
        admissions.add_metric([name], admitted.get(group_id, 0))
        preemptions.add_metric([name], preempted.get(group_id, 0))
    yield from (admissions, preemptions)


def _restarts_and_failures(groups: dict[int, str]) -> Iterator[Metric]:
    rows = (
        RunEvent.objects.filter(role=PLATFORM_ROLE, attempt=0, kind__in=[EVENT_RESTARTED, EVENT_FAILED])
        .annotate(role_name=KeyTextTransform("role", "payload"), cause=KeyTextTransform("cause", "payload"))
        .values_list("run__experiment__group_id", "kind", "role_name", "cause")
        .annotate(n=Count("pk"))
        .order_by()
    )
    restarts: dict[tuple[str, str], int] = defaultdict(int)
    failures: dict[tuple[str, str, str], int] = defaultdict(int)
    for group_id, kind, role_name, cause, n in rows:
        group = groups.get(group_id, str(group_id))
        if kind == EVENT_RESTARTED:
            restarts[group, role_kind(role_name or "")] += n
        else:
            failures[group, role_kind(role_name or ""), cause or "unknown"] += n
    restart_family = CounterMetricFamily(
        "tandem_role_restarts", "Role processes restarted after a failure.", labels=["group", "role_kind"]
    )
    for labels, n in sorted(restarts.items()):
        restart_family.add_metric(list(labels), n)
    failure_family = CounterMetricFamily(
        "tandem_role_failures",
        "Role attempts that failed, by cause: exit_code (non-zero), bad_input (exit 2), vanished (no exit code), "
        "host_lost.",
        labels=["group", "role_kind", "cause"],
    )
    for labels3, n in sorted(failures.items()):
        failure_family.add_metric(list(labels3), n)
    yield from (restart_family, failure_family)


def _hosts(groups: dict[int, str]) -> Iterator[Metric]:
    now = timezone.now()
    by_status: dict[tuple[int, str], int] = defaultdict(int)
    age = GaugeMetricFamily(
        "tandem_host_heartbeat_age_seconds",
        "Seconds since the host agent's last heartbeat (+Inf: never heard from).",
        labels=["group", "host"],
    )
    for name, group_id, status, last in Host.objects.values_list("name", "group_id", "status", "last_heartbeat"):
        by_status[group_id, status] += 1
        seconds = (now - last).total_seconds() if last is not None else math.inf
        age.add_metric([groups.get(group_id, str(group_id)), name], max(seconds, 0.0))
    hosts = GaugeMetricFamily("tandem_hosts", "Hosts of the group in each status.", labels=["group", "status"])
    for group_id, name in groups.items():
        for status in HostStatus.values:
            hosts.add_metric([name, status], by_status[group_id, status])
    yield from (hosts, age)
