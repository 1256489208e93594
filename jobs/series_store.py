"""The chart-data store: a run's metric points packed per block and per metric, written by ingest in the same
transaction as the JSON rows, so that a chart read copies packed floats instead of extracting keys from JSONB.

Layout (PostgreSQL only; elsewhere, and for runs not in the store, readers use the JSON rows):

- ``SeriesPointBlock``: up to ``BLOCK_POINTS`` MetricPoint rows of a run in arrival order — id, step, attempt,
  time, rewound (as of the backfill) — as packed records. New rows go to the run's last block; a full block starts the next one.
- ``SeriesValueBlock``: one metric's values aligned with a point block's entries (NaN: null or absent). A metric
  absent from a whole block has no row; a row shorter than its point block means "absent" for the rest.
- ``SeriesStore``: the run is in the store, which then holds every one of its MetricPoint rows. A run gets it
  with its first stored point, or from ``manage.py backfill_series_store``. Its row lock serialises the run's
  store writers (ingest batches), so appending to a block never loses an update.
- ``SeriesRewind``: ids of the rows each rewind marked; a reader flags those records rewound.

The store mirrors the rows exactly: an inserted row brings its values; a merged row (a replay adding keys, the
first value of a key wins) brings the values the row holds after the merge, as the upsert returns them; a
rewind logs the ids of the very rows its UPDATE marked. A reader rebuilds the table the JSON reader would give
(rows sorted by step, attempt, id) and downsamples it with the same code.
"""

from __future__ import annotations

import json
from operator import itemgetter
from typing import Any, NamedTuple

import numpy as np
from django.db import connection, transaction

from jobs import sql

__all__ = [
    "BLOCK_POINTS",
    "ROW",
    "Tail",
    "add_points",
    "backfill",
    "in_store",
    "lock_for_write",
    "read_table",
    "rewind",
]

# Entries per point block. Each ingest batch rewrites the run's last block (points and the batch's metrics):
# bigger blocks mean fewer rows per read but more bytes rewritten per small batch (about BLOCK_POINTS / 2 x
# (33 + 8 x metrics) bytes). 480: a 100,000-step run is 209 rows per metric, and a metric's block (3,840
# bytes) stays inside its table row, two rows to an 8 KB page (migration 0006).
BLOCK_POINTS = 480
# pg_advisory_xact_lock(namespace, run) guards a run's entry into the store (first batch, backfill).
_LOCK_NAMESPACE = 0x5E1E5


def _enabled() -> bool:
    """The store exists on PostgreSQL only."""
    return sql.on_postgresql()


def in_store(run_id: int) -> bool:
    if not _enabled():
        return False
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM jobs_seriesstore WHERE run_id = %s", [run_id])
        return cursor.fetchone() is not None


ROW = np.dtype([("id", "<i8"), ("step", "<i8"), ("attempt", "<i8"), ("time", "<f8"), ("rewound", "u1")])
_NAN = np.float64("nan").tobytes().hex()  # little-endian NaN, for padding in SQL


class Tail(NamedTuple):
    """Where the run's next points go: the number of point blocks, and the entries of the last one."""

    blocks: int
    last_count: int


