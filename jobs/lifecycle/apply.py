"""The end of a role's attempt: recorded, decided (jobs.lifecycle.decide) and applied, in one transaction.

    the process exited or vanished (jobs.supervisor)  -> role_exited
    its host stopped supervising it (the watchdog)    -> host_lost

Each takes the group lock first (rlplatform.locks order), so it never deadlocks with admission or with
``jobs.handler.transition``; then the attempt's row, which must still be live (a second report of the
same end finds nothing: ``ignored``). It marks the attempt EXITED, gathers the facts
:func:`jobs.lifecycle.decide.decide` needs, and applies its Decision here, in :data:`APPLY`.

The run's state follows ``trainer-0``. The trainer roles live and die together: when one fails, the
others are asked to stop (``stop_requested``), and once all have exited they are started again together,
resuming from the newest checkpoint (within ``resources.max_restarts``). A rollout or evaluator role that
fails is restarted on its host while the run goes on (within ``rollout_restarts``). An attempt left from
an earlier admission (the run was requeued and admitted again before it ended) is stopped by its host's
supervisor, and the last one's end launches the new admission's roles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction

from jobs import handler, launch
from jobs.ingest.spool import replay_spool
from jobs.lifecycle import role_states
from jobs.lifecycle.decide import (
    DEFAULT_RESTARTS,
    Decision,
    Exit,
    RoleFacts,
    RunFacts,
    decide,
    failure_cause,
    restarts_spent,
)
from jobs.lifecycle.events import record_event, stream_role
from jobs.lifecycle.files import last_error_line, last_json_line
from jobs.lifecycle.names import is_trainer, trainer_index
from jobs.lifecycle.roles import resources_of, role_names, superseded
from jobs.models import Experiment, Run, RunRole
from jobs.models import RoleState as R
from jobs.states import IllegalTransition, RunState
from rlplatform import locks
from runtime.contract import OUTCOME_COMPLETED, TRAINER_ROLE

IGNORED = "ignored"  # what role_exited and host_lost report when the attempt's end was handled already


@dataclass
class _Ending:
    """An attempt's end as the decision is applied to it."""

    role: RunRole  # locked, EXITED
    run: Run
    others: list[RunRole]  # the run's other trainer roles (locked), when ``role`` is one
    what: str  # why it ended, for the reasons the run and the role record
    error: str  # the runtime's ``error:`` line, if any
    spent: int  # the restarts counted against its budget


def role_exited(role_id: int, attempt: int, exit_code: int | None, log_tail: str = "", why: str = "") -> str:
    """Record that the role's ``attempt`` ended, and decide what happens to its run; idempotent.

    ``exit_code`` None: the process vanished without one (host rebooted, killed with its wrapper);
    ``why`` then says what the supervisor saw. Returns the decision's outcome word (for logs and tests,
    :attr:`Decision.outcome`), or ``ignored`` when the end was handled already.
    """
    # Idempotent like any replay, and file reading: before the group lock, not under it.
    replay_spool(role_id, attempt)
    with transaction.atomic():
        role = _lock_live_attempt(role_id, attempt)
        if role is None:
            return IGNORED
        run = role.run
        error = last_error_line(log_tail)
        message = error or why or (f"exit code {exit_code}" if exit_code is not None else "vanished")
        if not role_states.mark_exited(role, exit_code, message):
            return IGNORED
        record_event(
            run.pk,
            "role_exited",
            {"role": role.name, "attempt": attempt, "exit_code": exit_code, "message": role.message},
        )
        end = Exit(exit_code, outcome=last_json_line(log_tail).get("outcome", OUTCOME_COMPLETED))
        others = _other_trainer_roles(role, run) if is_trainer(role.name) else []
        decision = _decide_and_apply(role, run, others, end, what=error or why or f"exit code {exit_code}", error=error)
        role.refresh_from_db()  # a restart may have queued its next attempt through another instance of the row
        stream_role(role)
    if decision is Decision.SUPERSEDED:
        launch.launch_run(run.pk)  # nothing when other attempts of the earlier admission still live
    return decision.outcome


