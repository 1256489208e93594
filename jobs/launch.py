"""Launching, restarting and ending a run's role processes: the platform's side.

    admitted (jobs.admission)  -> request_launch: one ``launch_runs`` task after the admitting commit
    launch_run (each run)      -> the role is placed on the run's allocated devices and one
                                  ``start_role`` task goes to its host's queue after commit
    start_role on the host     -> jobs.supervisor claims, spawns and watches the process
    the process exits          -> role_exited: complete, fail, restart from the last checkpoint,
                                  or requeue after a preemption

A run's roles: ``trainer-0`` runs the pipeline (trainer, sample queue, weight service,
evaluator, and its own rollout processes on its host: a dead one is restarted by the runtime itself,
within ``resources.rollout_restarts``). Its data-parallel trainer ranks (``resources.trainer_devices``)
lie on its host when one holds the trainer's share, else over several hosts — within one switch when
one holds them, else the fewest hosts (jobs.placement.spread) — and ``trainer-1`` .. ``trainer-<H-1>``
run the ranks on the further hosts (``python -m runtime role trainer-ranks``), meeting ``trainer-0`` at its
host's rendezvous. A spec with ``resources.remote_rollout_workers: N`` adds the roles ``rollout-0`` ..
``rollout-<N-1>``: rollout instances that run as processes of their own, one device each, on any host,
and connect to the trainer; ``resources.remote_evaluator: true`` adds ``evaluator``, the evaluator as
such a process (``python -m runtime role evaluator``).

The run's state follows ``trainer-0``. The trainer roles live and die together: when one fails, the
others are stopped (``stop_requested``), and once all have exited they are started again together,
resuming from the newest checkpoint (within ``resources.max_restarts``). A further trainer role that
exits 0 is done (``trainer-0`` ended the run). A rollout or evaluator role that exits 0 is done too (the
trainer released it); one that fails is restarted on its host while the run goes on, within
``rollout_restarts``.
Every admission queues all the roles together; an attempt still live from an earlier admission
(the run was requeued and admitted again before it ended) is stopped by its host's supervisor, and
the last one's end launches the new admission's roles.

Every function here takes the group lock first (rlplatform.locks order), so it
never deadlocks with admission or with ``jobs.handler.transition``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from jobs import confinement, handler, placement, stream
from jobs.models import Allocation, Experiment, Run, RunEvent, RunRole, RunToken
from jobs.models import RoleState as R
from jobs.states import ACTIVE_STATES, IllegalTransition, RunState
from rlplatform import locks
from rlplatform.celery import app
from rlplatform.models import Host
from runtime.contract import (
    ENDPOINT_FILE,
    EVALUATOR_ROLE,
    EXIT_BAD_INPUT,
    ROLLOUT_PREFIX,
    TRAINER_PREFIX,
    TRAINER_ROLE,
    batch_body,
    spool_dir,
    undelivered,
)

logger = logging.getLogger(__name__)

LAUNCH_TASK = "jobs.tasks.launch_runs"
START_TASK = "jobs.tasks.start_role"
PLATFORM_ROLE = "platform"  # the ``role`` of the events the platform itself records for a run
SPOOL_REPLAY_BATCH = 500  # records per stored batch when the platform replays an ended role's spool


def run_dir(run_id: int) -> Path:
    """The run's directory: checkpoints, reporter spools, role logs (inside the checkpoint root)."""
    return confinement.run_directory(run_id)


def role_dir(role: RunRole) -> Path:
    """One attempt's files: ``pid``, ``log``, ``exit_code`` (jobs/rolewrap.py)."""
    return Path(role.workdir) / "roles" / role.name / f"attempt-{role.attempt}"


def is_rollout(name: str) -> bool:
    return name.startswith(ROLLOUT_PREFIX)


def connects_to_trainer(name: str) -> bool:
    """A remote rollout role or the evaluator: it serves trainer-0 over the link, while the run goes on."""
    return is_rollout(name) or name == EVALUATOR_ROLE


def is_trainer(name: str) -> bool:
    """``trainer-0`` or a further trainer role (ranks on another host): they restart together."""
    return name.startswith(TRAINER_PREFIX)


def resources_of(run: Run) -> dict[str, Any]:
    """The ``resources`` section of the run's resolved spec."""
    return run.resolved_spec.get("resources", {}) or {}


