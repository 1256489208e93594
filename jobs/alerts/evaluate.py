"""Evaluating alert rules, and what a transition does.

Where each kind is evaluated:

- ``on_points`` (jobs.ingest.handler, inside the ingest transaction, after the points are stored): the
  rules of the run watching metrics, over the steps the batch actually wrote. A pure replay writes no step,
  so it evaluates nothing; a rule's state changes in the same transaction as the points, so one transition
  is one event however often a batch is delivered. One SELECT ... FOR UPDATE of the run's rules and at most
  one UPDATE per batch, in a savepoint: an alert failure is logged and the points stay stored.
- ``on_restart`` (after a ``role_restarted`` event commits, jobs.lifecycle.events): the restarts rule.
- ``check_silent_runs`` (beat, jobs.alerts.tasks): one query for the no_step rules whose run is RUNNING and
  whose newest step arrived more than ``threshold`` seconds ago; arrival of a step resolves them.

A transition (ok -> firing, firing -> ok) is an ``alert_firing`` / ``alert_resolved`` run event, after commit
a ``runs.alerts`` message to the team's runs lists (``tell_runs_lists``: their banners) and, when the run has
a webhook (its own, else its experiment's default: jobs.alerts.webhook.target), an AlertDelivery row whose
task is sent after commit (jobs.alerts.webhook).
"""

from __future__ import annotations

import datetime
import logging
import math
import statistics
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import DateTimeField, DurationField, ExpressionWrapper, F, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from jobs import run_events, stream
from jobs.alerts import events, webhook
from jobs.alerts.kinds import (
    BUBBLE,
    MEDIAN_MIN,
    MEDIAN_WINDOW,
    NO_STEP,
    NON_FINITE,
    ON_POINTS,
    RESTARTS,
    STALENESS,
    THROUGHPUT,
    non_finite_keys,
    staleness_bound,
)
from jobs.models import AlertDelivery, AlertRule, Run, RunRole
from jobs.states import RunState
from rlplatform.celery import app

log = logging.getLogger(__name__)

DELIVER_TASK = "jobs.alerts.deliver_webhook"
# A run's webhook setting and its experiment's default, as webhook.target takes them (one query with the run).
WEBHOOK_FIELDS = ("alert_webhook__url", "alert_webhook__off", "experiment__alert_webhook__url")
SEEN_EVERY_S = 1.0  # no_step: the newest step's arrival is written at most this often per rule

Points = list[tuple[int, dict[str, Any]]]  # (step, metrics) in step order


@dataclass
class Verdict:
    firing: bool
    value: float | None
    step: int | None
    message: str


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _newest(points: Points, metric: str) -> tuple[int, float] | None:
    for step, values in reversed(points):
        number = _number(values.get(metric))
        if number is not None:
            return step, number
    return None


# --- the verdict of each kind on a batch's new points (None: no verdict, the state stays) --------------


def _non_finite(rule: AlertRule, points: Points) -> Verdict | None:
    watched = False
    for step, values in points:
        keys = non_finite_keys(rule.metric, values)
        watched = watched or bool(keys)
        bad = [k for k in keys if _number(values[k]) is None]
        if bad:  # sticky for the batch: a NaN anywhere in it fires
            return Verdict(True, None, step, f"{', '.join(sorted(bad))} not finite at step {step}")
    if watched:
        return Verdict(False, 0.0, points[-1][0], "loss and reward finite again")
    return None


def _bubble(rule: AlertRule, points: Points) -> Verdict | None:
    newest = _newest(points, rule.metric)
    if newest is None:
        return None
    step, value = newest
    return Verdict(value > rule.threshold, value, step, f"{rule.metric} {value:.3g} (limit {rule.threshold:g})")


def _staleness(rule: AlertRule, points: Points, bound: int) -> Verdict | None:
    seen = False
    for step, values in points:
        value = _number(values.get(rule.metric))
        if value is None or (rule.last_step is not None and step <= rule.last_step):
            continue
        rule.streak = rule.streak + 1 if value >= bound else 0
        rule.last_step, seen = step, True
    if not seen:
        return None
    message = f"{rule.metric} at the bound {bound} for {rule.streak} steps (limit {rule.threshold:g})"
    return Verdict(rule.streak >= rule.threshold, float(rule.streak), rule.last_step, message)


def _throughput(rule: AlertRule, points: Points) -> Verdict | None:
    verdict = None
    history = list(rule.history or [])
    for step, values in points:
        value = _number(values.get(rule.metric))
        if value is None or (rule.last_step is not None and step <= rule.last_step):
            continue
        if len(history) >= MEDIAN_MIN:
            floor = rule.threshold * statistics.median(history)
            message = f"{rule.metric} {value:.3g} below {rule.threshold:g} x the median ({floor:.3g})"
            verdict = Verdict(value < floor, value, step, message)
        history = (history + [value])[-MEDIAN_WINDOW:]
        rule.last_step = step
    rule.history = history
    return verdict


