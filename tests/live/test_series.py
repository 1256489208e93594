"""Chart data: downsampling keeps min/max per bucket and the last point; the metrics API and its errors."""

from __future__ import annotations

import datetime

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs import commands, series, sql
from jobs.models import MetricPoint
from jobs.series import downsample

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def test_short_series_is_returned_whole():
    assert downsample(np.array([3.0, 1.0, 2.0]), 10).tolist() == [0, 1, 2]


def test_each_bucket_keeps_its_min_and_max_and_the_last_point_is_kept():
    # 21 points, max 5 -> 2 buckets over points 0..19, plus point 20
    y = np.zeros(21)
    y[3], y[7] = 9.0, -4.0  # bucket 0 (0..9): max at 3, min at 7
    y[12], y[18] = -1.0, 5.0  # bucket 1 (10..19): min at 12, max at 18
    y[20] = 0.25
    assert downsample(y, 5).tolist() == [3, 7, 12, 18, 20]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=400),
    st.integers(3, 60),
)
def test_downsampling_properties(values, max_points):
    y = np.array(values)
    keep = downsample(y, max_points)
    assert len(keep) <= max_points
    assert keep.tolist() == sorted(set(keep.tolist()))  # ascending, no duplicates
    assert keep[-1] == len(y) - 1  # the newest point survives
    # the extremes of the whole series survive (a spike is never lost)
    assert y[keep].max() == y.max()
    assert y[keep].min() == y.min()


def _reference_downsample(y, max_points):
    """The rule spelled out with loops: equal buckets of the points before the last; in each, the first
    minimum and the last maximum; plus the last point."""
    n = len(y)
    if n <= max_points:
        return list(range(n))
    buckets = max((max_points - 1) // 2, 1)
    edges = [int(e) for e in np.linspace(0, n - 1, buckets + 1)]
    keep = {n - 1}
    for start, end in zip(edges, edges[1:], strict=False):
        if end > start:
            part = [float(v) for v in y[start:end]]
            keep.add(start + part.index(min(part)))
            keep.add(end - 1 - part[::-1].index(max(part)))
    return sorted(keep)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.sampled_from([-2.0, -1.0, 0.0, 1.0, 2.5]) | st.floats(-1e3, 1e3), min_size=1, max_size=300),
    st.integers(3, 40),
)
def test_downsampling_keeps_exactly_the_first_minimum_and_last_maximum_of_each_bucket(values, max_points):
    # Few distinct values, so buckets have ties: which of equal extremes is kept is part of the rule.
    assert downsample(np.array(values), max_points).tolist() == _reference_downsample(values, max_points)


def _points(run, n, attempt=0, keys=("reward/mean",), spike_at=None):
    rows = []
    for step in range(n):
        metrics = {k: float(step % 7) for k in keys}
        if spike_at == step:
            metrics[keys[0]] = 1000.0
        rows.append(
            MetricPoint(
                run=run, attempt=attempt, step=step, time=T0 + datetime.timedelta(seconds=step), metrics=metrics
            )
        )
    MetricPoint.objects.bulk_create(rows)


def test_metrics_api_downsamples_and_keeps_spike_and_last(run, viewer, api_as):
    _points(run, 500, keys=("reward/mean", "loss/policy"), spike_at=123)
    MetricPoint.objects.filter(run=run, step=250).update(metrics={"loss/policy": 2.0})  # reward missing at 250
    response = api_as(viewer).get(f"/api/runs/{run.pk}/metrics/?keys=reward/mean,loss/policy&max_points=51")
    assert response.status_code == 200
    body = response.json()
    assert body["x"] == "step"
    assert body["last_step"] == 499
    reward = body["series"]["reward/mean"]
    assert len(reward["x"]) <= 51
    assert reward["x"][-1] == 499 and reward["y"][-1] == float(499 % 7)
    assert 123 in reward["x"] and reward["y"][reward["x"].index(123)] == 1000.0
    assert 250 not in reward["x"]
    assert reward["x"] == sorted(reward["x"])
    assert reward["rewound"] == [False] * len(reward["x"])
    assert len(body["series"]["loss/policy"]["x"]) <= 51


