"""Helpers of the alert tests: reporter batches and the alert events a run has."""

from __future__ import annotations

T0 = 1_700_000_000.0


def batch(steps, metrics):
    """A reporter body: one point per step with ``metrics(step)``."""
    return {
        "role": "trainer-0",
        "points": [{"seq": s, "step": s, "time": T0 + s, "metrics": metrics(s)} for s in steps],
        "events": [],
    }


def alert_events(run, kind=None) -> list[tuple[str, dict]]:
    """(event kind, payload) of the run's alert events, oldest first."""
    from jobs.alerts import events
    from jobs.models import RunEvent

    rows = RunEvent.objects.filter(run=run, kind__in=events.KINDS).order_by("seq")
    return [(e.kind, e.payload) for e in rows if kind is None or e.payload.get("kind") == kind]


def add_rule(run, kind, threshold, metric=""):
    from jobs.alerts.kinds import KINDS
    from jobs.models import AlertRule

    return AlertRule.objects.create(run=run, kind=kind, metric=metric or KINDS[kind].metric, threshold=threshold)
