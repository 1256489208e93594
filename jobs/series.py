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
it; other runs (points from before the store, SQLite) from the JSON rows (jobs.sql.metric_table), with the
same answers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jobs import series_store, sql

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
        table = sql.metric_table(run_id, keys, include_rewound, x)
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
    return sql.metric_keys(run_id)
