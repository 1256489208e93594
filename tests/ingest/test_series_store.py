"""The chart-data store (jobs.series_store) answers exactly as the JSON rows do.

Every comparison reads the same run twice: from the store (``series(..., use_store=True)``, checked to really
come from the store) and from the JSON rows (``use_store=False``, the reference), over both x axes, several
``max_points`` and with and without rewound points. The runs are built through the ingest API with replays,
merged keys, nulls, -0.0, big integers, steps out of order, times out of order, rollbacks and resumed attempts,
with tiny blocks so that block boundaries fall everywhere.
"""

from __future__ import annotations

import datetime
import io
import json
import random
import threading

import numpy as np
import pytest
from django.core.management import call_command
from django.db import connection

from jobs import commands, series, series_store, sql
from jobs.models import MetricPoint, SeriesPointBlock, SeriesStore, SeriesValueBlock

from .helpers import batch, post

KEYS = ["reward", "loss", "eval/acc", "nullable"]
ASKED = [KEYS, ["eval/acc"], ["reward", "never-reported", "reward"]]
T0 = 1_700_000_000.0


@pytest.fixture(autouse=True)
def postgres_only():
    if connection.vendor != "postgresql":
        pytest.skip("the chart-data store is PostgreSQL-only; other databases read the JSON rows")


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(series_store, "BLOCK_POINTS", 8)


def _json(value) -> str:
    return json.dumps(value)  # tells -0.0 from 0.0, which == does not


def assert_store_matches_json_rows(run) -> None:
    """Every way of asking gives the same reply from the store as from the JSON rows."""
    assert series_store.read_table(run.pk, KEYS, True) is not None  # the run is really read from the store
    for keys in ASKED:
        for x in ("step", "time"):
            for max_points in (3, 7, 1000):
                for include_rewound in (False, True):
                    ask = {"x": x, "max_points": max_points, "include_rewound": include_rewound}
                    stored = series.series(run.pk, keys, **ask, use_store=True)
                    reference = series.series(run.pk, keys, **ask, use_store=False)
                    assert _json(stored) == _json(reference), ask | {"keys": keys}
    # The tables themselves, NaN for NaN (the replies above only show what downsampling kept).
    for include_rewound in (False, True):
        table = series_store.read_table(run.pk, KEYS, include_rewound)
        reference = sql.metric_table_pg(run.pk, KEYS, include_rewound, "time")
        columns = [0, 1, *range(3, 3 + len(KEYS))] + ([2] if include_rewound else [])
        np.testing.assert_array_equal(table[:, columns], reference[:, columns])


def test_batches_replays_and_merged_keys_match_the_json_rows(run, client_for, small_blocks):
    ingest = client_for(run)
    post(ingest, "metrics", batch(run, range(0, 20), lambda s: {"reward": s / 3, "loss": -s, "nullable": None}))
    post(ingest, "metrics", batch(run, range(0, 20), lambda s: {"reward": 99.0}))  # pure replay: first values stay
    # A retry that brings new keys to old steps (merged: new keys in, old values kept; null stays null).
    post(
        ingest,
        "metrics",
        batch(run, [3, 11, 19, 20, 21], lambda s: {"reward": -1.0, "eval/acc": s / 10, "nullable": 5.0}),
    )
    post(ingest, "metrics", batch(run, [25, 22, 23], lambda s: {"reward": -0.0, "loss": 2**62 + 1}))

    assert_store_matches_json_rows(run)
    reward = series.series(run.pk, ["reward", "eval/acc", "nullable"], max_points=1000)["series"]
    assert reward["reward"]["x"] == [*range(0, 22), 22, 23, 25]
    assert reward["reward"]["y"][3] == 1.0 and reward["reward"]["y"][20] == -1.0  # first value of step 3 kept
    assert _json(reward["reward"]["y"][-1]) == "0.0"  # as PostgreSQL's numeric gives it back
    assert reward["eval/acc"]["x"] == [3, 11, 19, 20, 21]
    assert reward["nullable"]["x"] == [20, 21]  # steps 3, 11, 19 had null first: it won
    counts = SeriesPointBlock.objects.filter(run=run).order_by("block").values_list("count", flat=True)
    assert list(counts) == [8, 8, 8, 1]  # 25 rows, blocks of 8


