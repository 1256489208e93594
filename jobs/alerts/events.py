"""The run events alerts record: stored as platform events (role ``platform``, as jobs.lifecycle.events
records them) and streamed live; the run page's Events table and its alert banner read them."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from jobs import stream
from jobs.models import RunEvent

PLATFORM_ROLE = "platform"  # jobs.lifecycle.events.PLATFORM_ROLE (not imported: that module imports alerts)
FIRING = "alert_firing"
RESOLVED = "alert_resolved"
WEBHOOK_FAILED = "alert_webhook_failed"
KINDS = (FIRING, RESOLVED, WEBHOOK_FAILED)


def record(run_id: int, kind: str, payload: dict[str, Any]) -> None:
    now = timezone.now()
    with transaction.atomic():
        last = RunEvent.objects.filter(run_id=run_id, attempt=0, role=PLATFORM_ROLE).aggregate(m=Max("seq"))["m"]
        RunEvent.objects.create(
            run_id=run_id, attempt=0, role=PLATFORM_ROLE, seq=(last or 0) + 1, kind=kind, payload=payload, time=now
        )
        stream.append(
            run_id, "event", {"kind": kind, "payload": payload, "role": PLATFORM_ROLE, "time": now.timestamp()}
        )
