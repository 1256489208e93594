"""Ask the jobs app for an admission pass after the current transaction commits (host changes can free
or remove devices). By task name: the platform app must not import jobs (DESIGN.md's dependency direction).
Its own module so that the Celery tasks and the host agent both import it at the top."""

from __future__ import annotations

from django.db import transaction

from rlplatform.celery import app

ADMISSION_TASK = "jobs.tasks.admit_pending"


def _send_admission() -> None:
    # The project app explicitly: it carries the broker settings, whichever app a thread has as current.
    app.signature(ADMISSION_TASK).apply_async()


def request_admission() -> None:
    """Queue one admission pass after the current transaction commits.

    A broker error is logged, not raised: the periodic pass (TANDEM_ADMISSION_INTERVAL_S) catches up.
    """
    transaction.on_commit(_send_admission, robust=True)
