"""Chart data: downsampling keeps min/max per bucket and the last point; the metrics API and its errors."""

from __future__ import annotations

import datetime

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs import commands
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
