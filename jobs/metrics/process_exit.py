"""A process's exit, for prometheus_client's multiprocess files: ``mark_process_dead``.

The files of a process that ended stay (its counts still count, summed into every scrape) until the
directory is wiped at service start. ``mark_process_dead`` removes what must not outlive it: the
files of live-gauge modes. Two kinds of process end while their service goes on: a uvicorn worker
(``lifespan``, the ASGI lifespan protocol's shutdown) and a Celery pool process (``worker_process_shutdown``).
"""

from __future__ import annotations

import os

from celery.signals import worker_process_shutdown
from prometheus_client import multiprocess

from jobs import metrics


def mark_this_process_dead() -> None:
    multiprocess.mark_process_dead(os.getpid(), metrics.metrics_dir())


def _celery_process_ended(**_kwargs) -> None:
    mark_this_process_dead()


def connect_celery() -> None:
    """Mark each Celery pool process dead as it exits (idempotent; Celery's signal does nothing elsewhere)."""
    worker_process_shutdown.connect(_celery_process_ended, weak=False, dispatch_uid="tandem-metrics-exit")


async def lifespan(scope, receive, send) -> None:
    """The ASGI lifespan application of rlplatform.asgi: nothing at start-up, mark_process_dead at shutdown."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            mark_this_process_dead()
            await send({"type": "lifespan.shutdown.complete"})
            return