def remote_rollout_workers(run: Run) -> int:
    return int(resources_of(run).get("remote_rollout_workers", 0) or 0)


def remote_evaluator(run: Run) -> bool:
    return bool(resources_of(run).get("remote_evaluator", False))


def uses_link(run: Run) -> bool:
    """Whether roles of the run connect to trainer-0 (runtime.rollout.link): remote rollout roles, the evaluator."""
    return remote_rollout_workers(run) > 0 or remote_evaluator(run)


def role_names(run: Run) -> list[str]:
    """Every role the current admission of ``run`` launches: its trainer roles, then its remote rollout
    instances (how many trainer roles: how its allocated devices lie, see :func:`placed_roles`)."""
    placed = placed_roles(run)
    if isinstance(placed, str):
        rollouts = [f"{ROLLOUT_PREFIX}{i}" for i in range(remote_rollout_workers(run))]
        return [TRAINER_ROLE, *rollouts, *([EVALUATOR_ROLE] if remote_evaluator(run) else [])]
    return list(placed)


def read_tail(path: Path, size: int = 8192) -> str:
    """The last ``size`` bytes of a file as text ('' when it is missing): a role's log."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - size))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


# --- sending tasks (after commit, never inside the transaction that decided them) ------------------


def _send(task: str, args: list[Any], queue: str | None = None) -> None:
    options = {"queue": queue} if queue else {}
    app.signature(task, args=args).apply_async(**options)


def request_launch(run_ids: list[int]) -> None:
    """Queue one ``launch_runs`` task for the runs once the current transaction commits: one message per
    admission pass, however many it admitted (a broker error is logged; the role watchdog launches
    admitted runs that were missed)."""
    ids = list(run_ids)
    if ids:
        transaction.on_commit(lambda: _send(LAUNCH_TASK, [ids]), robust=True)


def _forget_endpoint(run_id: int) -> None:
    """After commit, before the start tasks: remove the run's endpoint file. An earlier admission's trainer
    may have left the run-ended marker in it (a preempted run), which would send the new admission's
    rollout roles away before its trainer writes its own endpoint."""

    def forget() -> None:
        (run_dir(run_id) / ENDPOINT_FILE).unlink(missing_ok=True)

    transaction.on_commit(forget, robust=True)


def _request_start(role: RunRole) -> None:
    role_id, attempt = role.pk, role.attempt
    queue = role.host.queue or f"host.{role.host.name}"
    transaction.on_commit(lambda: _send(START_TASK, [role_id, attempt], queue=queue), robust=True)


def _queue_attempt(role: RunRole, message: str = "") -> None:
    """Make ``role`` (its attempt number already set) a fresh pending attempt, its process fields cleared;
    save it and send its start task after commit."""
    role.state, role.queued_at, role.claimed_by, role.message = R.PENDING, timezone.now(), "", message[:2000]
    role.stop_requested = False
    role.pid = role.exit_code = role.launched_at = role.exited_at = role.supervised_at = None
    role.save()
    _request_start(role)


# --- events the platform records for a run (the run page's event log) -------------------------------


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
    stream.append(role.run_id, "role", _role_entry(role))


# --- launch -------------------------------------------------------------------------------------------


def _group_id(run_id: int) -> int | None:
    return Experiment.objects.filter(runs__pk=run_id).values_list("group_id", flat=True).first()


def _place_roles(run: Run, devices: list[tuple[int, int]]) -> dict[str, tuple[int, list[int]]] | str:
    """Role name -> (host id, device indices) for the run's allocated ``(host id, index)`` devices, in launch
    order (``trainer-0`` first), or the reason they cannot be divided among its roles."""
    by_host: dict[int, list[int]] = {}
    for host_id, index in devices:
        by_host.setdefault(host_id, []).append(index)
    labels = Host.objects.filter(pk__in=by_host).values_list("pk", "labels")
    switch_of = {
        pk: (str(lab["switch"]) if isinstance(lab, dict) and lab.get("switch") else None) for pk, lab in labels
    }
    split = placement.split_roles(by_host, placement.shape_of(resources_of(run), run.devices_requested), switch_of)
    if isinstance(split, str):
        return split
    trainer, others = split
    placed = {f"{TRAINER_PREFIX}{i}": (host_id, indices) for i, (host_id, indices) in enumerate(trainer)}
    names = [f"{ROLLOUT_PREFIX}{i}" for i in range(remote_rollout_workers(run))]
    names += [EVALUATOR_ROLE] if remote_evaluator(run) else []
    for name, (host_id, index) in zip(names, others, strict=True):
        placed[name] = (host_id, [index])
    return placed


def placed_roles(run: Run) -> dict[str, tuple[int, list[int]]] | str:
    """:func:`_place_roles` over the run's active allocations: the same answer for the whole admission."""
    devices = list(
        Allocation.objects.active()
        .filter(run=run)
        .order_by("device__host_id", "device__index")
        .values_list("device__host_id", "device__index")
    )
    return _place_roles(run, devices)