def lock_for_write(run_id: int, *, start_with: list[int] | None = None) -> Tail | None:
    """The run's ``Tail``, its store row locked to the end of the transaction; None when the run is not in the
    store. ``start_with``: ids of the rows this transaction just wrote — the run enters the store when it has
    no other rows (its first batch).

    Ingest writes the JSON rows first, then takes this lock, then the run's stream counter (jobs.stream):
    one order; a pure replay locks nothing here at all. Rewinds take no store lock (``SeriesRewind``).
    """
    select = "SELECT blocks FROM jobs_seriesstore WHERE run_id = %s FOR UPDATE"
    with connection.cursor() as cursor:
        cursor.execute(select, [run_id])
        row = cursor.fetchone()
        if row is None:
            # Not in the store: wait for a concurrent first batch or backfill of the run, then look again.
            cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [_LOCK_NAMESPACE, run_id & 0x7FFFFFFF])
            cursor.execute(select, [run_id])
            row = cursor.fetchone()
        if row is None:
            if start_with is None:
                return None
            cursor.execute(
                "SELECT EXISTS (SELECT 1 FROM jobs_metricpoint WHERE run_id = %s AND NOT (id = ANY(%s)))",
                [run_id, start_with],
            )
            if cursor.fetchone()[0]:
                return None  # rows from before the store: read as JSON until backfilled
            cursor.execute("INSERT INTO jobs_seriesstore (run_id, blocks) VALUES (%s, 0)", [run_id])
            return Tail(0, 0)
        # A statement of its own, after the lock: a join in the locking statement would read the last block
        # as of that statement's start, before the previous lock holder's append committed.
        cursor.execute("SELECT count FROM jobs_seriespointblock WHERE run_id = %s AND block = %s", [run_id, row[0] - 1])
        last = cursor.fetchone()
        return Tail(row[0], last[0] if last else 0)


def _values(metrics: list[dict[str, Any]], keys: list[str]) -> np.ndarray:
    """``[row, key]`` values (NaN: null or absent). ``+ 0.0`` makes -0.0 the 0.0 that PostgreSQL's numeric
    gives back; Python ints convert with the same rounding as PostgreSQL's numeric-to-float8."""
    if len(keys) > 1 and all(m.keys() == metrics[0].keys() for m in metrics):
        rows = list(map(itemgetter(*keys), metrics))  # the usual batch: every row has the same metrics
    else:
        rows = [[m.get(k) for k in keys] for m in metrics]
    return np.array(rows, dtype=np.float64).reshape(len(metrics), len(keys)) + 0.0


def _chunks(tail: Tail, n: int) -> list[tuple[int, int, slice]]:
    """``(block, first position, rows)`` for ``n`` new rows: the last block's room first, then new blocks."""
    chunks, done, blocks = [], 0, tail.blocks
    if blocks and tail.last_count < BLOCK_POINTS:
        done = min(n, BLOCK_POINTS - tail.last_count)
        chunks.append((blocks - 1, tail.last_count, slice(0, done)))
    while done < n:
        chunks.append((blocks, 0, slice(done, min(n, done + BLOCK_POINTS))))
        blocks += 1
        done = chunks[-1][2].stop
    return chunks


_UPSERT_POINTS = (
    "INSERT INTO jobs_seriespointblock (run_id, block, count, min_step, max_step, rows) "
    "SELECT %s, u.* FROM unnest(%s::int[], %s::int[], %s::bigint[], %s::bigint[], %b::bytea[]) AS u "
    "ON CONFLICT (run_id, block) DO UPDATE SET "
)
_UPSERT_VALUES = (
    'INSERT INTO jobs_seriesvalueblock (run_id, block, key, "values") '
    "SELECT %s, u.b, u.k, {values} FROM unnest(%s::int[], %s::text[], %s::int[], %b::bytea[]) AS u(b, k, pad, v) "
    'ON CONFLICT (run_id, key, block) DO UPDATE SET "values" = '
)