def host_lost(role_id: int, attempt: int, host_name: str) -> str:
    """The role's host is gone: the attempt is over, and the whole run goes back to the queue to resume
    from its last checkpoint on other devices (counted against the lost role's restart budget); its
    other live attempts end as superseded once it is admitted again (or as ended while it waits).
    Returns the decision's outcome word, or ``ignored``."""
    with transaction.atomic():
        role = _lock_live_attempt(role_id, attempt)
        if role is None:
            return IGNORED
        run = role.run
        why = f"host {host_name} lost"
        if not role_states.mark_exited(role, None, why):
            return IGNORED
        record_event(run.pk, "role_lost", {"role": role.name, "attempt": attempt, "host": host_name})
        stream_role(role)
        decision = _decide_and_apply(role, run, [], Exit(None, host_lost=True), what=why, error="")
    if decision is Decision.SUPERSEDED:
        launch.launch_run(run.pk)
    return decision.outcome


def _lock_live_attempt(role_id: int, attempt: int) -> RunRole | None:
    """Inside a transaction: the group lock, then the role row if ``attempt`` is its live one (not exited)."""
    group_id = Experiment.objects.filter(runs__roles__pk=role_id).values_list("group_id", flat=True).first()
    if group_id is None:
        return None
    locks.lock_group(group_id)
    return (
        RunRole.objects.select_for_update()
        .select_related("run", "host")
        .filter(pk=role_id, attempt=attempt, state__in=role_states.LIVE)
        .first()
    )


def _other_trainer_roles(role: RunRole, run: Run) -> list[RunRole]:
    """The rows of the current admission's trainer roles (locked), but ``role``'s."""
    names = [name for name in role_names(run) if is_trainer(name)]
    rows = RunRole.objects.select_for_update(of=("self",)).select_related("host").filter(run=run, name__in=names)
    return [row for row in rows if row.pk != role.pk]


def _decide_and_apply(role: RunRole, run: Run, others: list[RunRole], end: Exit, what: str, error: str) -> Decision:
    """Gather the facts of the ended attempt, decide, and apply the decision; returns it."""
    resources = resources_of(run)
    role_facts = RoleFacts(
        name=role.name,
        restarts=role.restarts,
        stop_requested=role.stop_requested,
        superseded=superseded(role, run),
        failures_on_host=int(role.host_failures.get(str(role.host_id), 0)),
    )
    run_facts = RunFacts(
        state=RunState(run.state),
        max_restarts=int(resources.get("max_restarts", DEFAULT_RESTARTS)),
        rollout_restarts=int(resources.get("rollout_restarts", DEFAULT_RESTARTS)),
        host_failure_limit=settings.TANDEM_HOST_FAILURE_LIMIT,
        trainer_restarts=max((other.restarts for other in others), default=0),
        live_trainers=sum(other.state != R.EXITED for other in others),
    )
    decision = decide(role_facts, run_facts, end)
    cause = failure_cause(role_facts, end, decision)
    if cause is not None:  # what /metrics counts as role failures (jobs.metrics.platform_state)
        record_event(run.pk, "role_failed", {"role": role.name, "attempt": role.attempt, "cause": cause})
    APPLY[decision](_Ending(role, run, others, what, error, restarts_spent(role_facts, run_facts, end)))
    return decision


# --- applying each decision -------------------------------------------------------------------------


def _move(run: Run, target: RunState, reason: str = "") -> None:
    try:
        handler.transition(run, target, reason)
    except IllegalTransition:
        pass  # someone moved it first (a cancel, a stop command's ack): their state stands


def _nothing(end: _Ending) -> None:
    """Ended, superseded (launched again after commit) or waiting for the other trainer roles to stop."""


def _released(end: _Ending) -> None:
    record_event(end.run.pk, "role_done", {"role": end.role.name, "attempt": end.role.attempt})


def _walk_to_running(run: Run) -> None:
    """A short run can end before its first heartbeat moved it to RUNNING: walk it there first."""
    if run.state == RunState.ADMITTED:
        _move(run, RunState.STARTING)
    if run.state == RunState.STARTING:
        _move(run, RunState.RUNNING)


def _complete(end: _Ending) -> None:
    _walk_to_running(end.run)
    _move(end.run, RunState.COMPLETED)


def _cancel(end: _Ending) -> None:
    _move(end.run, RunState.CANCELLED, "cancelled")


