"""Chart data of a run: metric series read from PostgreSQL as packed floats and downsampled on the server.

Downsampling keeps what a chart must not lose: the points are cut into
``(max_points - 1) // 2`` buckets of consecutive points, each bucket keeps its
minimum and its maximum (in x order), and the last point is always kept — so a
spike survives, the newest value is exact, and the answer has at most
``max_points`` points. Points without a value for a key (null, or the key not
reported at that step) are skipped for that key only.

Rewound points (after a rollback) are left out unless asked for; when included
each point carries ``rewound: true`` so the chart can draw them apart.

Runs in the chart-data store (jobs.series_store: packed per-metric blocks written at ingest) are read from
it; other runs (points from before the store, SQLite) from the JSON rows, with the same answers.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from django.db import connection
from django.db.models import FloatField
from django.db.models.fields.json import KT
from django.db.models.functions import Cast

from jobs import series_store
from jobs.models import MetricPoint

__all__ = ["MAX_KEYS", "MAX_POINTS_LIMIT", "downsample", "metric_keys", "series"]

MAX_KEYS = 64
MAX_POINTS_LIMIT = 20_000


def downsample(y: np.ndarray, max_points: int) -> np.ndarray:
    """Indices (ascending) of the points of ``y`` to keep: min and max of each bucket, plus the last point.

    ``y``: 1-D float array in x order without NaN. Returns all indices when ``len(y) <= max_points``.
    Within a bucket the first of equal minima and the last of equal maxima are kept. Linear time (no
    sort): per-bucket extremes by ``reduceat``, then the position of each.
    """
    n = len(y)
    if n <= max_points:
        return np.arange(n)
    buckets = max((max_points - 1) // 2, 1)
    body = n - 1  # the last point is kept on its own
    edges = np.unique(np.linspace(0, body, buckets + 1).astype(np.int64))
    starts, ends = edges[:-1], edges[1:]  # contiguous, non-empty buckets covering 0..body-1
    head = y[:body]
    bucket_of = np.repeat(np.arange(len(starts)), ends - starts)
    at_min = np.flatnonzero(head == np.minimum.reduceat(head, starts)[bucket_of])
    at_max = np.flatnonzero(head == np.maximum.reduceat(head, starts)[bucket_of])
    mins = at_min[np.searchsorted(at_min, starts)]  # first minimum at or after each bucket's start
    maxs = at_max[np.searchsorted(at_max, ends) - 1]  # last maximum before each bucket's end
    return np.union1d(np.union1d(mins, maxs), [n - 1])


# Runs with at least this many steps are read in two halves by step over two database connections at
# once: extracting the keys from the JSON rows is PostgreSQL CPU, and two backends use both cores.
PARALLEL_MIN_STEPS = 20_000
# One read returns its rows as a single bytea value; bigger reads are split by step (bytea stops at 1 GB).
MAX_READ_BYTES = 64 * 2**20
_readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="series-reader")


def _table_postgres(run_id: int, keys: list[str], include_rewound: bool, x: str) -> np.ndarray:
    """Rows ``[step, time, rewound, value per key]`` as a float64 array, sorted by (step, attempt, id).

    Only the asked keys leave the database (a 30-metric JSON row is never parsed in Python). A long run
    is read in step ranges on two connections at once — but not inside a transaction, whose
    uncommitted rows another connection could not see.
    """
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


def _table_portable(run_id: int, keys: list[str], include_rewound: bool, x: str) -> np.ndarray:
    qs = MetricPoint.objects.filter(run_id=run_id)
    if not include_rewound:
        qs = qs.live()
    names = {f"k{i}": Cast(KT(f"metrics__{key}"), FloatField()) for i, key in enumerate(keys)}
    rows = qs.annotate(**names).order_by("step", "attempt", "pk").values_list("step", "time", "rewound", *names)
    table = [(r[0], r[1].timestamp(), r[2], *r[3:]) for r in rows]
    return np.array(table, dtype=np.float64).reshape(len(table), 3 + len(keys))  # None becomes NaN


def series(
    run_id: int,
    keys: list[str],
    *,
    x: str = "step",
    max_points: int = 1000,
    include_rewound: bool = False,
    use_store: bool = True,
) -> dict[str, Any]:
    """``{"x": x, "series": {key: {"x": [...], "y": [...], "rewound": [...]}}, "last_step": n | None}``.

    ``x``: "step" or "time" (Unix seconds). Arguments are assumed valid (the view checks them). The rows come
    from the chart-data store (jobs.series_store) when the run is in it, else from the JSON rows;
    ``use_store=False`` reads the JSON rows regardless (the reference the store is compared with).
    """
    table = series_store.read_table(run_id, keys, include_rewound) if use_store else None
    if table is None:
        fetch = _table_postgres if connection.vendor == "postgresql" else _table_portable
        table = fetch(run_id, keys, include_rewound, x)
    out: dict[str, Any] = {"x": x, "series": {}, "last_step": None}
    if not len(table):
        for key in keys:
            out["series"][key] = {"x": [], "y": [], "rewound": []}
        return out
    out["last_step"] = int(table[:, 0].max())
    xs = table[:, 0] if x == "step" else table[:, 1]
    rewound = table[:, 2] > 0
    if x == "time":
        # Rows come in step order; wall time is almost always in the same order, but not guaranteed.
        order = np.argsort(xs, kind="stable")
        table, xs, rewound = table[order], xs[order], rewound[order]
    for i, key in enumerate(keys):
        y = table[:, 3 + i]
        present = ~np.isnan(y)
        kx, ky, kr = xs[present], y[present], rewound[present]
        keep = downsample(ky, max_points)
        kx_out = kx[keep].astype(np.int64).tolist() if x == "step" else kx[keep].tolist()
        out["series"][key] = {"x": kx_out, "y": ky[keep].tolist(), "rewound": kr[keep].tolist()}
    return out


def metric_keys(run_id: int) -> list[str]:
    """Names of the metrics the run reported (sorted)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT DISTINCT k FROM jobs_metricpoint, jsonb_object_keys(metrics) AS k WHERE run_id = %s ORDER BY k",
                [run_id],
            )
            return [row[0] for row in cursor.fetchall()]
    names: set[str] = set()
    for metrics in MetricPoint.objects.filter(run_id=run_id).values_list("metrics", flat=True):
        names.update(metrics)
    return sorted(names)