def trainer_ranks(placed: dict[str, tuple[int, list[int]]], resources: dict[str, Any]) -> dict[str, range]:
    """The data-parallel ranks each trainer role runs: ``trainer-0`` first, on its first devices (its
    rollout and evaluator devices come after them), then each further trainer role on all of its own."""
    extras = placement.shape_of(resources).lead - 1  # trainer-0's rollout and evaluator devices
    ranks, first = {}, 0
    for name, (_host, indices) in placed.items():
        if is_trainer(name):
            count = len(indices) - (extras if name == TRAINER_ROLE else 0)
            ranks[name] = range(first, first + count)
            first += count
    return ranks


def launch_run(run_id: int) -> RunRole | None:
    """Place the admitted run's roles on its devices and send their start tasks; idempotent.

    Returns the trainer role (None when there is nothing to launch: the run is gone, not ADMITTED, or
    a role of it has a live attempt: this admission's, on its way, or an earlier admission's, which its
    supervisor stops; the last one's end calls this again). A run whose devices cannot be divided
    among its roles (see :func:`_place_roles`) fails with that reason.
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
        for name in placed:
            role = existing.get(name)
            if role is None:
                role = RunRole(run=run, name=name, workdir=str(run_dir(run.pk)), attempt=0)
            else:  # re-admitted after a preemption (or a lost host): a new attempt, maybe elsewhere
                role.attempt += 1
            host_id, indices = placed[name]
            role.host, role.device_indices = hosts[host_id], indices
            _queue_attempt(role)
            stream_role(role)
            record_event(run.pk, "role_queued", {"role": role.name, "host": role.host.name, "attempt": role.attempt})
            trainer = trainer or role
    return trainer


def resend_start(role_id: int) -> bool:
    """Send a pending role's start task again (the broker may have lost it); True when sent."""
    with transaction.atomic():
        role = RunRole.objects.select_for_update().select_related("host").filter(pk=role_id, state=R.PENDING).first()
        if role is None:
            return False
        role.queued_at = timezone.now()
        role.save(update_fields=["queued_at"])
        _request_start(role)
    return True


# --- the end of a role process ---------------------------------------------------------------------


