"""The alerts' Celery tasks (registered by jobs.tasks, which the worker imports through autodiscovery):
a webhook delivery with its retries, and the beat's periodic no_step check."""

from __future__ import annotations

from celery import shared_task

from jobs.alerts import evaluate, webhook


@shared_task(name="jobs.alerts.deliver_webhook", bind=True, max_retries=None, soft_time_limit=60, time_limit=90)
def deliver_webhook(self, delivery_id: int) -> None:
    wait = webhook.attempt(delivery_id, self.request.retries)
    if wait is not None:
        raise self.retry(countdown=wait)


@shared_task(name="jobs.alerts.check_silent_runs", soft_time_limit=60, time_limit=90)
def check_silent_runs() -> int:
    """Fire the no_step rules of RUNNING runs whose newest step is older than their threshold (one query)."""
    return evaluate.check_silent_runs()
