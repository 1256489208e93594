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

A run that only moved in its queue (still QUEUED; its position or the reason it
waits changed because a run ahead left or was admitted) gets no entry of its
own: one cancel at the head of a 1,000-run queue would otherwise write 1,000
entries under the group lock. Positions are derived when read (jobs.queue_order)
and reasons are in the table; the runs lists hear "the queue of group G moved"
as one ``runs.queue`` message per team and read them again (jobs.consumers).
A run's terminal state also goes to ``run.<id>.end``, which long-polls
(jobs.longpoll) wait on.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import connection, transaction

from jobs import queue_order
from jobs.models import Experiment, Run, RunStreamEntry, StreamType
from jobs.states import TERMINAL_STATES, RunState
from rlplatform import live
from runtime import contract as M

__all__ = [
    "append",
    "append_many",
    "cluster_group",
    "group_usage",
    "run_end_group",
    "run_group",
    "run_summary",
    "send_run_alerts",
    "tell_changes",
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


def run_end_group(run_id: int) -> str:
    """Told once the run's terminal state has committed (what ``GET /api/runs/{id}/wait/`` waits for)."""
    return f"run.{run_id}.end"


def team_group(team_id: int) -> str:
    return f"team.{team_id}"


def cluster_group(group_id: int) -> str:
    return live.cluster_group(group_id)  # also told by heartbeats (rlplatform.live: the devices changed)


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

_SUMMARY_FIELDS = ("pk", "state", "reason", "experiment_id", "experiment__name", "experiment__team_id")


def tell_changes(group_id: int, changed: Iterable[int], queue_moved: bool) -> None:
    """Stream what an operation on a resource group changed, after it is written (same transaction).

    Each run in ``changed`` (its state changed: submitted, admitted, ended, requeued...) gets a ``state``
    entry and a ``runs.run`` message to its team; a run that ended, a ``run.ended`` message. When
    ``queue_moved`` (a run entered or left the queue, or a queued run's reason or place changed), every team
    with experiments in the group gets one ``runs.queue`` message naming the group, whatever the queue's
    length: its runs lists read positions and reasons again (jobs.consumers.RunsConsumer)."""
    rows = list(Run.objects.filter(pk__in=set(changed)).values(*_SUMMARY_FIELDS).order_by("pk"))
    queued = [row["pk"] for row in rows if row["state"] == RunState.QUEUED.value]
    places = queue_order.positions(group_id) if queued else {}
    terminal = set(_terminal())
    for row in rows:
        row["queue_position"] = places.get(row["pk"])
        append(row["pk"], StreamType.STATE, {k: row[k] for k in ("state", "reason", "queue_position")})
        summary, team_id = run_summary(row), row["experiment__team_id"]
        transaction.on_commit(lambda s=summary, t=team_id: _send(team_group(t), {"type": "runs.run", "data": s}))
        if row["state"] in terminal:
            message = {"type": "run.ended", "run": row["pk"], "state": row["state"]}
            transaction.on_commit(lambda r=row["pk"], m=message: _send(run_end_group(r), m))
    if queue_moved:
        teams = Experiment.objects.filter(group_id=group_id).values_list("team_id", flat=True).distinct()
        message = {"type": "runs.queue", "group": group_id}
        for team_id in sorted(teams):
            transaction.on_commit(lambda t=team_id: _send(team_group(t), message))
    if rows or queue_moved:
        transaction.on_commit(lambda: _send_usage(group_id))


def _terminal() -> list[str]:
    return [s.value for s in TERMINAL_STATES]


# What the runs tables (experiment, cluster) show of each run's newest metrics, kept live.
KEY_METRICS = (M.REWARD_MEAN, M.ACCURACY, M.STALENESS_MEAN)


def send_key_metrics(run_id: int, team_id: int, step: int, values: dict[str, Any]) -> None:
    """After commit, tell the runs lists of the run's team its newest key metrics (not kept in the table:
    a page opened later reads them from the metric points)."""
    metrics = {k: values[k] for k in KEY_METRICS if isinstance(values.get(k), int | float)}
    if metrics:
        data = {"id": run_id, "step": step, "metrics": metrics}
        transaction.on_commit(lambda: _send(team_group(team_id), {"type": "runs.metrics", "data": data}))


def send_run_alerts(team_id: int, data: dict[str, Any]) -> None:
    """Tell the runs lists of ``team_id`` a run's firing alert rules now (``data``: {id, name, experiment,
    rules}; rules [] once none fires). Called after commit (jobs.alerts.evaluate); a snapshot, the latest wins."""
    _send(team_group(team_id), {"type": "runs.alerts", "data": data})


def run_summary(row: dict[str, Any]) -> dict[str, Any]:
    """The runs-list message body of one run (``row``: values() with the summary fields, and its
    ``queue_position`` from jobs.queue_order)."""
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


async def channel_messages(layer, channel: str, what: str) -> AsyncIterator[dict[str, Any]]:
    """The messages of one channel-layer ``channel``, for ever. A layer outage is logged and retried each
    second: what is lost meanwhile, the reader repairs from the database (the stream table, a run's state)."""
    while True:
        try:
            message = await layer.receive(channel)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("%s could not receive; retrying in 1 s", what, exc_info=True)
            await asyncio.sleep(1.0)
            continue
        yield message
