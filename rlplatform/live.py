"""What the platform side tells the live UI: a resource group's devices changed (a host agent's heartbeat).

The Cluster page's sockets (jobs.consumers.RunsConsumer, ``ws/runs/?follow=devices``) are members of the
channel group ``cluster.<group id>``. A heartbeat sends them ``runs.devices`` naming the group, no data:
each socket reads the group's device rows itself (what it may see of holders depends on its teams), at most
once every ``TANDEM_CLUSTER_LIVE_S``, and sends only the rows that changed. So a heartbeat storm costs one
small channel message per heartbeat and, per open page, one read and one message per period.

Here, not in jobs.stream: rlplatform never imports jobs (jobs.stream names the group through this module).
"""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

log = logging.getLogger(__name__)

DEVICES_CHANGED = "runs.devices"


def cluster_group(group_id: int) -> str:
    """The channel group of the pages showing resource group ``group_id`` (runs lists, the Cluster page)."""
    return f"cluster.{group_id}"


def devices_changed(group_id: int) -> None:
    """After the surrounding transaction commits, tell the group's Cluster pages to read its devices again."""
    transaction.on_commit(lambda: _send(group_id))


def _send(group_id: int) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(cluster_group(group_id), {"type": DEVICES_CHANGED, "group": group_id})
    except Exception:  # best effort: the heartbeat is stored; the next one tells the pages again
        log.warning("could not tell the cluster pages of group %s", group_id, exc_info=True)