def _last_json_line(log_tail: str) -> dict[str, Any]:
    for line in reversed(log_tail.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return {}


def last_error_line(log_tail: str) -> str:
    """The runtime's one-line reason (``error: ...``) from the end of its log, or ''."""
    for line in reversed(log_tail.splitlines()):
        if line.startswith("error: "):
            return line[len("error: ") :].strip()
    return ""


def _move(run: Run, target: RunState, reason: str = "") -> None:
    try:
        handler.transition(run, target, reason)
    except IllegalTransition:
        pass  # someone moved it first (a cancel, a stop command's ack): their state stands


def _lock_live_attempt(role_id: int, attempt: int) -> RunRole | None:
    """Inside a transaction: the group lock, then the role row if ``attempt`` is its live one (not exited)."""
    group_id = Experiment.objects.filter(runs__roles__pk=role_id).values_list("group_id", flat=True).first()
    if group_id is None:
        return None
    locks.lock_group(group_id)
    return (
        RunRole.objects.select_for_update()
        .select_related("run", "host")
        .filter(pk=role_id, attempt=attempt)
        .exclude(state=R.EXITED)
        .first()
    )


def role_exited(role_id: int, attempt: int, exit_code: int | None, log_tail: str = "", why: str = "") -> str:
    """Record that the role's ``attempt`` ended, and decide what happens to its run; idempotent.

    ``exit_code`` None: the process vanished without one (host rebooted, killed with its wrapper);
    ``why`` then says what the supervisor saw. Returns what was decided (for logs and tests):
    ``ignored`` (already handled), ``ended`` (the run was no longer active), ``superseded`` (an
    attempt of an earlier admission: when it was the last, the new admission's roles are launched),
    ``completed``, ``preempted``, ``cancelled``, ``failed``, ``requeued``, ``restarting``, ``done``
    (a rollout or further trainer role that trainer-0 released), ``stopping`` (a trainer role failed; the
    others are asked to stop) or ``stopped`` (one of those, while others still live).
    """
    # Idempotent like any replay, and file reading: before the group lock, not under it.
    replay_spool(role_id, attempt)
    with transaction.atomic():
        role = _lock_live_attempt(role_id, attempt)
        if role is None:
            return "ignored"
        run = role.run
        error = last_error_line(log_tail)
        role.state, role.exit_code, role.exited_at = R.EXITED, exit_code, timezone.now()
        role.message = (error or why or (f"exit code {exit_code}" if exit_code is not None else "vanished"))[:2000]
        role.save(update_fields=["state", "exit_code", "exited_at", "message"])
        record_event(
            run.pk,
            "role_exited",
            {"role": role.name, "attempt": attempt, "exit_code": exit_code, "message": role.message},
        )
        decision = _decide(role, run, exit_code, log_tail, error, why)
        role.refresh_from_db()  # a restart may have queued its next attempt through another instance of the row
        stream_role(role)
    if decision == "superseded":
        launch_run(run.pk)  # nothing when other attempts of the earlier admission still live
    return decision


def replay_spool(role_id: int, attempt: int) -> int:
    """Store what the ended attempt's reporter could not deliver (the platform was unreachable when it
    exited): its spool lies in the run directory. Idempotent like any replay; returns the records read."""
    from jobs.ingest import handler as ingest

    role = RunRole.objects.filter(pk=role_id).values("run_id", "name", "workdir").first()
    if role is None or role["name"] != TRAINER_ROLE:
        return 0  # only the trainer reports through a spool (rollout roles send heartbeats alone)
    records = undelivered(spool_dir(Path(role["workdir"]), attempt))
    token = (
        RunToken.objects.filter(run_id=role["run_id"], attempt=attempt).order_by("-created_at").first()
        if records
        else None
    )
    if token is None:
        return 0
    run_id = role["run_id"]
    for start in range(0, len(records), SPOOL_REPLAY_BATCH):
        body = batch_body(records[start : start + SPOOL_REPLAY_BATCH], str(run_id), attempt, role["name"])
        try:
            ingest.ingest_batch(token, body, deliver_commands=False)
        except ingest.InvalidInput as exc:  # a record the API refuses: the rest still goes in
            logger.warning("run %s attempt %s: spooled batch refused: %s", run_id, attempt, exc)
    return len(records)


def superseded(role: RunRole, run: Run) -> bool:
    """Whether ``role``'s live attempt is left from an earlier admission of ``run``.

    launch_run queues every role of an admission together, and only once no role of the run is live.
    So while the run is ADMITTED, another of its roles that is not live means this attempt belongs to
    the admission before (the run was requeued and admitted again before this attempt ended)."""
    if run.state != RunState.ADMITTED:
        return False
    live_others = RunRole.objects.filter(run_id=run.pk).exclude(pk=role.pk).exclude(state=R.EXITED).count()
    return live_others < len(role_names(run)) - 1


def _restart_budget(role: RunRole, run: Run) -> int:
    key = "rollout_restarts" if connects_to_trainer(role.name) else "max_restarts"
    return int(resources_of(run).get(key, 3))


def _decide(role: RunRole, run: Run, exit_code: int | None, log_tail: str, error: str, why: str) -> str:
    if RunState(run.state) not in ACTIVE_STATES:
        return "ended"
    if superseded(role, run):
        return "superseded"
    if connects_to_trainer(role.name):
        return _decide_rollout(role, run, exit_code, error, why)
    if role.stop_requested:  # stopped because another trainer role failed: they restart together
        return _trainer_stopped(run)
    if exit_code == 0 and role.name != TRAINER_ROLE:  # trainer-0 ended the run and released its ranks here
        record_event(run.pk, "role_done", {"role": role.name, "attempt": role.attempt})
        return "done"
    if exit_code == 0:
        outcome = _last_json_line(log_tail).get("outcome", "completed")
        # A short run can end before its first heartbeat moved it to RUNNING: walk it there first.
        if outcome != "cancelled" and run.state == RunState.ADMITTED:
            _move(run, RunState.STARTING)
        if outcome != "cancelled" and run.state == RunState.STARTING:
            _move(run, RunState.RUNNING)
        if outcome == "preempted":
            _move(run, RunState.PREEMPTED, "preempted by a higher-priority run; requeued from its checkpoint")
            _move(run, RunState.QUEUED, "requeued after preemption")
            return "preempted"
        if outcome == "cancelled":
            _move(run, RunState.CANCELLED, "cancelled")
            return "cancelled"
        _move(run, RunState.COMPLETED)
        return "completed"
    if exit_code == EXIT_BAD_INPUT:
        _move(run, RunState.FAILED, f"{role.name} rejected its input: {error or 'see its log'}")
        return "failed"
    what = error or why or f"exit code {exit_code}"
    budget = _restart_budget(role, run)
    others = _trainer_roles(run, exclude=role)
    spent = max([role.restarts, *(other.restarts for other in others)])
    if spent >= budget:
        _move(run, RunState.FAILED, f"{role.name} failed after {spent} restarts: {what}")
        return "failed"
    failures = dict(role.host_failures)
    failures[str(role.host_id)] = failures.get(str(role.host_id), 0) + 1
    role.host_failures = failures
    role.save(update_fields=["host_failures"])
    if failures[str(role.host_id)] >= settings.TANDEM_HOST_FAILURE_LIMIT:
        # It keeps failing here: try other devices, from the last checkpoint (shared run directory).
        role.restarts += 1
        role.save(update_fields=["host_failures", "restarts"])
        Run.objects.filter(pk=run.pk).update(excluded_hosts=sorted({*run.excluded_hosts, role.host_id}))
        reason = f"{role.name} failed {failures[str(role.host_id)]} times on host {role.host.name}"
        _move(run, RunState.PREEMPTED, f"{reason}: {what}")
        _move(run, RunState.QUEUED, f"{reason}; requeued for other hosts")
        record_event(run.pk, "host_excluded", {"role": role.name, "host": role.host.name, "reason": what})
        return "requeued"
    live = [other for other in others if other.state != R.EXITED]
    if not live:
        return _restart_trainers(run, f"{role.name}: {what}" if role.name != TRAINER_ROLE else what)
    for other in live:  # their supervisors stop them; the last one's end restarts them all
        other.stop_requested = True
        other.save(update_fields=["stop_requested"])
    record_event(
        run.pk, "trainer_group_stopping", {"role": role.name, "stopping": [o.name for o in live], "reason": what}
    )
    return "stopping"


def _trainer_roles(run: Run, exclude: RunRole | None = None) -> list[RunRole]:
    """The rows of the current admission's trainer roles (locked), but ``exclude``."""
    names = [name for name in role_names(run) if is_trainer(name)]
    rows = RunRole.objects.select_for_update(of=("self",)).select_related("host").filter(run=run, name__in=names)
    return [row for row in rows if exclude is None or row.pk != exclude.pk]


def _trainer_stopped(run: Run) -> str:
    """A trainer role stopped because another one failed has exited: when it was the last one live, start
    them all again (the failed one's reason is the restart's)."""
    group = _trainer_roles(run)
    if any(role.state != R.EXITED for role in group):
        return "stopped"
    failed = [role for role in group if not role.stop_requested]
    why = f"{failed[0].name}: {failed[0].message}" if failed else "a trainer role failed"
    return _restart_trainers(run, why.removeprefix(f"{TRAINER_ROLE}: "))


def _restart_trainers(run: Run, what: str) -> str:
    """Queue the next attempt of every trainer role of the run, together (trainer-0 resumes from the newest
    checkpoint and the further ranks join it); each restart counts against ``max_restarts``."""
    for role in sorted(_trainer_roles(run), key=lambda r: int(r.name.removeprefix(TRAINER_PREFIX))):
        _restart(role, run, what)
        stream_role(role)
    return "restarting"


def _restart(role: RunRole, run: Run, what: str) -> str:
    """Queue the role's next attempt on its host and devices (the run goes on), recorded as an event."""
    role.attempt += 1
    role.restarts += 1
    _queue_attempt(role, f"restarting after: {what}")
    record_event(
        run.pk,
        "role_restarted",
        {"role": role.name, "attempt": role.attempt, "restarts": role.restarts, "reason": what},
    )
    return "restarting"


def _decide_rollout(role: RunRole, run: Run, exit_code: int | None, error: str, why: str) -> str:
    """A remote rollout role or the remote evaluator ended while its run goes on (the run's state follows
    the trainer)."""
    if exit_code == 0:  # the trainer ended the run and released it
        record_event(run.pk, "role_done", {"role": role.name, "attempt": role.attempt})
        return "done"
    if exit_code == EXIT_BAD_INPUT:
        _move(run, RunState.FAILED, f"{role.name} rejected its input: {error or 'see its log'}")
        return "failed"
    what = error or why or f"exit code {exit_code}"
    if role.restarts >= _restart_budget(role, run):
        _move(run, RunState.FAILED, f"{role.name} failed after {role.restarts} restarts: {what}")
        return "failed"
    return _restart(role, run, what)  # it connects to the trainer by itself (the endpoint file)


# --- the role watchdog (jobs.tasks.watch_roles, celery beat) ----------------------------------------


def host_lost(role_id: int, attempt: int, host_name: str) -> str:
    """The role's host is gone: the attempt is over, and the whole run goes back to the queue to resume
    from its last checkpoint on other devices (counted against the lost role's restart budget); its
    other live attempts end as superseded once it is admitted again (or as ended while it waits).
    Returns the decision."""
    with transaction.atomic():
        role = _lock_live_attempt(role_id, attempt)
        if role is None:
            return "ignored"
        run = role.run
        why = f"host {host_name} lost"
        role.state, role.exited_at, role.message = R.EXITED, timezone.now(), why
        role.save(update_fields=["state", "exited_at", "message"])
        record_event(run.pk, "role_lost", {"role": role.name, "attempt": attempt, "host": host_name})
        stream_role(role)
        if RunState(run.state) not in ACTIVE_STATES:
            decision = "ended"
        elif superseded(role, run):
            decision = "superseded"
        elif role.restarts >= _restart_budget(role, run):
            _move(run, RunState.FAILED, f"{role.name} failed after {role.restarts} restarts: {why}")
            decision = "failed"
        else:
            RunRole.objects.filter(pk=role.pk).update(restarts=role.restarts + 1)
            _move(run, RunState.PREEMPTED, f"{why}; requeued to resume from its last checkpoint")
            _move(run, RunState.QUEUED, f"{why}; requeued")
            decision = "requeued"
    if decision == "superseded":
        launch_run(run.pk)
    return decision


def watch() -> dict[str, int]:
    """One watchdog pass: hosts that stopped supervising their roles, start tasks the broker lost,
    admitted runs never launched. Idempotent; returns counts."""
    from rlplatform.models import HostStatus

    now = timezone.now()
    grace = datetime.timedelta(seconds=settings.TANDEM_HOST_GRACE_S)
    launch_timeout = datetime.timedelta(seconds=settings.TANDEM_LAUNCH_TIMEOUT_S)
    counts = {"lost": 0, "resent": 0, "launched": 0}
    stale = RunRole.objects.filter(state__in=[R.LAUNCHING, R.RUNNING], supervised_at__lt=now - grace)
    for role_id, attempt, host_name, status in stale.values_list("pk", "attempt", "host__name", "host__status"):
        if status != HostStatus.ONLINE:  # an online host's agent is alive: its supervisor catches up
            counts["lost"] += host_lost(role_id, attempt, host_name) != "ignored"
    pending = RunRole.objects.filter(state=R.PENDING, queued_at__lt=now - launch_timeout)
    for role_id, attempt, host_name, status in pending.values_list("pk", "attempt", "host__name", "host__status"):
        if status == HostStatus.ONLINE:
            counts["resent"] += resend_start(role_id)
        else:
            counts["lost"] += host_lost(role_id, attempt, host_name) != "ignored"
    missed = Run.objects.filter(state=RunState.ADMITTED, admitted_at__lt=now - launch_timeout).exclude(
        roles__state__in=[R.PENDING, R.LAUNCHING, R.RUNNING]
    )
    for run_id in missed.values_list("pk", flat=True):
        counts["launched"] += launch_run(run_id) is not None
    return counts
