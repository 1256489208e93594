"""Helpers of the ingest tests: post a body, build a reporter batch, read what was stored."""

from __future__ import annotations


def post(client, endpoint: str, body):
    return client.post(f"/api/ingest/{endpoint}", body, format="json")


def batch(run, steps, metrics=None, *, attempt=0, events=(), role="trainer-0"):
    """A reporter body: one point per step with ``metrics(step)`` (default {"reward": step / 10})."""
    metrics = metrics or (lambda step: {"reward": step / 10})
    return {
        "run": str(run.pk),
        "attempt": attempt,
        "role": role,
        "points": [
            {"seq": i, "step": s, "time": 1_700_000_000.0 + s, "metrics": metrics(s)} for i, s in enumerate(steps)
        ],
        "events": list(events),
    }


def stored(run, attempt=0, *, rewound=False) -> dict[int, dict]:
    """step -> metrics of the run's stored rows (live ones by default)."""
    from jobs.models import MetricPoint

    rows = MetricPoint.objects.filter(run=run, attempt=attempt, rewound=rewound).order_by("step")
    return {row.step: row.metrics for row in rows}