def _append(cursor, run_id: int, tail: Tail, rows: np.ndarray, metrics: list[dict[str, Any]]) -> int:
    """Append new rows (``ROW`` records, ``metrics`` their JSON objects) in SQL: only the new bytes travel, and
    nothing is read first. Returns the number of point blocks after."""
    chunks = _chunks(tail, len(rows))
    cursor.execute(
        _UPSERT_POINTS + "count = jobs_seriespointblock.count + EXCLUDED.count, "
        "min_step = LEAST(jobs_seriespointblock.min_step, EXCLUDED.min_step), "
        "max_step = GREATEST(jobs_seriespointblock.max_step, EXCLUDED.max_step), "
        "rows = jobs_seriespointblock.rows || EXCLUDED.rows",
        [
            run_id,
            [b for b, _, _ in chunks],
            [len(rows[part]) for _, _, part in chunks],
            [int(rows["step"][part].min()) for _, _, part in chunks],
            [int(rows["step"][part].max()) for _, _, part in chunks],
            [rows[part].tobytes() for _, _, part in chunks],
        ],
    )
    cells = []  # (block, key, first position, values)
    for block, first, part in chunks:
        keys = sorted(set().union(*metrics[part]))
        table = _values(metrics[part], keys)  # per block: bounded memory however big the batch
        for j, key in enumerate(keys):
            column = table[:, j]
            if not np.isnan(column).all():  # all NaN reads the same as no row
                cells.append((block, key, first, column.tobytes()))
    if cells:
        # A new row is padded with NaN up to its first position; an existing one is never longer than that
        # position, so it keeps its bytes and takes the padding it lacks from the new row, then the values.
        cursor.execute(
            _UPSERT_VALUES.format(values=f"decode(repeat('{_NAN}', u.pad), 'hex') || u.v")
            + 'jobs_seriesvalueblock."values" || '
            'substring(EXCLUDED."values" FROM length(jobs_seriesvalueblock."values") + 1)',
            [run_id, *map(list, zip(*cells, strict=True))],
        )
    return max(tail.blocks, chunks[-1][0] + 1)


class _Writer:
    """Blocks of one run loaded, changed in memory, and written back whole (merges, backfill)."""

    def __init__(self, run_id: int, blocks: int):
        self.run_id = run_id
        self.blocks = blocks
        self.points: dict[int, np.ndarray] = {}
        self.values: dict[tuple[int, str], np.ndarray] = {}
        self.dirty_points: set[int] = set()
        self.dirty_values: set[tuple[int, str]] = set()

    def load(self, cursor, block_filter: str, params: list, keys: list[str]) -> None:
        """Point blocks matching ``block_filter`` and their value blocks of ``keys``."""
        cursor.execute(
            f"SELECT block, rows FROM jobs_seriespointblock WHERE run_id = %s AND ({block_filter})",
            [self.run_id, *params],
            binary=True,
        )
        for block, rows in cursor.fetchall():
            self.points[block] = np.frombuffer(rows, dtype=ROW).copy()
        if keys and self.points:
            cursor.execute(
                'SELECT block, key, "values" FROM jobs_seriesvalueblock '
                "WHERE run_id = %s AND block = ANY(%s) AND key = ANY(%s)",
                [self.run_id, list(self.points), keys],
                binary=True,
            )
            for block, key, data in cursor.fetchall():
                self.values[block, key] = np.frombuffer(data, dtype="<f8")

    def set(self, block: int, key: str, start: int, column: np.ndarray) -> None:
        old = self.values.get((block, key), np.empty(0))
        size = max(len(old), start + len(column))
        new = np.full(size, np.nan)
        new[: len(old)] = old
        new[start : start + len(column)] = column
        self.values[block, key] = new
        self.dirty_values.add((block, key))

    def append(self, rows: np.ndarray, metrics: list[dict[str, Any]]) -> None:
        """New rows (``ROW`` records in arrival order, ``metrics`` their JSON objects) after the loaded last block."""
        last = self.blocks - 1
        if last >= 0 and last not in self.points:
            raise RuntimeError(f"run {self.run_id}: point block {last} was not loaded before appending")
        for block, first, part in _chunks(Tail(self.blocks, len(self.points.get(last, ()))), len(rows)):
            self.points[block] = np.concatenate([self.points.get(block, np.empty(0, dtype=ROW)), rows[part]])
            self.dirty_points.add(block)
            self.blocks = max(self.blocks, block + 1)
            keys = sorted(set().union(*metrics[part]))
            table = _values(metrics[part], keys)  # per block: bounded memory however big the batch
            for j, key in enumerate(keys):
                column = table[:, j]
                if not np.isnan(column).all():  # all NaN reads the same as no row
                    self.set(block, key, first, column)

    def locate(self) -> dict[int, tuple[int, int]]:
        """Row id -> (block, position) over the loaded point blocks."""
        return {int(i): (b, p) for b, rows in self.points.items() for p, i in enumerate(rows["id"])}

    def write(self, cursor) -> None:
        if self.dirty_points:
            blocks = sorted(self.dirty_points)
            cursor.execute(
                _UPSERT_POINTS + "count = EXCLUDED.count, min_step = EXCLUDED.min_step, "
                "max_step = EXCLUDED.max_step, rows = EXCLUDED.rows",
                [
                    self.run_id,
                    blocks,
                    [len(self.points[b]) for b in blocks],
                    [int(self.points[b]["step"].min()) for b in blocks],
                    [int(self.points[b]["step"].max()) for b in blocks],
                    [self.points[b].tobytes() for b in blocks],
                ],
            )
        if self.dirty_values:
            cells = sorted(self.dirty_values)
            cursor.execute(
                _UPSERT_VALUES.format(values="u.v") + 'EXCLUDED."values"',
                [
                    self.run_id,
                    [b for b, _ in cells],
                    [k for _, k in cells],
                    [0] * len(cells),
                    [self.values[c].astype("<f8").tobytes() for c in cells],
                ],
            )