def _requeue_preempted(end: _Ending) -> None:
    _walk_to_running(end.run)
    _move(end.run, RunState.PREEMPTED, "preempted by a higher-priority run; requeued from its checkpoint")
    _move(end.run, RunState.QUEUED, "requeued after preemption")


def _requeue_host_lost(end: _Ending) -> None:
    role_states.count_restart(end.role)
    _move(end.run, RunState.PREEMPTED, f"{end.what}; requeued to resume from its last checkpoint")
    _move(end.run, RunState.QUEUED, f"{end.what}; requeued")


def _requeue_elsewhere(end: _Ending) -> None:
    """It keeps failing here: try other devices, from the last checkpoint (shared run directory)."""
    role, run = end.role, end.run
    failures = role_states.count_failure_on_host(role)
    role_states.count_restart(role)
    Run.objects.filter(pk=run.pk).update(excluded_hosts=sorted({*run.excluded_hosts, role.host_id}))
    reason = f"{role.name} failed {failures} times on host {role.host.name}"
    _move(run, RunState.PREEMPTED, f"{reason}: {end.what}")
    _move(run, RunState.QUEUED, f"{reason}; requeued for other hosts")
    record_event(run.pk, "host_excluded", {"role": role.name, "host": role.host.name, "reason": end.what})


def _fail_bad_input(end: _Ending) -> None:
    _move(end.run, RunState.FAILED, f"{end.role.name} rejected its input: {end.error or 'see its log'}")


def _fail_restarts_spent(end: _Ending) -> None:
    _move(end.run, RunState.FAILED, f"{end.role.name} failed after {end.spent} restarts: {end.what}")


def _restart(role: RunRole, run: Run, what: str) -> None:
    """Queue the role's next attempt on its host and devices (the run goes on), recorded as an event."""
    launch.restart(role, f"restarting after: {what}")
    record_event(
        run.pk,
        "role_restarted",
        {"role": role.name, "attempt": role.attempt, "restarts": role.restarts, "reason": what},
    )


def _restart_role(end: _Ending) -> None:
    _restart(end.role, end.run, end.what)  # it connects to the trainer by itself (the endpoint file)


def _restart_trainers(end: _Ending) -> None:
    """Queue the next attempt of every trainer role of the run, together (trainer-0 resumes from the newest
    checkpoint and the further ranks join it); each restart counts against ``max_restarts``. The reason is
    the failed role's: this one's, or (when this one was asked to stop) the one that failed first."""
    role = end.role
    if role.stop_requested:
        failed = [other for other in end.others if not other.stop_requested]
        why = f"{failed[0].name}: {failed[0].message}" if failed else "a trainer role failed"
        why = why.removeprefix(f"{TRAINER_ROLE}: ")
    else:
        role_states.count_failure_on_host(role)
        why = f"{role.name}: {end.what}" if role.name != TRAINER_ROLE else end.what
    for trainer in sorted([role, *end.others], key=lambda r: trainer_index(r.name)):
        _restart(trainer, end.run, why)
        stream_role(trainer)


def _stop_trainers(end: _Ending) -> None:
    """Their supervisors stop the other live trainer roles; the last one's end restarts them all."""
    role_states.count_failure_on_host(end.role)
    live = [other for other in end.others if other.state != R.EXITED]
    role_states.request_stop(live)
    record_event(
        end.run.pk,
        "trainer_group_stopping",
        {"role": end.role.name, "stopping": [other.name for other in live], "reason": end.what},
    )


APPLY: dict[Decision, Callable[[_Ending], None]] = {
    Decision.ENDED: _nothing,
    Decision.SUPERSEDED: _nothing,
    Decision.WAIT_FOR_TRAINERS: _nothing,
    Decision.RELEASED: _released,
    Decision.COMPLETE: _complete,
    Decision.CANCEL: _cancel,
    Decision.REQUEUE_PREEMPTED: _requeue_preempted,
    Decision.REQUEUE_HOST_LOST: _requeue_host_lost,
    Decision.REQUEUE_ELSEWHERE: _requeue_elsewhere,
    Decision.FAIL_BAD_INPUT: _fail_bad_input,
    Decision.FAIL_RESTARTS_SPENT: _fail_restarts_spent,
    Decision.RESTART_ROLE: _restart_role,
    Decision.RESTART_TRAINERS: _restart_trainers,
    Decision.STOP_TRAINERS: _stop_trainers,
}
