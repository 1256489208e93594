"""The jobs app's PostgreSQL fast paths, each beside its portable twin.

Every fast path is a pair with one signature: ``<what>_pg`` (hand-written SQL, PostgreSQL only) and
``<what>_portable`` (the ORM, any database: SQLite runs the one-machine demo), plus ``<what>(...)``, which
picks by the connection's vendor. Both give the same result and store the same rows:
tests/platform/test_sql_pairs.py runs every pair on the same data against PostgreSQL, and fails on a
``_pg`` function it does not list.

Each fast path's reason is told beside it. The chart-data store (jobs.series_store) has no portable twin (it
exists on PostgreSQL only; elsewhere the JSON rows are read) and keeps its own SQL.
"""

from __future__ import annotations

import datetime
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import psycopg
from django.db import connection, transaction
from django.db.models import FloatField
from django.db.models.fields.json import KT
from django.db.models.functions import Cast

from jobs.models import MetricPoint, Run
from jobs.states import RunState

Points = dict[int, tuple[float, dict[str, Any]]]  # step -> (Unix time, metrics), as jobs.ingest.handler parses them


def on_postgresql() -> bool:
    return connection.vendor == "postgresql"


def binary_cursor() -> psycopg.Cursor:
    """A server-binding cursor on Django's connection (same transaction): binary results and bytea parameters
    without hex text, which Django's client-side cursors cannot do (hex doubles the bytes and costs a decode)."""
    connection.ensure_connection()
    return psycopg.Cursor(connection.connection)


# --- admission (jobs.admission): the writes of a pass -----------------------------------------------------


def mark_admitted(run_ids: list[int], now: datetime.datetime) -> list[int]:
    """Move the runs from QUEUED to ADMITTED; return those that moved, in the order given.

    A run that is no longer QUEUED (moved by someone not holding the group lock) keeps its state.
    """
    return mark_admitted_pg(run_ids, now) if on_postgresql() else mark_admitted_portable(run_ids, now)


def mark_admitted_pg(run_ids: list[int], now: datetime.datetime) -> list[int]:
    """One conditional UPDATE for all the runs."""
    with connection.cursor() as cursor:
        cursor.execute(
            f'UPDATE "{Run._meta.db_table}" SET "state" = %s, "reason" = \'\', '
            '"admitted_at" = %s, "updated_at" = %s WHERE "id" = ANY(%s::bigint[]) AND "state" = %s RETURNING "id"',
            [RunState.ADMITTED.value, now, now, run_ids, RunState.QUEUED.value],
        )
        moved = {row[0] for row in cursor.fetchall()}
    return [run_id for run_id in run_ids if run_id in moved]


def mark_admitted_portable(run_ids: list[int], now: datetime.datetime) -> list[int]:
    """One conditional UPDATE per run (SQLite, the single-machine demo: small queues)."""
    return [
        run_id
        for run_id in run_ids
        if Run.objects.filter(pk=run_id, state=RunState.QUEUED).update(
            state=RunState.ADMITTED, reason="", admitted_at=now, updated_at=now
        )
    ]


def write_reasons(changed: list[tuple[int, str]]) -> None:
    """Store (run id, reason) rows: the queued runs whose reason an admission pass changed."""
    if on_postgresql():
        write_reasons_pg(changed)
    else:
        write_reasons_portable(changed)


def write_reasons_pg(changed: list[tuple[int, str]]) -> None:
    """An ``UPDATE ... FROM (VALUES ...)`` per 2,000 rows: Django's bulk_update builds a CASE expression per
    row, which costs more Python time than the whole rest of a 1,000-run admission pass."""
    table = Run._meta.db_table
    for start in range(0, len(changed), 2000):
        chunk = changed[start : start + 2000]
        values = ", ".join(["(%s::bigint, %s::text)"] * len(chunk))
        params = [item for row in chunk for item in row]
        with connection.cursor() as cursor:
            cursor.execute(
                f'UPDATE "{table}" AS r SET "reason" = v.reason FROM (VALUES {values}) AS v(id, reason) '
                "WHERE r.id = v.id",
                params,
            )


def write_reasons_portable(changed: list[tuple[int, str]]) -> None:
    runs = [Run(pk=pk, reason=reason) for pk, reason in changed]
    Run.objects.bulk_update(runs, ["reason"], batch_size=500)


# --- ingest (jobs.ingest.handler): a batch's metric points --------------------------------------------------


def upsert_metric_points(run_id: int, attempt: int, points: Points) -> list[tuple]:
    """Store a batch's points idempotently: a new step is inserted; a step the attempt already has (live) gets
    only the keys it lacks (the first value of a key wins). Rows are written in step order (one lock order
    for concurrent batches of a run: no deadlocks between them).

    Returns the rows written, ``(id, step, time as Unix seconds, inserted, metrics after the merge or None for
    an inserted row)``; a step that already held every key is not written and not returned. The merged
    metrics come as a dict or as JSON text (PostgreSQL's jsonb through Django's cursor).
    """
    if on_postgresql():
        return upsert_metric_points_pg(run_id, attempt, points)
    return upsert_metric_points_portable(run_id, attempt, points)