def _records(ids, steps, attempts, times, rewound) -> np.ndarray:
    rows = np.empty(len(ids), dtype=ROW)
    rows["id"], rows["step"], rows["attempt"], rows["time"], rows["rewound"] = ids, steps, attempts, times, rewound
    return rows


def add_points(
    run_id: int, attempt: int, returned: list[tuple], points: dict[int, tuple[float, dict[str, Any]]]
) -> None:
    """Follow an ingest upsert in its transaction: ``returned`` its rows ``(id, step, time, inserted, metrics
    after a merge)`` (none for a pure replay), ``points`` the batch (step -> (time, metrics))."""
    if not returned or not _enabled():
        return
    tail = lock_for_write(run_id, start_with=[r[0] for r in returned])
    if tail is None:
        return
    inserted = sorted((r for r in returned if r[3]), key=lambda r: (r[1], r[0]))
    merged = [r for r in returned if not r[3]]
    n = len(inserted)
    rows = _records([r[0] for r in inserted], [r[1] for r in inserted], attempt, [r[2] for r in inserted], 0)
    metrics = [points[r[1]][1] for r in inserted]
    with sql.binary_cursor() as cursor:
        if not merged:
            blocks = _append(cursor, run_id, tail, rows, metrics) if n else tail.blocks
        else:
            # A replay added keys to stored rows (rare): rewrite their blocks with the values the rows hold now.
            writer = _Writer(run_id, tail.blocks)
            steps = [r[1] for r in merged]
            batch_keys = sorted(set().union(*(m for _, m in points.values())))
            writer.load(
                cursor,
                "max_step >= %s AND min_step <= %s OR block = %s",
                [min(steps), max(steps), tail.blocks - 1],
                batch_keys,
            )
            where = writer.locate()
            for row_id, step, _time, _inserted, after in merged:
                after = json.loads(after) if isinstance(after, str) else after
                block, position = where[row_id]
                keys = list(points[step][1])
                for key, value in zip(keys, _values([after], keys)[0], strict=True):
                    writer.set(block, key, position, value[np.newaxis])
            if n:
                writer.append(rows, metrics)
            writer.write(cursor)
            blocks = writer.blocks
    if blocks != tail.blocks:
        with connection.cursor() as cursor:
            cursor.execute("UPDATE jobs_seriesstore SET blocks = %s WHERE run_id = %s", [blocks, run_id])


def rewind(run_id: int, after_step: int, *, before_attempt: int | None = None) -> int:
    """Mark the run's live metric rows after ``after_step`` (of attempts before ``before_attempt`` when given)
    rewound, in the JSON rows and, by their ids, in the store's rewind log; returns how many rows.

    The log row is written whether or not the run is in the store yet: a backfill running at the same time
    packs the flags as of its snapshot, and the log adds what it could not see. No store lock is taken.
    The statements are jobs.sql.rewind_metric_points (elsewhere than PostgreSQL: the JSON rows alone).
    """
    return sql.rewind_metric_points(run_id, after_step, before_attempt)