def test_rollbacks_and_resumed_attempts_are_followed(run, client_for, small_blocks):
    post(client_for(run), "metrics", batch(run, range(30), lambda s: {"reward": float(s % 5), "loss": s * 0.25}))
    commands.mark_rewound(run.pk, 17)  # a rollback to step 17: 18..29 rewound
    post(client_for(run), "metrics", batch(run, range(18, 26), lambda s: {"reward": 10.0 + s}))
    # Attempt 1 resumes from step 21: attempt 0's live rows after 21 are rewound; 18..21 stay live.
    resume = {"seq": 1, "kind": "resume", "payload": {"step": 21}}
    post(client_for(run, 1), "metrics", batch(run, range(22, 40), lambda s: {"reward": -s}, attempt=1, events=[resume]))

    assert_store_matches_json_rows(run)
    live = series.series(run.pk, ["reward"], max_points=1000)["series"]["reward"]
    assert live["x"] == list(range(40))
    assert live["y"][18:23] == [28.0, 29.0, 30.0, 31.0, -22.0]
    everything = series.series(run.pk, ["reward"], max_points=1000, include_rewound=True)["series"]["reward"]
    assert sum(everything["rewound"]) == 12 + 4  # 18..29 by the rollback, 22..25 of attempt 0 by the resume


@pytest.mark.parametrize("seed", range(8))
def test_random_histories_match_the_json_rows(run, client_for, small_blocks, seed):
    """Random sequences of batches (gaps, steps and times out of order, repeated steps in one batch),
    replays with changed values and new keys, rollbacks and resumed attempts."""
    rng = random.Random(seed)
    pool = [0.0, -0.0, 1.0, 1.0, -2.5, 7, 2**53 + 1, -(2**63), 1e-300, 0.1, None, None]
    attempt, step, sent, seq = 0, 0, [], 0
    for _ in range(14):
        op = rng.choice(["batch", "batch", "batch", "replay", "rollback", "resume"])
        if op == "replay" and not sent:
            op = "batch"
        if op == "batch":
            steps = [step + i + rng.choice([0, 0, 0, 3]) for i in range(rng.randint(1, 20))]
            if rng.random() < 0.3:
                steps = [rng.randrange(0, step + 1) for _ in range(3)] + steps  # old steps: replays, merges
            body = batch(
                run,
                steps,
                lambda s: {k: rng.choice(pool) for k in KEYS if rng.random() < 0.7},
                attempt=attempt,
            )
            for point in body["points"]:
                point["time"] = T0 + point["step"] + rng.choice([0.0, 0.123456789, -5.5])  # not always in order
            rng.shuffle(body["points"])
            step = max(steps) + 1
        elif op == "replay":
            old_attempt, body = rng.choice(sent)
            body = json.loads(json.dumps(body))
            for point in body["points"]:
                point["metrics"] = {k: rng.choice(pool) for k in KEYS}  # old keys kept, new keys merged in
            if old_attempt != attempt:
                continue  # a token writes to its own attempt; an old attempt's reporter is gone
        elif op == "rollback":
            commands.mark_rewound(run.pk, rng.randrange(0, step + 1))
            continue
        else:
            seq += 1
            attempt += 1
            resume_at = rng.randrange(0, step + 1)
            body = batch(
                run,
                [resume_at + 1],
                attempt=attempt,
                events=[{"seq": seq, "kind": "resume", "payload": {"step": resume_at}}],
            )
            step = resume_at + 2
        assert post(client_for(run, attempt), "metrics", body).status_code == 200
        sent.append((attempt, body))
    assert_store_matches_json_rows(run)
    assert len(series_store.read_table(run.pk, [], True)) == MetricPoint.objects.filter(run=run).count()


def test_runs_with_rows_from_before_the_store_stay_on_json_until_backfilled(run, client_for, small_blocks):
    # Given rows written without the store (as before the migration)
    MetricPoint.objects.bulk_create(
        MetricPoint(
            run=run,
            attempt=0,
            step=s,
            time=datetime.datetime.fromtimestamp(T0 + s, tz=datetime.UTC),
            metrics={"reward": s * 1.5, "nullable": None},
        )
        for s in range(20)
    )
    commands.mark_rewound(run.pk, 14)
    # When the run ingests more, it is still not in the store (its old rows are not there)
    post(client_for(run), "metrics", batch(run, range(15, 30), lambda s: {"reward": -s, "loss": 0.5}))
    assert not series_store.in_store(run.pk)
    assert series_store.read_table(run.pk, KEYS, False) is None
    assert SeriesPointBlock.objects.filter(run=run).count() == 0
    json_reply = series.series(run.pk, KEYS, max_points=7, include_rewound=True)

    # Then the backfill puts it in the store, with the same answers, and later writes follow it
    out = io.StringIO()
    call_command("backfill_series_store", "--run", str(run.pk), stdout=out)
    assert out.getvalue() == f"run {run.pk}: 35 metric rows packed\n1 run(s) backfilled\n"
    assert series_store.in_store(run.pk)
    assert series.series(run.pk, KEYS, max_points=7, include_rewound=True) == json_reply
    assert series_store.backfill(run.pk) is None  # a second backfill does nothing
    post(client_for(run), "metrics", batch(run, range(25, 40), lambda s: {"eval/acc": s / 100}))
    commands.mark_rewound(run.pk, 33)
    assert_store_matches_json_rows(run)