# One statement per batch. The points travel as one JSON array parameter, unpacked by PostgreSQL in C
# (per-element array parameters cost more in the driver than the insert itself). Conflict target: the
# partial unique index of live rows (rewound rows never conflict). The merge keeps existing values
# (right side of || wins) and skips rows that already hold every key, so a pure replay writes no new
# row versions. RETURNING tells inserted rows (xmax = 0) from merged ones.
_UPSERT_POINTS = """
INSERT INTO jobs_metricpoint (run_id, attempt, step, time, metrics, rewound)
SELECT %s, %s, (p->>'step')::bigint, to_timestamp((p->>'time')::float8), p->'metrics', false
FROM jsonb_array_elements(%s::jsonb) AS p
ON CONFLICT (run_id, attempt, step) WHERE NOT rewound
DO UPDATE SET metrics = EXCLUDED.metrics || jobs_metricpoint.metrics
WHERE NOT (jobs_metricpoint.metrics ?& ARRAY(SELECT jsonb_object_keys(EXCLUDED.metrics)))
RETURNING id, step, extract(epoch from time)::float8, (xmax = 0), CASE WHEN xmax = 0 THEN NULL ELSE metrics END
"""


def upsert_metric_points_pg(run_id: int, attempt: int, points: Points) -> list[tuple]:
    if not points:
        return []
    body = json.dumps([{"step": s, "time": points[s][0], "metrics": points[s][1]} for s in sorted(points)])
    with connection.cursor() as cursor:
        cursor.execute(_UPSERT_POINTS, [run_id, attempt, body])
        return cursor.fetchall()


def upsert_metric_points_portable(run_id: int, attempt: int, points: Points) -> list[tuple]:
    """Read the live rows, then bulk insert and update."""
    steps = sorted(points)
    existing: dict[int, MetricPoint] = {}
    for start in range(0, len(steps), 500):  # keep under SQLite's bound-variable limit
        chunk = steps[start : start + 500]
        for row in MetricPoint.objects.filter(run_id=run_id, attempt=attempt, rewound=False, step__in=chunk):
            existing[row.step] = row
    new, changed = [], []
    for step in steps:
        when, metrics = points[step]
        row = existing.get(step)
        if row is None:
            time = datetime.datetime.fromtimestamp(when, tz=datetime.UTC)
            new.append(MetricPoint(run_id=run_id, attempt=attempt, step=step, time=time, metrics=metrics))
        elif not metrics.keys() <= row.metrics.keys():
            row.metrics = {**metrics, **row.metrics}
            changed.append(row)
    MetricPoint.objects.bulk_create(new, batch_size=500)
    MetricPoint.objects.bulk_update(changed, ["metrics"], batch_size=500)
    written = [(r.pk, r.step, r.time.timestamp(), True, None) for r in new]
    written += [(r.pk, r.step, r.time.timestamp(), False, r.metrics) for r in changed]
    return sorted(written, key=lambda r: r[1])


def rewind_metric_points(run_id: int, after_step: int, before_attempt: int | None) -> int:
    """Mark the run's live metric rows after ``after_step`` (of attempts before ``before_attempt`` when given)
    rewound; returns how many rows."""
    if on_postgresql():
        return rewind_metric_points_pg(run_id, after_step, before_attempt)
    return rewind_metric_points_portable(run_id, after_step, before_attempt)


def rewind_metric_points_pg(run_id: int, after_step: int, before_attempt: int | None) -> int:
    """Also logs the ids of the rows it marked in the chart-data store's rewind log (jobs.series_store), whether
    or not the run is in the store yet: a backfill running at the same time packs the flags as of its snapshot,
    and the log adds what it could not see. One transaction (the caller's, or its own)."""
    attempt_filter = "" if before_attempt is None else " AND attempt < %s"
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "UPDATE jobs_metricpoint SET rewound = true "
            f"WHERE run_id = %s AND step > %s AND NOT rewound{attempt_filter} RETURNING id",
            [run_id, after_step, *([] if before_attempt is None else [before_attempt])],
        )
        ids = np.array([row[0] for row in cursor.fetchall()], dtype="<i8")
        if len(ids):
            with binary_cursor() as binary:
                binary.execute("INSERT INTO jobs_seriesrewind (run_id, ids) VALUES (%s, %b)", [run_id, ids.tobytes()])
    return len(ids)


def rewind_metric_points_portable(run_id: int, after_step: int, before_attempt: int | None) -> int:
    rows = MetricPoint.objects.filter(run_id=run_id, step__gt=after_step).live()
    if before_attempt is not None:
        rows = rows.filter(attempt__lt=before_attempt)
    return rows.update(rewound=True)


# --- chart data (jobs.series): a run's metric rows as a table ----------------------------------------------


def metric_keys(run_id: int) -> list[str]:
    """Names of the metrics the run reported (sorted)."""
    return metric_keys_pg(run_id) if on_postgresql() else metric_keys_portable(run_id)


