"""The alert rules' kinds, what ``threshold`` means for each, the defaults every run gets, and the small
pure helpers evaluation shares. Imports only the models and the contract: jobs.handler creates the defaults
at submit (jobs.alerts.rules, which checks API input, builds on jobs.handler)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobs.models import AlertRule, Run
from runtime import contract as M

BUBBLE = "bubble"  # the metric (bubble/trainer) above threshold (a fraction 0..1)
STALENESS = "staleness"  # the metric (staleness/max) at the run's pipeline.max_policy_lag for threshold steps
NO_STEP = "no_step"  # no new step for threshold seconds (the periodic check)
NON_FINITE = "non_finite"  # a loss/* or reward/* value (or the one metric named) NaN or infinite
THROUGHPUT = "throughput"  # the metric (throughput/samples_per_s) below threshold x its recent median
RESTARTS = "restarts"  # a role restarted more than threshold times


@dataclass(frozen=True)
class Kind:
    name: str
    metric: str  # the default metric ("" none: non_finite watches every loss/* and reward/* key)
    meaning: str  # what threshold is
    low: float
    high: float
    integer: bool = False


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind(BUBBLE, M.BUBBLE_TRAINER, "the fraction the metric must stay at or below", 0.0, 1.0),
        Kind(STALENESS, M.STALENESS_MAX, "steps in a row at the run's pipeline.max_policy_lag", 1, 1_000_000, True),
        Kind(NO_STEP, "", "seconds without a new step", 1, 30 * 86_400, True),
        Kind(NON_FINITE, "", "unused (0)", 0, 0),
        Kind(THROUGHPUT, M.SAMPLES_PER_S, "the fraction of the recent median the metric must stay at or above", 0, 1),
        Kind(RESTARTS, "", "the restarts a role may have", 0, 1_000_000, True),
    )
}
# Kinds the ingest path evaluates on each batch's points (no_step: the periodic check and arrival; restarts:
# role restarts).
ON_POINTS = (BUBBLE, STALENESS, NON_FINITE, THROUGHPUT, NO_STEP)
METRIC_KINDS = (BUBBLE, STALENESS, NON_FINITE, THROUGHPUT)  # kinds that watch a metric

MEDIAN_WINDOW = 100  # throughput: the median of the run's last this many values of the metric
MEDIAN_MIN = 5  # ... and no verdict before it has this many

# Every run gets these (jobs.handler.submit_run): NaN / infinite loss or reward, silence, restart storms.
DEFAULT_RULES: tuple[tuple[str, str, float], ...] = ((NON_FINITE, "", 0.0), (NO_STEP, "", 600.0), (RESTARTS, "", 3.0))


def default_rules(run: Run) -> list[AlertRule]:
    return [AlertRule(run=run, kind=kind, metric=metric, threshold=t) for kind, metric, t in DEFAULT_RULES]


def create_defaults(run: Run) -> None:
    AlertRule.objects.bulk_create(default_rules(run), ignore_conflicts=True)


def known_metric(name: str) -> bool:
    return name in M.METRICS or M.split_device_metric(name) is not None or M.split_comm_metric(name) is not None


def non_finite_keys(metric: str, values: dict[str, Any]) -> list[str]:
    """The keys a non_finite rule watches in one point (its metric, or every loss/* and reward/* key)."""
    if metric:
        return [metric] if metric in values else []
    return [k for k in values if k.startswith(("loss/", "reward/"))]


def staleness_bound(run: Run) -> int:
    pipeline = (run.resolved_spec or {}).get("pipeline") or {}
    bound = pipeline.get("max_policy_lag", 1)
    return bound if isinstance(bound, int) and not isinstance(bound, bool) else 1
