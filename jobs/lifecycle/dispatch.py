"""Sending the lifecycle's Celery tasks, by name, once the transaction that decided them commits.

By name and without importing jobs.tasks, so that jobs.handler (which admits runs) can request their
launch without importing the launcher, which builds on jobs.handler.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction

from rlplatform.celery import app

LAUNCH_TASK = "jobs.tasks.launch_runs"
START_TASK = "jobs.tasks.start_role"


def send(task: str, args: list[Any], queue: str | None = None) -> None:
    """Send ``task`` now (callers defer it with ``transaction.on_commit``)."""
    options = {"queue": queue} if queue else {}
    app.signature(task, args=args).apply_async(**options)


def request_launch(run_ids: list[int]) -> None:
    """Queue one ``launch_runs`` task for the runs once the current transaction commits (at once outside
    one): one message per admission pass, however many it admitted (a broker error is logged; the role
    watchdog launches admitted runs that were missed)."""
    ids = list(run_ids)
    if ids:
        transaction.on_commit(lambda: send(LAUNCH_TASK, [ids]), robust=True)
