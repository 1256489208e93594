"""The per-run stream: every change a viewer of a run should see, numbered gap-free, then pushed live.

``append(run_id, type, data)`` stores a ``RunStreamEntry`` with the run's next
sequence number and, once the surrounding transaction commits, sends it through
the channel layer to the group ``run.<id>`` (jobs.consumers.RunConsumer).

Why the numbers have no gaps and commit in order: the number comes from an
upsert on the run's ``RunStreamCounter`` row, which stays locked until the
appending transaction ends; a rollback gives the number back, and a second
appender of the same run waits. Sending only after commit means a client that
receives seq n can always read 1..n from the table. Messages may still arrive
out of order (two processes commit 5 then 6, their sends race) or be lost (a
full channel): the consumer repairs both from the table.

Callers append at the end of their transaction, so the counter lock is held briefly.
The runs list (``ws/runs/``) gets ``run`` messages on the groups ``team.<id>``
and cluster usage on ``cluster.<group id>``; those carry no sequence number
(they are snapshots: the latest one wins).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import connection, transaction

from jobs.models import Run, RunStreamEntry, StreamType
from runtime import metrics as M

__all__ = [
    "append",
    "append_many",
    "append_state_changes",
    "cluster_group",
    "group_usage",
    "run_group",
    "run_summary",
    "state_snapshot",
    "team_group",
]

log = logging.getLogger(__name__)

# Upsert: the first append creates the counter row; every append locks it until commit.
_NEXT_SEQ = """
INSERT INTO jobs_runstreamcounter (run_id, last_seq) VALUES (%s, %s)
ON CONFLICT (run_id) DO UPDATE SET last_seq = jobs_runstreamcounter.last_seq + EXCLUDED.last_seq
RETURNING last_seq
"""


def run_group(run_id: int) -> str:
    return f"run.{run_id}"


def team_group(team_id: int) -> str:
    return f"team.{team_id}"


def cluster_group(group_id: int) -> str:
    return f"cluster.{group_id}"


def append(run_id: int, type: str, data: dict[str, Any]) -> int:
    """Append one entry; returns its seq. Sent to ``run.<id>`` after commit."""
    return append_many(run_id, [(type, data)])[-1]


def append_many(run_id: int, entries: Iterable[tuple[str, dict[str, Any]]]) -> list[int]:
    """Append several entries in order with consecutive seqs (one counter update); returns the seqs."""
    entries = list(entries)
    if not entries:
        return []
    for type_, _data in entries:
        if type_ not in StreamType.values:
            raise ValueError(f"unknown stream entry type {type_!r}")
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(_NEXT_SEQ, [run_id, len(entries)])
            last = cursor.fetchone()[0]
        first = last - len(entries) + 1
        rows = [
            RunStreamEntry(run_id=run_id, seq=first + i, type=type_, data=data)
            for i, (type_, data) in enumerate(entries)
        ]
        RunStreamEntry.objects.bulk_create(rows)
        # Encoded once here, not once per connected client: fan-out cost is then a copy, not a json.dumps.
        messages = [
            {"seq": row.seq, "text": json.dumps({"seq": row.seq, "type": row.type, "data": row.data})} for row in rows
        ]
        transaction.on_commit(lambda: _send(run_group(run_id), {"type": "stream.entries", "entries": messages}))
    return [row.seq for row in rows]


def _send(group: str, message: dict[str, Any]) -> None:
    """Best effort: the entries are committed, so a lost message is repaired from the table by the consumer."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(group, message)
    except Exception:  # a channel layer outage must not fail the write that already committed
        log.warning("could not send to channel group %s", group, exc_info=True)


# --- state changes and the runs list --------------------------------------------------------------------

_SNAPSHOT_FIELDS = ("pk", "state", "reason", "queue_position", "experiment_id", "experiment__team_id")


def state_snapshot(group_id: int) -> dict[int, tuple]:
    """(state, reason, queue_position) of every run of the resource group that is not terminal.

    Taken before an operation that may move several runs (a transition runs admission, which
    admits and re-orders others); ``append_state_changes`` then streams what changed.
    """
    rows = Run.objects.in_group(group_id).exclude(state__in=_terminal()).values_list(*_SNAPSHOT_FIELDS)
    return {row[0]: row[1:4] for row in rows}


def _terminal() -> list[str]:
    from jobs.states import TERMINAL_STATES

    return [s.value for s in TERMINAL_STATES]


def append_state_changes(group_id: int, before: dict[int, tuple], also: Iterable[int] = ()) -> list[int]:
    """Append a ``state`` entry for each run of the group whose state, reason or queue position differs
    from ``before`` (and for the runs in ``also``, e.g. one that just ended); tell the runs list and
    the cluster view. Returns the ids of the runs that changed."""
    ids = set(before) | set(also)
    rows = Run.objects.filter(pk__in=ids) | Run.objects.in_group(group_id).exclude(state__in=_terminal())
    changed = []
    for row in rows.values(*_SNAPSHOT_FIELDS, "experiment__name").order_by("pk"):
        now = (row["state"], row["reason"], row["queue_position"])
        if before.get(row["pk"]) == now:
            continue
        changed.append(row["pk"])
        append(row["pk"], StreamType.STATE, {"state": now[0], "reason": now[1], "queue_position": now[2]})
        summary = run_summary(row)
        transaction.on_commit(
            lambda s=summary, t=row["experiment__team_id"]: _send(team_group(t), {"type": "runs.run", "data": s})
        )
    if changed:
        transaction.on_commit(lambda: _send_usage(group_id))
    return changed


# What the runs tables (experiment, cluster) show of each run's newest metrics, kept live.
KEY_METRICS = (M.REWARD_MEAN, M.ACCURACY, M.STALENESS_MEAN)


def send_key_metrics(run_id: int, team_id: int, step: int, values: dict[str, Any]) -> None:
    """After commit, tell the runs lists of the run's team its newest key metrics (not kept in the table:
    a page opened later reads them from the metric points)."""
    metrics = {k: values[k] for k in KEY_METRICS if isinstance(values.get(k), int | float)}
    if metrics:
        data = {"id": run_id, "step": step, "metrics": metrics}
        transaction.on_commit(lambda: _send(team_group(team_id), {"type": "runs.metrics", "data": data}))


def run_summary(row: dict[str, Any]) -> dict[str, Any]:
    """The runs-list message body of one run (``row``: values() with the snapshot fields + experiment name)."""
    return {
        "id": row["pk"],
        "state": row["state"],
        "reason": row["reason"],
        "queue_position": row["queue_position"],
        "experiment": {"id": row["experiment_id"], "name": row["experiment__name"]},
    }


def group_usage(group_id: int) -> dict[str, Any]:
    """Device use of one resource group (what the cluster view shows next to the queue)."""
    from rlplatform.api import annotate_group_usage
    from rlplatform.models import ResourceGroup

    group = annotate_group_usage(ResourceGroup.objects.filter(pk=group_id)).first()
    if group is None:
        return {"id": group_id}
    queued = Run.objects.in_group(group_id).queued().count()
    return {
        "id": group.pk,
        "name": group.name,
        "devices_total": group.devices_total,
        "devices_healthy": group.devices_healthy,
        "devices_used": group.devices_used,
        "devices_free": group.devices_free_count,
        "queued_runs": queued,
    }


def _send_usage(group_id: int) -> None:
    _send(cluster_group(group_id), {"type": "runs.cluster", "data": group_usage(group_id)})
