"""The Celery application.

Broker: ``REDIS_URL`` in deployment; unset, a filesystem broker under
``var/celery/`` that the web process, a local worker and beat share (see
settings). Platform tasks go to the ``default`` queue; each accelerator
host's worker also consumes its own queue (``Host.queue``). Beat drives
periodic admission and device-hour accounting (``CELERY_BEAT_SCHEDULE``).
"""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "rlplatform.settings")

app = Celery("tandem")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
