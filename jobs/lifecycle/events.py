"""The events the platform itself records for a run (the run page's event log), and the roles' live
entries: both stored and streamed through jobs.stream."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from jobs import stream
from jobs.alerts import evaluate as alerts
from jobs.models import RunEvent, RunRole

PLATFORM_ROLE = "platform"  # the ``role`` of the events the platform itself records for a run
ROLE_RESTARTED = "role_restarted"  # jobs.lifecycle.apply._restart


def record_event(run_id: int, kind: str, payload: dict[str, Any]) -> None:
    """A platform event of the run (role launched, exited, restarted...): stored and streamed live."""
    now = timezone.now()
    with transaction.atomic():
        last = RunEvent.objects.filter(run_id=run_id, attempt=0, role=PLATFORM_ROLE).aggregate(m=Max("seq"))["m"]
        RunEvent.objects.create(
            run_id=run_id, attempt=0, role=PLATFORM_ROLE, seq=(last or 0) + 1, kind=kind, payload=payload, time=now
        )
        stream.append(
            run_id, "event", {"kind": kind, "payload": payload, "role": PLATFORM_ROLE, "time": now.timestamp()}
        )
        if kind == ROLE_RESTARTED:  # the restarts alert rule, once the restart has committed
            restarts = payload.get("restarts")
            transaction.on_commit(lambda: alerts.on_restart(run_id, restarts), robust=True)


def _role_entry(role: RunRole) -> dict[str, Any]:
    return {
        "role": role.name,
        "status": role.state,
        "host": role.host.name,
        "attempt": role.attempt,
        "restarts": role.restarts,
        "exit_code": role.exit_code,
        "last_seen": timezone.now().timestamp(),
    }


def stream_role(role: RunRole) -> None:
    """The role's state as the run page's roles table shows it, streamed live."""
    stream.append(role.run_id, "role", _role_entry(role))
