"""Launching an admitted run's roles: the platform's side.

    admitted (jobs.handler, jobs.tasks) -> jobs.lifecycle.dispatch.request_launch: one ``launch_runs``
                                           task after the admitting commit
    launch_run (each run)               -> the roles are placed on the run's allocated devices
                                           (jobs.lifecycle.roles) and one ``start_role`` task goes to
                                           each one's host queue after commit
    start_role on the host              -> jobs.supervisor claims, spawns and watches the process
    the process exits                   -> jobs.lifecycle.apply.role_exited decides what follows; a
                                           restart queues the next attempt through :func:`restart`

Every admission queues all of a run's roles together, and only once none of them is live: an attempt
still live from an earlier admission (the run was requeued and admitted again before it ended) is stopped
by its host's supervisor, and the last one's end launches the new admission's roles.

Every function here takes the group lock first (rlplatform.locks order), so it never deadlocks with
admission or with ``jobs.handler.transition``.
"""

from __future__ import annotations

from django.db import transaction

from jobs import handler
from jobs.lifecycle import dispatch, role_states
from jobs.lifecycle.events import record_event, stream_role
from jobs.lifecycle.files import run_dir
from jobs.lifecycle.roles import placed_roles, uses_link
from jobs.models import Experiment, Run, RunRole
from jobs.models import RoleState as R
from jobs.states import RunState
from rlplatform import locks
from rlplatform.models import Host
from runtime.contract import ENDPOINT_FILE


def _forget_endpoint(run_id: int) -> None:
    """After commit, before the start tasks: remove the run's endpoint file. An earlier admission's trainer
    may have left the run-ended marker in it (a preempted run), which would send the new admission's
    rollout roles away before its trainer writes its own endpoint."""

    def forget() -> None:
        (run_dir(run_id) / ENDPOINT_FILE).unlink(missing_ok=True)

    transaction.on_commit(forget, robust=True)


def _request_start(role: RunRole) -> None:
    """The attempt's start task to its host's queue, after commit."""
    role_id, attempt = role.pk, role.attempt
    queue = role.host.queue or f"host.{role.host.name}"
    transaction.on_commit(lambda: dispatch.send(dispatch.START_TASK, [role_id, attempt], queue=queue), robust=True)


def _group_id(run_id: int) -> int | None:
    return Experiment.objects.filter(runs__pk=run_id).values_list("group_id", flat=True).first()


def launch_run(run_id: int) -> RunRole | None:
    """Place the admitted run's roles on its devices and send their start tasks; idempotent.

    Returns the trainer role (None when there is nothing to launch: the run is gone, not ADMITTED, or
    a role of it has a live attempt: this admission's, on its way, or an earlier admission's, which its
    supervisor stops; the last one's end calls this again). A run whose devices cannot be divided
    among its roles (see :func:`jobs.lifecycle.roles.place_roles`) fails with that reason.
    """
    group_id = _group_id(run_id)
    if group_id is None:
        return None
    with transaction.atomic():
        locks.lock_group(group_id)
        run = Run.objects.filter(pk=run_id).first()
        if run is None or run.state != RunState.ADMITTED:
            return None
        existing = {role.name: role for role in RunRole.objects.select_for_update().filter(run=run)}
        if any(role.state != R.EXITED for role in existing.values()):
            return None
        placed = placed_roles(run)
        if isinstance(placed, str):
            handler.transition(run, RunState.FAILED, placed)
            return None
        hosts = Host.objects.in_bulk({host_id for host_id, _indices in placed.values()})
        if uses_link(run):
            _forget_endpoint(run.pk)
        trainer = None
        for name, (host_id, indices) in placed.items():
            role = existing.get(name)
            if role is None:
                role = role_states.create_pending(run, name, hosts[host_id], indices, str(run_dir(run.pk)))
            # Admitted again after a preemption or a lost host: a new attempt, maybe elsewhere.
            elif not role_states.queue_next_attempt(role, host=hosts[host_id], device_indices=indices):
                continue  # cannot happen under the locks; an attempt that was not queued is never started
            _request_start(role)
            stream_role(role)
            record_event(run.pk, "role_queued", {"role": role.name, "host": role.host.name, "attempt": role.attempt})
            trainer = trainer or role
    return trainer


def restart(role: RunRole, message: str) -> bool:
    """Queue the exited role's next attempt on its host and devices, counted against its restarts, and send
    its start task after commit (the caller holds the group lock). True when queued."""
    if not role_states.queue_next_attempt(role, restart=True, message=message):
        return False
    _request_start(role)
    return True


def resend_start(role_id: int) -> bool:
    """Send a pending role's start task again (the broker may have lost it); True when sent."""
    with transaction.atomic():
        if not role_states.mark_start_resent(role_id):
            return False
        _request_start(RunRole.objects.select_related("host").get(pk=role_id))
    return True