def on_points(run: Run, points: Points) -> None:
    """Evaluate the run's rules over the points a batch wrote (inside the ingest transaction). Never raises:
    an alert failure is logged, and the batch's points are stored all the same."""
    if not points:
        return
    try:
        with transaction.atomic():
            _on_points(run, points)
    except Exception:
        log.exception("alert evaluation failed for run %s (its points are stored)", run.pk)


def _on_points(run: Run, points: Points) -> None:
    rules = list(AlertRule.objects.select_for_update().filter(run_id=run.pk, enabled=True, kind__in=ON_POINTS))
    if not rules:
        return
    now = timezone.now()
    dirty: list[AlertRule] = []
    for rule in rules:
        before = (rule.last_step, rule.streak, len(rule.history or []))
        verdict: Verdict | None = None
        if rule.kind == NO_STEP:
            if rule.firing:
                verdict = Verdict(False, 0.0, points[-1][0], f"step {points[-1][0]} arrived")
            if verdict or rule.seen_at is None or (now - rule.seen_at).total_seconds() >= SEEN_EVERY_S:
                rule.seen_at = now
                dirty.append(rule)
        elif rule.kind == NON_FINITE:
            verdict = _non_finite(rule, points)
        elif rule.kind == BUBBLE:
            verdict = _bubble(rule, points)
        elif rule.kind == STALENESS:
            verdict = _staleness(rule, points, staleness_bound(run))
        elif rule.kind == THROUGHPUT:
            verdict = _throughput(rule, points)
        if verdict is not None and verdict.firing != rule.firing:
            _transition(run, rule, verdict, now)
        elif rule not in dirty and (rule.last_step, rule.streak, len(rule.history or [])) != before:
            dirty.append(rule)
    if dirty:
        AlertRule.objects.bulk_update(dirty, ["last_step", "streak", "history", "seen_at"])


def _transition(run: Run, rule: AlertRule, verdict: Verdict, now: datetime.datetime) -> None:
    """Flip the rule (saved), record the event, queue the webhook delivery."""
    rule.firing, rule.value, rule.changed_at = verdict.firing, verdict.value, now
    rule.save()
    state = "firing" if verdict.firing else "resolved"
    payload = {
        "rule": rule.pk,
        "kind": rule.kind,
        "metric": rule.metric,
        "state": state,
        "value": verdict.value,
        "threshold": rule.threshold,
        "step": verdict.step,
        "message": verdict.message,
    }
    run_events.record(run.pk, events.FIRING if verdict.firing else events.RESOLVED, payload)
    transaction.on_commit(lambda: tell_runs_lists(run.pk))  # the runs lists' banners
    row = (
        Run.objects.filter(pk=run.pk)
        .values("name", "experiment__team_id", "experiment__team__name", *WEBHOOK_FIELDS)
        .get()
    )
    url = webhook.target(*(row[f] for f in WEBHOOK_FIELDS))  # the run's own, else the experiment's default
    if url:
        body = {
            "rule": {"id": rule.pk, "kind": rule.kind, "metric": rule.metric},
            "run": {"id": run.pk, "name": row["name"]},
            "team": {"id": row["experiment__team_id"], "name": row["experiment__team__name"]},
            "state": state,
            "value": verdict.value,
            "threshold": rule.threshold,
            "step": verdict.step,
            "message": verdict.message,
            "time": now.isoformat(),
        }
        delivery = AlertDelivery.objects.create(run_id=run.pk, rule=rule, url=url, body=body)
        transaction.on_commit(lambda: send_delivery(delivery.pk))


def send_delivery(delivery_id: int) -> None:
    """Queue a delivery's task (after commit). A broker outage is logged: the row stays pending, so
    nothing that already committed fails (ingest never waits on the webhook)."""
    try:
        queue = getattr(settings, "TANDEM_ALERT_QUEUE", "default")
        app.signature(DELIVER_TASK, args=[delivery_id]).apply_async(queue=queue)
    except Exception:
        log.warning("could not queue alert delivery %s", delivery_id, exc_info=True)


# --- restarts, silence, edits -------------------------------------------------------------------------


