"""Prometheus exposition: ``/metrics`` (docs/architecture.md, "Prometheus metrics").

Importing this package points prometheus_client's multiprocess mode at ``settings.TANDEM_PROMETHEUS_DIR``
before any of its modules imports prometheus_client, which fixes the mode at its own import. The jobs
app imports it as Django starts (``JobsConfig.ready``), so every process of the platform is set up
before other code could import the library.

    platform_state.py   what PostgreSQL holds, read at scrape time (a custom collector)
    instruments.py      what only a web process sees: ingest and command acknowledgements (multiprocess)
    view.py             GET /metrics: the scrape token's check, then both of the above
    process_exit.py     a process's exit (uvicorn's lifespan, Celery's child processes): mark_process_dead
"""

from __future__ import annotations

import os

from django.conf import settings

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def metrics_dir() -> str:
    return str(settings.TANDEM_PROMETHEUS_DIR)


os.environ[MULTIPROC_ENV] = metrics_dir()
os.makedirs(metrics_dir(), exist_ok=True)
