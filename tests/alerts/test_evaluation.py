"""Alert rules fire and resolve from ingested points (real PostgreSQL, through the ingest API): one event per
transition, however often a batch is delivered; restarts and the periodic no_step check; an alert failure
never loses a metric."""

from __future__ import annotations

import datetime

from django.utils import timezone

from jobs.alerts import evaluate, kinds
from jobs.models import AlertRule, MetricPoint
from runtime import contract as M
from tests.alerts.helpers import add_rule, alert_events, batch


def test_every_run_gets_the_default_rules(run):
    rules = sorted(AlertRule.objects.filter(run=run).values_list("kind", "threshold"))
    assert rules == [("no_step", 600.0), ("non_finite", 0.0), ("restarts", 3.0)]


def test_a_non_finite_loss_fires_once_however_often_the_batch_comes_and_a_finite_one_resolves(run, ingest):
    nan = batch([1, 2], lambda s: {M.LOSS_POLICY: None if s == 2 else 0.5, M.REWARD_MEAN: 0.1})
    for _ in range(3):  # the reporter resends after lost replies
        ingest(nan)
    events = alert_events(run, kinds.NON_FINITE)
    assert [(k, p["state"], p["step"]) for k, p in events] == [("alert_firing", "firing", 2)]
    assert "loss/policy not finite at step 2" in events[0][1]["message"]
    assert AlertRule.objects.get(run=run, kind=kinds.NON_FINITE).firing

    ingest(batch([3], lambda s: {M.LOSS_POLICY: 0.4, M.REWARD_MEAN: 0.2}))
    ingest(batch([4], lambda s: {M.LOSS_POLICY: 0.4}))
    assert [p["state"] for _k, p in alert_events(run, kinds.NON_FINITE)] == ["firing", "resolved"]
    assert not AlertRule.objects.get(run=run, kind=kinds.NON_FINITE).firing


def test_trainer_bubble_above_its_threshold_fires_and_resolves(run, ingest):
    add_rule(run, kinds.BUBBLE, 0.3)
    ingest(batch([1, 2], lambda s: {M.BUBBLE_TRAINER: 0.1}))
    assert alert_events(run) == []
    ingest(batch([3], lambda s: {M.BUBBLE_TRAINER: 0.6}))
    ingest(batch([3], lambda s: {M.BUBBLE_TRAINER: 0.6}))  # replayed: no second event
    ingest(batch([4], lambda s: {M.BUBBLE_TRAINER: 0.7}))  # still firing: no event
    ingest(batch([5], lambda s: {M.BUBBLE_TRAINER: 0.2}))
    events = alert_events(run, kinds.BUBBLE)
    assert [(p["state"], p["value"], p["threshold"]) for _k, p in events] == [
        ("firing", 0.6, 0.3),
        ("resolved", 0.2, 0.3),
    ]


def test_staleness_at_the_bound_for_n_steps_fires(run, ingest):
    assert kinds.staleness_bound(run) == 1  # the spec's pipeline.max_policy_lag
    add_rule(run, kinds.STALENESS, 3)
    ingest(batch([1, 2], lambda s: {M.STALENESS_MAX: 1}))
    ingest(batch([1, 2], lambda s: {M.STALENESS_MAX: 1}))  # a replay counts no step twice
    assert alert_events(run) == []
    ingest(batch([3], lambda s: {M.STALENESS_MAX: 1}))
    assert [p["state"] for _k, p in alert_events(run, kinds.STALENESS)] == ["firing"]
    ingest(batch([4], lambda s: {M.STALENESS_MAX: 0}))
    assert [p["state"] for _k, p in alert_events(run, kinds.STALENESS)] == ["firing", "resolved"]


def test_throughput_below_a_fraction_of_its_median_fires_and_resolves(run, ingest):
    add_rule(run, kinds.THROUGHPUT, 0.5)
    ingest(batch(range(1, 11), lambda s: {M.SAMPLES_PER_S: 100.0 + s}))
    assert alert_events(run) == []
    ingest(batch([11], lambda s: {M.SAMPLES_PER_S: 20.0}))
    ingest(batch([12], lambda s: {M.SAMPLES_PER_S: 99.0}))
    events = alert_events(run, kinds.THROUGHPUT)
    assert [(p["state"], p["value"]) for _k, p in events] == [("firing", 20.0), ("resolved", 99.0)]


def test_no_step_for_t_seconds_fires_from_the_periodic_check_and_a_step_resolves(run, ingest, other_runs):
    ingest(batch([1], lambda s: {M.REWARD_MEAN: 0.1}))
    assert evaluate.check_silent_runs() == 0  # its step just arrived
    AlertRule.objects.filter(run=run, kind=kinds.NO_STEP).update(
        seen_at=timezone.now() - datetime.timedelta(seconds=601)
    )
    assert list(evaluate.silent_rules().values_list("run_id", flat=True)) == [run.pk]  # the others: not due
    assert evaluate.check_silent_runs() == 1
    assert evaluate.check_silent_runs() == 0  # fired already: once
    events = alert_events(run, kinds.NO_STEP)
    assert [p["state"] for _k, p in events] == ["firing"]
    assert events[0][1]["value"] >= 600
    ingest(batch([2], lambda s: {M.REWARD_MEAN: 0.2}))
    assert [p["state"] for _k, p in alert_events(run, kinds.NO_STEP)] == ["firing", "resolved"]


def test_restarts_above_k_fire_once(run, django_capture_on_commit_callbacks):
    from jobs.lifecycle.events import record_event

    for restarts in (1, 2, 3, 4, 5):
        with django_capture_on_commit_callbacks(execute=True):
            record_event(run.pk, "role_restarted", {"role": "rollout-0", "restarts": restarts})
    events = alert_events(run, kinds.RESTARTS)
    assert [(p["state"], p["value"]) for _k, p in events] == [("firing", 4.0)]


def test_an_alert_failure_never_loses_a_metric(run, ingest, monkeypatch):
    def broken(*args):
        raise RuntimeError("alert store down")

    monkeypatch.setattr(evaluate, "_on_points", broken)
    reply = ingest(batch([1, 2], lambda s: {M.LOSS_POLICY: None}))
    assert reply["points"]["inserted"] == 2
    assert MetricPoint.objects.filter(run=run).count() == 2
    assert alert_events(run) == []
