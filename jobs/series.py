"""Chart data of a run: metric series read in one query and downsampled on the server.

Downsampling keeps what a chart must not lose: the points are cut into
``(max_points - 1) // 2`` buckets of consecutive points, each bucket keeps its
minimum and its maximum (in x order), and the last point is always kept — so a
spike survives, the newest value is exact, and the answer has at most
``max_points`` points. Points without a value for a key (null, or the key not
reported at that step) are skipped for that key only.

Rewound points (after a rollback) are left out unless asked for; when included
each point carries ``rewound: true`` so the chart can draw them apart.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from django.db import connection
from django.db.models import FloatField
from django.db.models.fields.json import KT
from django.db.models.functions import Cast

from jobs.models import MetricPoint

__all__ = ["MAX_KEYS", "MAX_POINTS_LIMIT", "downsample", "metric_keys", "series"]

MAX_KEYS = 64
MAX_POINTS_LIMIT = 20_000


def downsample(y: np.ndarray, max_points: int) -> np.ndarray:
    """Indices (ascending) of the points of ``y`` to keep: min and max of each bucket, plus the last point.

    ``y``: 1-D float array in x order without NaN. Returns all indices when ``len(y) <= max_points``.
    """
    n = len(y)
    if n <= max_points:
        return np.arange(n)
    buckets = max((max_points - 1) // 2, 1)
    body = n - 1  # the last point is kept on its own
    edges = np.linspace(0, body, buckets + 1).astype(np.int64)
    bucket_of = np.searchsorted(edges, np.arange(body), side="right") - 1
    # Sorted by (bucket, value): the first of each bucket is its minimum, the last its maximum.
    order = np.lexsort((y[:body], bucket_of))
    starts = edges[:-1]
    ends = edges[1:]
    nonempty = ends > starts
    mins = order[starts[nonempty]]
    maxs = order[ends[nonempty] - 1]
    keep = np.union1d(np.union1d(mins, maxs), [n - 1])
    return keep


def _table_postgres(run_id: int, keys: list[str], include_rewound: bool, x: str) -> np.ndarray:
    """Rows ``[step, time, rewound, value per key]`` as a float64 array, read with one binary COPY.

    Only the asked keys leave the database (a 30-metric JSON row is never parsed in Python), and
    every column is a float8 with NULL as NaN, so each row has the same size and numpy parses the
    whole COPY buffer at once instead of building a Python tuple per row.
    """
    columns = "".join(", COALESCE((metrics->>%s)::float8, 'NaN')" for _ in keys)
    when = "extract(epoch from time)::float8" if x == "time" else "0::float8"
    rewound = "rewound::int::float8" if include_rewound else "0::float8"
    where = "" if include_rewound else "AND NOT rewound"
    # COPY takes no bind parameters: quote the keys through the driver first.
    with connection.cursor() as cursor:
        # No ORDER BY: sorting 100k wide rows in the database spills to disk; numpy sorts the narrow result.
        select = cursor.mogrify(
            f"SELECT step::float8, {when}, {rewound}, attempt::float8, id::float8{columns} "
            f"FROM jobs_metricpoint WHERE run_id = %s {where}",
            [*keys, run_id],
        )
        data = bytearray()
        with cursor.cursor.copy(f"COPY ({select}) TO STDOUT (FORMAT BINARY)") as copy:
            for block in copy:
                data += block
    table = _parse_binary_copy(bytes(data), 5 + len(keys))
    table = table[np.lexsort((table[:, 4], table[:, 3], table[:, 0]))]  # by step, attempt, id
    return np.delete(table, [3, 4], axis=1)


# PostgreSQL binary COPY: 11-byte signature, int32 flags, int32 header-extension length; per row an
# int16 field count then (int32 length, bytes) per field; an int16 -1 trailer. Big-endian throughout.
_COPY_SIGNATURE = b"PGCOPY\n\xff\r\n\x00"


def _parse_binary_copy(data: bytes, fields: int) -> np.ndarray:
    if not data.startswith(_COPY_SIGNATURE):
        raise ValueError("not a PostgreSQL binary COPY stream")
    extension = int.from_bytes(data[15:19], "big")
    body = data[19 + extension : -2]  # drop the header and the -1 trailer
    row = np.dtype([("count", ">i2")] + [(f"f{i}", [("len", ">i4"), ("v", ">f8")]) for i in range(fields)])
    if len(body) % row.itemsize:
        raise ValueError("unexpected row size in binary COPY (a NULL column?)")
    records = np.frombuffer(body, dtype=row)
    table = np.empty((len(records), fields), dtype=np.float64)
    for i in range(fields):
        table[:, i] = records[f"f{i}"]["v"]
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
    run_id: int, keys: list[str], *, x: str = "step", max_points: int = 1000, include_rewound: bool = False
) -> dict[str, Any]:
    """``{"x": x, "series": {key: {"x": [...], "y": [...], "rewound": [...]}}, "last_step": n | None}``.

    ``x``: "step" or "time" (Unix seconds). Arguments are assumed valid (the view checks them).
    """
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
