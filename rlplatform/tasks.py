"""Celery tasks of the platform app: host registration, heartbeats, the lost-host watchdog.

``mark_lost_hosts`` runs from beat every ``TANDEM_HEARTBEAT_S`` (queue
``default``). ``register_host`` and ``host_heartbeat`` let anything that can
reach the broker report a host (the agent itself writes through
rlplatform.hosts directly, see rlplatform.agent). Whenever a host's capacity
grows back (registration, a LOST host heartbeating again, a device turning
healthy) or shrinks (a host lost), an admission pass is queued after commit,
so waiting runs get the devices at once and queued runs' reasons stay true.
"""

from __future__ import annotations

import logging

from celery import shared_task
from django.conf import settings

from rlplatform import hosts
from rlplatform.admission_request import request_admission

logger = logging.getLogger(__name__)


@shared_task(name="rlplatform.tasks.register_host", soft_time_limit=60, time_limit=90)
def register_host(name, group, address="", queue="", labels=None, devices=()) -> dict:
    """Create or update a host and its devices (rlplatform.hosts.register_host); devices as dicts."""
    result = hosts.register_host(name, group, address=address, queue=queue, labels=labels, devices=devices)
    if result.capacity_may_have_grown or result.vanished:
        request_admission()
    return {
        "host_id": result.host_id,
        "created": result.created,
        "added": result.added,
        "updated": result.updated,
        "vanished": result.vanished,
        "came_online": result.came_online,
    }


@shared_task(name="rlplatform.tasks.host_heartbeat", soft_time_limit=30, time_limit=60)
def host_heartbeat(name, devices_health=None) -> dict:
    """A host is alive; ``devices_health`` ({index: healthy}, JSON keys as strings) updates its devices."""
    beat = hosts.heartbeat(name, devices_health)
    if beat.admission_needed:
        request_admission()
    return {"came_back": beat.came_back, "health_changed": beat.health_changed, "unknown": beat.unknown_indices}


@shared_task(name="rlplatform.tasks.mark_lost_hosts", soft_time_limit=30, time_limit=60)
def mark_lost_hosts() -> list[str]:
    """Beat: hosts silent for ``TANDEM_HOST_GRACE_S`` become LOST; their devices leave admission."""
    lost = hosts.mark_lost_hosts(settings.TANDEM_HOST_GRACE_S)
    if lost:
        request_admission()  # refresh the reasons of queued runs that counted on those devices
    return lost


# Connects the agent's Celery worker signals; the worker imports this module through autodiscovery.
from rlplatform import agent  # noqa: E402, F401
