"""The Cluster page's device rows: each device's utilisation and memory as its host agent last read them
(``Device.usage``, stored by ``rlplatform.hosts.heartbeat``) and its holder, the run whose active allocation
holds it (a run the viewer may not see is named by number only). ``live_rows`` is the same for one group as
the live page gets it (jobs.consumers: ``ws/runs/?follow=devices``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db.models import QuerySet
from django.utils import dateformat, timezone
from django.utils.dateparse import parse_datetime

from jobs.models import Allocation, Run
from rlplatform.models import Device, Host


def rows_by_host(hosts: Iterable[Host], visible_runs: QuerySet[Run]) -> dict[int, list[dict[str, Any]]]:
    """``{host id: [{index, kind, model, healthy, util_pct, mem_used_mb, memory_mb, at, holder, holder_visible}]}``."""
    host_ids = [h.pk for h in hosts]
    devices = list(Device.objects.filter(host_id__in=host_ids).order_by("host_id", "index"))
    held = dict(
        Allocation.objects.active().filter(device__in=devices).values_list("device_id", "run_id")
    )  # at most one active row per device
    seen = set(visible_runs.filter(pk__in=set(held.values())).values_list("pk", flat=True))
    out: dict[int, list[dict[str, Any]]] = {}
    for d in devices:
        usage = d.usage or {}
        holder = held.get(d.pk)
        out.setdefault(d.host_id, []).append(
            {
                "index": d.index,
                "kind": d.kind,
                "model": d.model,
                "healthy": d.healthy,
                "util_pct": usage.get("util_pct"),
                "mem_used_mb": usage.get("mem_used_mb"),
                "memory_mb": d.memory_mb,
                "at": parse_datetime(usage["at"]) if isinstance(usage.get("at"), str) else None,
                "holder": holder,
                "holder_visible": holder in seen,
            }
        )
    return out


def live_rows(group_id: int, visible_runs: QuerySet[Run]) -> list[dict[str, Any]]:
    """The group's device rows as JSON for the live Cluster page: each as ``rows_by_host`` gives it, with
    ``key`` ("host:index", the page's ``data-device``), ``host`` and ``at`` as the page shows it (text)."""
    hosts = list(Host.objects.filter(group_id=group_id).order_by("name"))
    rows = rows_by_host(hosts, visible_runs)
    out = []
    for host in hosts:
        for row in rows.get(host.pk, []):
            at = row["at"]
            if at is not None and timezone.is_aware(at):
                at = timezone.localtime(at)  # as the template's date filter shows it
            text = dateformat.format(at, "Y-m-d H:i:s") if at is not None else None
            out.append({**row, "key": f"{host.name}:{row['index']}", "host": host.name, "at": text})
    return out
