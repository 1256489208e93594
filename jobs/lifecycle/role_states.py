"""Every change of a RunRole row, each a conditional UPDATE on the state (and attempt) it leaves.

    (none)     -> PENDING    create_pending        jobs.launch: a role's first attempt
    EXITED     -> PENDING    queue_next_attempt    jobs.launch: a new admission, or a restart
    PENDING    -> PENDING    mark_start_resent     jobs.launch: its start task is sent again
    PENDING    -> LAUNCHING  claim                 jobs.supervisor.start_role
    LAUNCHING  -> RUNNING    mark_running          jobs.supervisor: started, or adopted
    LAUNCHING  -> PENDING    hand_back             jobs.supervisor: its claimer died before starting it
    RUNNING    -> RUNNING    renew_lease           jobs.supervisor: seen alive
    live       -> EXITED     mark_exited           jobs.lifecycle.apply: the attempt ended
    live: request_stop; under the run's group lock: count_failure_on_host, count_restart

A function returns whether the row moved: False means someone else moved it first (a redelivered task, a
second supervisor, a newer attempt), and that move stands. The in-memory ``role`` a function is given is
updated to match only when the row moved.
"""

from __future__ import annotations

import datetime
from typing import Any

from django.utils import timezone

from jobs.models import RoleState as R
from jobs.models import Run, RunRole
from rlplatform.models import Host

LIVE = (R.PENDING, R.LAUNCHING, R.RUNNING)
MESSAGE_CHARS = 2000  # a role's message: why it exited, or why it restarts


def _fresh_attempt(message: str) -> dict[str, Any]:
    """The fields of an attempt queued to start: pending, with nothing of a process yet."""
    return {
        "state": R.PENDING,
        "queued_at": timezone.now(),
        "claimed_by": "",
        "message": message[:MESSAGE_CHARS],
        "stop_requested": False,
        "pid": None,
        "exit_code": None,
        "launched_at": None,
        "exited_at": None,
        "supervised_at": None,
    }


def _moved(role: RunRole, rows: int, changes: dict[str, Any]) -> bool:
    if rows:
        for field, value in changes.items():
            setattr(role, field, value)
    return bool(rows)


def create_pending(run: Run, name: str, host: Host, device_indices: list[int], workdir: str) -> RunRole:
    """The role's first attempt (attempt 0), pending on ``host``."""
    return RunRole.objects.create(
        run=run, name=name, host=host, device_indices=device_indices, workdir=workdir, attempt=0, **_fresh_attempt("")
    )


def queue_next_attempt(
    role: RunRole,
    *,
    host: Host | None = None,
    device_indices: list[int] | None = None,
    restart: bool = False,
    message: str = "",
) -> bool:
    """EXITED -> PENDING: the role's next attempt, on ``host`` and ``device_indices`` (default: where it
    was), counted as a restart when ``restart``."""
    changes = {
        "attempt": role.attempt + 1,
        "restarts": role.restarts + int(restart),
        "host": host or role.host,
        "device_indices": role.device_indices if device_indices is None else device_indices,
        **_fresh_attempt(message),
    }
    rows = RunRole.objects.filter(pk=role.pk, attempt=role.attempt, state=R.EXITED).update(**changes)
    return _moved(role, rows, changes)


def mark_start_resent(role_id: int) -> bool:
    """PENDING -> PENDING: its start task goes out again, and the launch timeout starts over."""
    return bool(RunRole.objects.filter(pk=role_id, state=R.PENDING).update(queued_at=timezone.now()))


def claim(role_id: int, attempt: int, worker: str) -> bool:
    """PENDING -> LAUNCHING by ``worker``: a redelivered or duplicated start task finds nothing to claim."""
    return bool(
        RunRole.objects.filter(pk=role_id, attempt=attempt, state=R.PENDING).update(
            state=R.LAUNCHING, claimed_by=worker, supervised_at=timezone.now()
        )
    )


def mark_running(role_id: int, attempt: int, pid: int, now: datetime.datetime, claimed_by: str | None = None) -> bool:
    """LAUNCHING -> RUNNING with its process group ``pid`` (``claimed_by``: a worker adopting it)."""
    changes: dict[str, Any] = {"state": R.RUNNING, "pid": pid, "launched_at": now, "supervised_at": now}
    if claimed_by is not None:
        changes["claimed_by"] = claimed_by
    return bool(RunRole.objects.filter(pk=role_id, attempt=attempt, state=R.LAUNCHING).update(**changes))


def hand_back(role_id: int, attempt: int) -> bool:
    """LAUNCHING -> PENDING: claimed by a worker that died before starting it; it is to be started again."""
    return bool(RunRole.objects.filter(pk=role_id, attempt=attempt, state=R.LAUNCHING).update(state=R.PENDING))


def renew_lease(role_id: int, attempt: int, now: datetime.datetime) -> bool:
    """RUNNING -> RUNNING: its supervisor saw it alive (the role watchdog reads a lapsed lease as a lost host)."""
    return bool(RunRole.objects.filter(pk=role_id, attempt=attempt, state=R.RUNNING).update(supervised_at=now))


def mark_exited(role: RunRole, exit_code: int | None, message: str) -> bool:
    """live -> EXITED: the attempt ``role.attempt`` ended, with ``exit_code`` (None: it vanished, or its
    host was lost) and why."""
    changes = {
        "state": R.EXITED,
        "exit_code": exit_code,
        "exited_at": timezone.now(),
        "message": message[:MESSAGE_CHARS],
    }
    rows = RunRole.objects.filter(pk=role.pk, attempt=role.attempt, state__in=LIVE).update(**changes)
    return _moved(role, rows, changes)


def request_stop(roles: list[RunRole]) -> int:
    """Ask the live ones among ``roles`` to stop (their supervisors end them); returns how many were asked."""
    live = [role for role in roles if role.state in LIVE]
    rows = RunRole.objects.filter(pk__in=[role.pk for role in live], state__in=LIVE).update(stop_requested=True)
    for role in live:
        role.stop_requested = True
    return rows


def count_failure_on_host(role: RunRole) -> int:
    """One more failure of the role on its current host (under the group lock); returns how many there are."""
    failures = dict(role.host_failures)
    key = str(role.host_id)
    failures[key] = failures.get(key, 0) + 1
    rows = RunRole.objects.filter(pk=role.pk, attempt=role.attempt).update(host_failures=failures)
    _moved(role, rows, {"host_failures": failures})
    return failures[key]


def count_restart(role: RunRole) -> None:
    """One more restart against the role's budget (under the group lock), without queuing an attempt: the
    whole run goes back to the queue."""
    rows = RunRole.objects.filter(pk=role.pk, attempt=role.attempt).update(restarts=role.restarts + 1)
    _moved(role, rows, {"restarts": role.restarts + 1})