def test_a_new_run_enters_the_store_with_its_first_batch_and_a_bad_batch_writes_nothing(run, client_for):
    ingest = client_for(run)
    bad = batch(run, [1, 2], lambda s: {"reward": "high"})
    assert post(ingest, "metrics", bad).status_code == 400
    assert not SeriesStore.objects.filter(run=run).exists()
    assert SeriesValueBlock.objects.filter(run=run).count() == 0

    post(ingest, "metrics", batch(run, [1, 2], lambda s: {"reward": s * 2.0}))

    assert SeriesStore.objects.get(run=run).blocks == 1
    (values,) = SeriesValueBlock.objects.filter(run=run)
    assert (values.key, np.frombuffer(bytes(values.values), dtype="<f8").tolist()) == ("reward", [2.0, 4.0])


def test_an_empty_store_run_gives_empty_series(run, client_for):
    post(client_for(run), "metrics", batch(run, [], lambda s: {}))
    SeriesStore.objects.create(run=run)
    assert series.series(run.pk, ["reward"], x="time") == {
        "x": "time",
        "series": {"reward": {"x": [], "y": [], "rewound": []}},
        "last_step": None,
    }


@pytest.mark.django_db(transaction=True)
def test_concurrent_batches_of_a_new_run_all_enter_the_store(run):
    # Committed rows and one connection per thread: the first batches race to put the run in the store, the
    # later ones to append to the same last block (each must see the block as the previous writer left it).
    from jobs.ingest.handler import ingest_batch
    from jobs.ingest.tokens import authenticate_run_token, mint_run_token

    token = authenticate_run_token(mint_run_token(run, 0))
    start = threading.Barrier(3)
    failures = []

    def ingest(steps):
        try:
            start.wait(timeout=30)
            for part in (steps[:4], steps[4:12], steps[12:]):  # several lock hand-overs between the threads
                ingest_batch(token, batch(run, part, lambda s: {"reward": s * 0.5}), deliver_commands=False)
        except Exception as exc:  # reported below: an exception in a thread would otherwise vanish
            failures.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=ingest, args=(list(range(i, 60, 3)),)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert failures == []
    assert MetricPoint.objects.filter(run=run).count() == 60
    assert_store_matches_json_rows(run)
    reward = series.series(run.pk, ["reward"], max_points=1000)["series"]["reward"]
    assert (reward["x"], reward["y"]) == (list(range(60)), [s * 0.5 for s in range(60)])


@pytest.mark.django_db(transaction=True)
def test_a_rewind_does_not_wait_for_the_store_lock_an_ingest_holds(run, client_for):
    # A rollback's rewind runs in the command's transaction, which already holds the run's stream counter that
    # ingest takes after the store's lock: waiting for the store there could deadlock the two.
    from django.db import transaction

    from jobs.ingest.handler import store_points
    from jobs.ingest.tokens import authenticate_run_token, mint_run_token

    post(client_for(run), "metrics", batch(run, range(10), lambda s: {"reward": float(s)}))
    token = authenticate_run_token(mint_run_token(run, 0))
    holding, release = threading.Event(), threading.Event()

    def ingest_and_hold():
        try:
            with transaction.atomic():
                store_points(token, {10: (T0 + 10, {"reward": 10.0})})  # the store row now locked
                holding.set()
                release.wait(timeout=60)
        finally:
            connection.close()

    holder = threading.Thread(target=ingest_and_hold)
    holder.start()
    try:
        assert holding.wait(timeout=30)
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '5s'")  # waiting would fail here, not hang
            assert commands.mark_rewound(run.pk, 4) == 5
    finally:
        release.set()
        holder.join(timeout=60)
    assert_store_matches_json_rows(run)
    live = series.series(run.pk, ["reward"], max_points=1000)["series"]["reward"]
    assert (live["x"], live["y"]) == ([0, 1, 2, 3, 4, 10], [0.0, 1.0, 2.0, 3.0, 4.0, 10.0])
