"""Submitting a run that reports to experiment trackers: the platform validates metrics.reporters and the
trackers' settings with the runtime's spec, names the field of each problem, and stores what acts."""

import sys

import pytest

from jobs import handler
from jobs.models import Run

pytestmark = pytest.mark.django_db


def _fields(exc_info):
    return [(e["field"], e["message"]) for e in exc_info.value.errors]


def test_a_run_reporting_to_mlflow_and_wandb_is_stored_with_its_tracker_settings(experiment, owner):
    spec = {
        "resources": {"device": "cpu"},
        "metrics": {"reporters": ["mlflow", "wandb"], "mlflow_tracking_uri": "http://mlflow.example:5000"},
    }
    run, _ = handler.submit_run(owner, experiment, spec, name="tracked")
    metrics = run.resolved_spec["metrics"]
    assert metrics["reporters"] == ["mlflow", "wandb"]
    assert (metrics["mlflow_tracking_uri"], metrics["mlflow_experiment"]) == ("http://mlflow.example:5000", "tandem")
    assert (metrics["wandb_project"], metrics["wandb_mode"]) == ("tandem", "offline")


def test_the_older_tensorboard_flag_is_stored_as_a_reporter(experiment, owner):
    run, _ = handler.submit_run(owner, experiment, "metrics:\n  tensorboard: true\n", name="tb")
    assert run.resolved_spec["metrics"]["reporters"] == ["tensorboard"]
    assert "tensorboard" not in run.resolved_spec["metrics"]


def test_a_tracker_not_installed_or_a_setting_of_one_not_asked_for_is_refused_naming_the_field(
    experiment, owner, monkeypatch
):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the package were not installed
    with pytest.raises(handler.InvalidInput) as caught:
        handler.submit_run(owner, experiment, "metrics:\n  reporters: [wandb]\n")
    assert _fields(caught) == [
        (
            "metrics.reporters",
            "Value error, wandb not installed where this spec is checked (pip install -r requirements-trackers.txt)",
        )
    ]
    with pytest.raises(handler.InvalidInput) as caught:
        handler.submit_run(owner, experiment, "metrics:\n  mlflow_experiment: rl\n")
    assert _fields(caught) == [
        ("metrics.mlflow_experiment", 'acts only with mlflow in metrics.reporters: leave it at "tandem"')
    ]
    assert Run.objects.count() == 0