def on_restart(run_id: int, restarts: Any = None) -> None:
    """A role of the run restarted: the restarts rule fires once a role's restarts exceed its threshold.
    Run after the restart's transaction commits; never raises."""
    try:
        with transaction.atomic():
            rules = list(AlertRule.objects.select_for_update().filter(run_id=run_id, kind=RESTARTS, enabled=True))
            if not rules:
                return
            counts = list(RunRole.objects.filter(run_id=run_id).values_list("restarts", flat=True))
            if _number(restarts) is not None:
                counts.append(int(restarts))
            most = max(counts, default=0)
            run = Run.objects.get(pk=run_id)
            for rule in rules:
                if not rule.firing and most > rule.threshold:
                    message = f"a role restarted {most} times (limit {rule.threshold:g})"
                    _transition(run, rule, Verdict(True, float(most), None, message), timezone.now())
    except Exception:
        log.exception("alert evaluation failed for run %s's restart", run_id)


def silent_rules():
    """The no_step rules due to fire: enabled, not firing, their run RUNNING, and their newest step's arrival
    (or the run's start, before any) more than ``threshold`` seconds ago. One query, however many runs."""
    seconds = ExpressionWrapper(F("threshold") * Value(datetime.timedelta(seconds=1)), output_field=DurationField())
    deadline = ExpressionWrapper(Coalesce(F("seen_at"), F("run__started_at")) + seconds, output_field=DateTimeField())
    return (
        AlertRule.objects.filter(kind=NO_STEP, enabled=True, firing=False, run__state=RunState.RUNNING)
        .annotate(deadline=deadline)
        .filter(deadline__lt=timezone.now())
    )


def check_silent_runs() -> int:
    """Fire every due no_step rule (each re-checked under its row lock); returns how many fired."""
    fired = 0
    for rule_id in list(silent_rules().values_list("pk", flat=True)):
        try:
            with transaction.atomic():
                rule = silent_rules().select_for_update(of=("self",)).filter(pk=rule_id).select_related("run").first()
                if rule is None:
                    continue  # a step arrived meanwhile
                since = rule.seen_at or rule.run.started_at or timezone.now()
                quiet = (timezone.now() - since).total_seconds()
                message = f"no step for {quiet:.0f} s (limit {rule.threshold:g} s)"
                _transition(rule.run, rule, Verdict(True, round(quiet, 1), rule.last_step, message), timezone.now())
                fired += 1
        except Exception:
            log.exception("alert no_step check failed for rule %s", rule_id)
    return fired


def reset(rule: AlertRule, why: str) -> None:
    """A rule was changed or removed: its evaluation starts over; a firing one resolves (recorded)."""
    if rule.firing:
        run = Run.objects.get(pk=rule.run_id)
        _transition(run, rule, Verdict(False, None, rule.last_step, why), timezone.now())
    rule.last_step, rule.streak, rule.history = None, 0, []


def firing(run_ids: list[int]) -> dict[int, list[dict[str, Any]]]:
    """run id -> its firing rules (kind, metric, threshold, value, since), for the banners."""
    out: dict[int, list[dict[str, Any]]] = {}
    rows = AlertRule.objects.filter(run_id__in=run_ids, firing=True, enabled=True).order_by("run_id", "pk")
    for rule in rows:
        out.setdefault(rule.run_id, []).append(
            {
                "id": rule.pk,
                "kind": rule.kind,
                "metric": rule.metric,
                "threshold": rule.threshold,
                "value": rule.value,
                "since": rule.changed_at.timestamp() if rule.changed_at else None,
            }
        )
    return out


def firing_runs(runs) -> list[dict[str, Any]]:
    """The runs lists' banner rows of those of ``runs`` (a queryset) with a firing rule, by run id:
    ``[{id, name, experiment, rules}]`` (rules as ``firing`` gives them)."""
    rows = list(
        runs.filter(alert_rules__firing=True, alert_rules__enabled=True)
        .values_list("pk", "name", "experiment_id")
        .distinct()
        .order_by("pk")
    )
    rules = firing([pk for pk, _name, _exp in rows])
    return [{"id": pk, "name": name, "experiment": exp, "rules": rules[pk]} for pk, name, exp in rows if rules.get(pk)]


def tell_runs_lists(run_id: int) -> None:
    """After a transition commits: the runs lists of the run's team get its firing rules as they are now
    (none: its banner row goes; jobs.consumers.RunsConsumer). Never raises: the transition is committed."""
    try:
        row = Run.objects.filter(pk=run_id).values("name", "experiment_id", "experiment__team_id").first()
        if row is None:
            return
        data = {"id": run_id, "name": row["name"], "experiment": row["experiment_id"]}
        stream.send_run_alerts(row["experiment__team_id"], {**data, "rules": firing([run_id]).get(run_id, [])})
    except Exception:
        log.warning("could not tell the runs lists about run %s's alerts", run_id, exc_info=True)