def metric_keys_pg(run_id: int) -> list[str]:
    """The keys are listed by PostgreSQL: no JSON object leaves the database."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT DISTINCT k FROM jobs_metricpoint, jsonb_object_keys(metrics) AS k WHERE run_id = %s ORDER BY k",
            [run_id],
        )
        return [row[0] for row in cursor.fetchall()]


def metric_keys_portable(run_id: int) -> list[str]:
    names: set[str] = set()
    for metrics in MetricPoint.objects.filter(run_id=run_id).values_list("metrics", flat=True):
        names.update(metrics)
    return sorted(names)


def metric_table(run_id: int, keys: list[str], include_rewound: bool, x: str) -> np.ndarray:
    """Rows ``[step, time, rewound, value per key]`` of the run's JSON rows as a float64 array, sorted by
    (step, attempt, id); NaN for a null or absent value; rewound rows only when ``include_rewound``. The time
    column (Unix seconds) is filled when ``x`` is "time" (the PostgreSQL reader leaves it 0 otherwise)."""
    if on_postgresql():
        return metric_table_pg(run_id, keys, include_rewound, x)
    return metric_table_portable(run_id, keys, include_rewound, x)


# Runs with at least this many steps are read in two halves by step over two database connections at
# once: extracting the keys from the JSON rows is PostgreSQL CPU, and two backends use both cores.
PARALLEL_MIN_STEPS = 20_000
# One read returns its rows as a single bytea value; bigger reads are split by step (bytea stops at 1 GB).
MAX_READ_BYTES = 64 * 2**20
_readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="series-reader")


def metric_table_pg(run_id: int, keys: list[str], include_rewound: bool, x: str) -> np.ndarray:
    """Only the asked keys leave the database (a 30-metric JSON row is never parsed in Python). A long run
    is read in step ranges on two connections at once — but not inside a transaction, whose
    uncommitted rows another connection could not see."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT min(step), max(step) FROM jobs_metricpoint WHERE run_id = %s", [run_id])
        low, high = cursor.fetchone()
    if low is None:
        return np.empty((0, 3 + len(keys)))
    steps = high - low + 1
    columns = 5 + len(keys)
    parts = max(1 if steps < PARALLEL_MIN_STEPS else 2, -(-steps * columns * 8 // MAX_READ_BYTES))
    edges = [low + steps * i // parts for i in range(parts + 1)]
    ranges = [(a, b) for a, b in zip(edges, edges[1:], strict=False) if b > a]
    args = (run_id, keys, include_rewound, x)
    if len(ranges) == 1 or connection.in_atomic_block:
        tables = [_read_rows(*args, a, b) for a, b in ranges]
    else:
        tables = list(_readers.map(lambda r: _in_own_connection(*args, *r), ranges))
    table = np.concatenate(tables)
    table = table[np.lexsort((table[:, 4], table[:, 3], table[:, 0]))]  # by step, attempt, id
    return np.delete(table, [3, 4], axis=1)


def _in_own_connection(*args) -> np.ndarray:
    try:
        return _read_rows(*args)
    finally:
        connection.close()  # this thread's connection: back to the pool (or closed) between calls


def _read_rows(run_id: int, keys: list[str], include_rewound: bool, x: str, low: int, high: int) -> np.ndarray:
    """Rows ``[step, time, rewound, attempt, id, value per key]`` with ``low <= step < high``, unsorted.

    PostgreSQL packs each row into 8-byte floats (NULL as NaN) and all rows into one bytea that numpy
    reads as it is: receiving a COPY message or a result tuple per row cost more Python time than the
    query took in the database.
    """
    value = "COALESCE((metrics->>%s)::float8, 'NaN')"
    columns = [
        "step::float8",
        "extract(epoch from time)::float8" if x == "time" else None,
        "rewound::int::float8" if include_rewound else None,
        "attempt::float8",
        "id::float8",
        *[value] * len(keys),
    ]
    packed = " || ".join(f"float8send({c})" for c in columns if c is not None)
    where = "" if include_rewound else " AND NOT rewound"
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT string_agg({packed}, ''::bytea) FROM jobs_metricpoint "
            f"WHERE run_id = %s AND step >= %s AND step < %s{where}",
            [*keys, run_id, low, high],
        )
        data = cursor.fetchone()[0]
    present = [i for i, c in enumerate(columns) if c is not None]
    rows = np.frombuffer(data or b"", dtype=">f8").reshape(-1, len(present))
    table = np.zeros((len(rows), len(columns)))  # the columns not asked for stay 0
    table[:, present] = rows
    return table


def metric_table_portable(run_id: int, keys: list[str], include_rewound: bool, x: str) -> np.ndarray:
    qs = MetricPoint.objects.filter(run_id=run_id)
    if not include_rewound:
        qs = qs.live()
    names = {f"k{i}": Cast(KT(f"metrics__{key}"), FloatField()) for i, key in enumerate(keys)}
    rows = qs.annotate(**names).order_by("step", "attempt", "pk").values_list("step", "time", "rewound", *names)
    table = [(r[0], r[1].timestamp(), r[2], *r[3:]) for r in rows]
    return np.array(table, dtype=np.float64).reshape(len(table), 3 + len(keys))  # None becomes NaN