def backfill(run_id: int) -> int | None:
    """Put a run that has JSON rows from before the store into the store; returns the rows packed, or None
    when the run was in the store already. One transaction, serialised with the run's ingest."""
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [_LOCK_NAMESPACE, run_id & 0x7FFFFFFF])
            cursor.execute("SELECT 1 FROM jobs_seriesstore WHERE run_id = %s", [run_id])
            if cursor.fetchone() is not None:
                return None
            cursor.execute(
                "SELECT id, step, attempt, extract(epoch from time)::float8, rewound, metrics "
                "FROM jobs_metricpoint WHERE run_id = %s ORDER BY id",
                [run_id],
            )
            rows = cursor.fetchall()
        writer = _Writer(run_id, 0)
        if rows:
            columns = list(zip(*rows, strict=True))
            writer.append(_records(*columns[:5]), [json.loads(m) if isinstance(m, str) else m for m in columns[5]])
            with sql.binary_cursor() as cursor:
                writer.write(cursor)
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO jobs_seriesstore (run_id, blocks) VALUES (%s, %s)", [run_id, writer.blocks])
    return len(rows)


_READ = """
SELECT 0, block, NULL::text, rows FROM jobs_seriespointblock WHERE run_id = %s
UNION ALL
SELECT 1, block, key, "values" FROM jobs_seriesvalueblock WHERE run_id = %s AND key = ANY(%s)
UNION ALL
SELECT 2, blocks, NULL, NULL FROM jobs_seriesstore WHERE run_id = %s
UNION ALL
SELECT 3, 0, NULL, ids FROM jobs_seriesrewind WHERE run_id = %s
"""


def read_table(run_id: int, keys: list[str], include_rewound: bool) -> np.ndarray | None:
    """Rows ``[step, time, rewound, value per key]`` sorted by (step, attempt, id), as the JSON reader gives them
    (rewound rows only when asked for; NaN for null or absent); None when the run is not in the store.

    One statement, so one snapshot: blocks and values of a concurrent batch are seen together or not at all.
    """
    if not _enabled():
        return None
    with sql.binary_cursor() as cursor:
        cursor.execute(_READ, [run_id, run_id, keys, run_id, run_id], binary=True)
        rows = cursor.fetchall()
    if not any(r[0] == 2 for r in rows):
        return None
    point_rows = sorted((r for r in rows if r[0] == 0), key=lambda r: r[1])
    offsets, sizes, total = {}, {}, 0
    for _, block, _, data in point_rows:
        offsets[block], sizes[block] = total, len(data) // ROW.itemsize
        total += sizes[block]
    table = np.empty((total, 3 + len(keys)))
    if not total:
        return table
    records = np.frombuffer(b"".join(r[3] for r in point_rows), dtype=ROW)
    steps = records["step"].astype(np.float64)
    table[:, 0] = steps
    table[:, 1] = records["time"]
    rewinds = [np.frombuffer(r[3], dtype="<i8") for r in rows if r[0] == 3]
    table[:, 2] = (
        records["rewound"] | np.isin(records["id"], np.concatenate(rewinds)) if rewinds else records["rewound"]
    )
    column = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    filled = np.full((len(column), total), np.nan)  # one contiguous column per key, copied into the table once
    for _, block, key, data in (r for r in rows if r[0] == 1):
        if block in offsets:
            start = offsets[block]
            values = np.frombuffer(data, dtype="<f8")[: sizes[block]]
            filled[column[key], start : start + len(values)] = values
    table[:, 3:] = filled[[column[key] for key in keys]].T if len(column) < len(keys) else filled.T
    # Rows arrive in step order almost always; then there is nothing to sort. Otherwise sort as the JSON
    # reader does, on the same float64 keys (so huge steps tie the same way).
    if total > 1 and not (np.diff(steps) > 0).all():
        table = table[np.lexsort((records["id"].astype(np.float64), records["attempt"].astype(np.float64), steps))]
    if not include_rewound:
        live = table[:, 2] == 0
        if not live.all():
            table = table[live]
    return table
