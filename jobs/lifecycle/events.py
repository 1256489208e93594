"""The events the platform itself records for a run (the run page's event log), and the roles' live
entries: both stored and streamed through jobs.stream."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone

from jobs import run_events, stream
from jobs.alerts import evaluate as alerts
from jobs.models import RunRole
from jobs.run_events import PLATFORM_ROLE

__all__ = ["PLATFORM_ROLE", "ROLE_RESTARTED", "record_event", "stream_role"]

ROLE_RESTARTED = "role_restarted"  # jobs.lifecycle.apply._restart


def record_event(run_id: int, kind: str, payload: dict[str, Any]) -> None:
    """A platform event of the run (role launched, exited, restarted...): stored and streamed live
    (jobs.run_events); a restart also feeds the restarts alert rule once it has committed."""
    with transaction.atomic():
        run_events.record(run_id, kind, payload)
        if kind == ROLE_RESTARTED:
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
