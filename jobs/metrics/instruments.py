"""The counters only a web process sees, in prometheus_client's multiprocess mode.

Points stored and batches refused by the ingest API, and how long commands take to be acknowledged:
each web process (uvicorn worker) counts its own requests into its files under
``settings.TANDEM_PROMETHEUS_DIR``, and whichever process answers a scrape sums them all. Anything that
also happens on host agents (restarts, failures, admissions) is read from PostgreSQL instead
(platform_state.py): a host agent on another machine writes no file this machine's web server reads.
"""

from __future__ import annotations

import logging

import prometheus_client
from django.db import transaction
from prometheus_client import values

from jobs import metrics

log = logging.getLogger(__name__)

# Commands act at step boundaries: from a fraction of a second to minutes.
COMMAND_ACK_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
INGEST_OUTCOMES = ("inserted", "merged", "unchanged")

INGEST_POINTS = prometheus_client.Counter(
    "tandem_ingest_points",
    "Metric points received by the ingest API, by outcome: inserted (a new step), merged (new keys of a "
    "step it had), unchanged (a replay). rate() of it is points per second.",
    ["outcome"],
)
INGEST_REJECTED = prometheus_client.Counter(
    "tandem_ingest_rejected_batches",
    "Metric batches the ingest API refused, by HTTP status (400 invalid, 401 bad run token, 403 another run's).",
    ["status"],
)
COMMAND_ACK_SECONDS = prometheus_client.Histogram(
    "tandem_command_ack_seconds",
    "From a command's creation to the runtime's acknowledgement (done or failed), by kind and result.",
    ["kind", "result"],
    buckets=COMMAND_ACK_BUCKETS,
)

for _outcome in INGEST_OUTCOMES:
    INGEST_POINTS.labels(_outcome)  # present from the start, at 0: rate() needs a first sample


def multiprocess_on() -> bool:
    """Whether prometheus_client keeps this process's values in the shared directory."""
    return values.ValueClass is not values.MutexValue


if not multiprocess_on():
    # Something imported prometheus_client before jobs.metrics set the directory (a library imported
    # before Django's set-up): this process's counts stay in its memory and never reach /metrics.
    log.error(
        "prometheus_client was imported before %s was set: this process's ingest and command counts will "
        "not appear in /metrics",
        metrics.MULTIPROC_ENV,
    )


def count_ingested(points: dict[str, int]) -> None:
    """A stored batch's point counts (jobs.ingest.handler.store_points' reply)."""
    for outcome in INGEST_OUTCOMES:
        if points.get(outcome):
            INGEST_POINTS.labels(outcome).inc(points[outcome])


def count_rejected(status: int) -> None:
    INGEST_REJECTED.labels(str(status)).inc()


def observe_command_ack(kind: str, result: str, seconds: float) -> None:
    """A command's acknowledgement, counted once its transaction commits (a rolled-back ack never was)."""
    transaction.on_commit(lambda: COMMAND_ACK_SECONDS.labels(kind, result).observe(max(seconds, 0.0)))