def test_rewound_points_hidden_by_default_and_flagged_when_included(run, owner, api_as):
    _points(run, 10)
    commands.mark_rewound(run.pk, 5)  # steps 6..9 rewound
    MetricPoint.objects.bulk_create([MetricPoint(run=run, attempt=1, step=6, time=T0, metrics={"reward/mean": 42.0})])
    client = api_as(owner)
    live = client.get(f"/api/runs/{run.pk}/metrics/?keys=reward/mean").json()["series"]["reward/mean"]
    assert live["x"] == [0, 1, 2, 3, 4, 5, 6]
    assert live["y"][-1] == 42.0
    assert live["rewound"] == [False] * 7
    everything = client.get(f"/api/runs/{run.pk}/metrics/?keys=reward/mean&include_rewound=1").json()
    series = everything["series"]["reward/mean"]
    assert series["x"] == [0, 1, 2, 3, 4, 5, 6, 6, 7, 8, 9]
    flagged = [x for x, r in zip(series["x"], series["rewound"], strict=True) if r]
    assert flagged == [6, 7, 8, 9]


def test_x_by_time_gives_unix_seconds(run, owner, api_as):
    _points(run, 3)
    body = api_as(owner).get(f"/api/runs/{run.pk}/metrics/?keys=reward/mean&x=time").json()
    assert body["x"] == "time"
    assert body["series"]["reward/mean"]["x"] == [T0.timestamp(), T0.timestamp() + 1, T0.timestamp() + 2]


def test_metric_keys(run, viewer, api_as):
    _points(run, 3, keys=("b/x", "a/y"))
    assert api_as(viewer).get(f"/api/runs/{run.pk}/metrics/keys/").json() == ["a/y", "b/x"]


@pytest.mark.parametrize(
    "query, field",
    [
        ("", "keys"),
        ("keys=r&x=epoch", "x"),
        ("keys=r&max_points=2", "max_points"),
        ("keys=r&max_points=abc", "max_points"),
        ("keys=r&include_rewound=maybe", "include_rewound"),
    ],
)
def test_bad_chart_arguments_are_400_naming_the_field(run, owner, api_as, query, field):
    response = api_as(owner).get(f"/api/runs/{run.pk}/metrics/?{query}")
    assert response.status_code == 400
    assert [e["field"] for e in response.json()["errors"]] == [field]


def test_other_teams_run_is_404(run, outsider, api_as):
    _points(run, 3)
    assert api_as(outsider).get(f"/api/runs/{run.pk}/metrics/?keys=reward/mean").status_code == 404
    assert api_as(outsider).get(f"/api/runs/{run.pk}/metrics/keys/").status_code == 404


def test_run_without_points_gives_empty_series(run, viewer, api_as):
    body = api_as(viewer).get(f"/api/runs/{run.pk}/metrics/?keys=reward/mean&x=time&include_rewound=1").json()
    assert body == {"x": "time", "series": {"reward/mean": {"x": [], "y": [], "rewound": []}}, "last_step": None}


@pytest.mark.django_db(transaction=True)
def test_a_long_run_read_in_two_step_ranges_at_once_gives_the_same_series(run, monkeypatch):
    # Committed rows (transaction=True): the second range is read over another connection. Two attempts
    # overlap in steps 30..39 and the first attempt's are rewound, so the merge must keep (step, attempt) order.
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("step ranges are how the PostgreSQL reader splits its work; SQLite reads in one query")
    _points(run, 40, keys=("reward/mean", "loss/policy"), spike_at=17)
    commands.mark_rewound(run.pk, 29)
    MetricPoint.objects.bulk_create(
        MetricPoint(run=run, attempt=1, step=s, time=T0, metrics={"reward/mean": 100.0 + s}) for s in range(30, 61)
    )
    keys = ["reward/mean", "loss/policy"]
    read_rows, ranges_read = sql._read_rows, []

    def recording_read_rows(*args):
        ranges_read.append(args[-2:])
        return read_rows(*args)

    monkeypatch.setattr(sql, "_read_rows", recording_read_rows)
    results = {}
    for name, threshold in (("one range", 10**9), ("two ranges", 10)):
        monkeypatch.setattr(sql, "PARALLEL_MIN_STEPS", threshold)
        ranges_read.clear()
        results[name] = [
            series.series(run.pk, keys, max_points=max_points, include_rewound=rewound)
            for max_points in (7, 1000)
            for rewound in (False, True)
        ]
        assert sorted(ranges_read) == sorted([(0, 61)] * 4 if name == "one range" else [(0, 30), (30, 61)] * 4)
    assert results["two ranges"] == results["one range"]
    everything = results["two ranges"][3]["series"]["reward/mean"]
    assert everything["x"] == sorted([*range(40), *range(30, 61)])
    rewound_steps = [x for x, r in zip(everything["x"], everything["rewound"], strict=True) if r]
    assert rewound_steps == list(range(30, 40))
    assert everything["y"][everything["x"].index(35) + 1] == 135.0  # attempt 1 after the rewound attempt 0
    live = results["two ranges"][2]["series"]["reward/mean"]
    assert live["x"] == list(range(61)) and live["y"][17] == 1000.0 and live["y"][-1] == 160.0
