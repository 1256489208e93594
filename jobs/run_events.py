"""The events the platform itself records for a run (role ``platform``, attempt 0): stored as ``RunEvent``
rows and streamed live through jobs.stream; the run page's Events table reads them.

One writer for jobs.lifecycle.events (role launched, exited, restarted...) and jobs.alerts (alert fired,
resolved, webhook failed); it imports neither, so both packages use it without an import cycle.

The event's ``seq`` is the run's last platform ``seq`` plus one, and ``runevent_unique_seq`` (run, attempt,
role, seq) forbids two rows with one number. Two writers of one run that read the same last number collide:
the second insert waits for the first writer's transaction and then fails. Each try runs in a savepoint of
its own, so the failed insert rolls back alone (the caller's transaction goes on), and the number is read
again, now past the committed one.
"""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Max
from django.utils import timezone

from jobs import stream
from jobs.models import RunEvent

PLATFORM_ROLE = "platform"  # the ``role`` of the events the platform itself records for a run
# Inserts tried before a seq collision is raised. Each lost try means another writer committed an event of
# this run meanwhile, so a slow writer can lose as many tries as the others write events while it retries
# (a test's 3 writers of 10 events each once took more than 10 on a loaded machine): the bound only stops
# a writer that never wins.
SEQ_TRIES = 1000


def _next_seq(run_id: int) -> int:
    last = RunEvent.objects.filter(run_id=run_id, attempt=0, role=PLATFORM_ROLE).aggregate(m=Max("seq"))["m"]
    return (last or 0) + 1


def _taken(run_id: int, seq: int) -> bool:
    return RunEvent.objects.filter(run_id=run_id, attempt=0, role=PLATFORM_ROLE, seq=seq).exists()


def record(run_id: int, kind: str, payload: dict[str, Any]) -> RunEvent:
    """Store the run's next platform event and stream it (sent once the surrounding transaction commits)."""
    now = timezone.now()
    with transaction.atomic():
        for attempt in range(SEQ_TRIES):
            seq = _next_seq(run_id)
            try:
                with transaction.atomic():  # a savepoint: a collision rolls back this insert only
                    event = RunEvent.objects.create(
                        run_id=run_id, attempt=0, role=PLATFORM_ROLE, seq=seq, kind=kind, payload=payload, time=now
                    )
                break
            except IntegrityError:
                # Only a collision on seq is retried: another writer's committed row now holds the number.
                if attempt == SEQ_TRIES - 1 or not _taken(run_id, seq):
                    raise
        stream.append(
            run_id, "event", {"kind": kind, "payload": payload, "role": PLATFORM_ROLE, "time": now.timestamp()}
        )
    return event
