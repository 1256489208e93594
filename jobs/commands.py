"""Commands to a run's runtime: create (audited), deliver on ingest replies, complete on the runtime's ack.

States: pending -> delivered -> done | failed. ``deliver`` hands a command out
on the reply to any ingest call or heartbeat of the run; a delivered command
that is not acknowledged within ``REDELIVER_AFTER`` rides out again (the reply
may have been lost), so the runtime must treat command ids idempotently.

Kinds and what the platform does (the runtime does the rest):

    pause       RUNNING      done -> PAUSED (devices kept)
    resume      PAUSED       done -> RUNNING
    stop        RUNNING/PAUSED   done (after the final checkpoint) -> COMPLETED
    cancel      cancellable  the run is CANCELLED at once (its tokens end); done at once: the
                             hosts' supervisors stop its processes
    rollback    RUNNING/PAUSED   {checkpoint: id of one of this run's checkpoints};
                             done -> metric points after its step are marked rewound
    fork        any          {checkpoint, spec?, overrides?, name?}: submits a new run with
                             parent_checkpoint and the edited spec; done at once
    set_params  active       {params: {"trainer.lr": 1e-5, ...}}: safe parameters only,
                             validated against runtime.spec, recorded as a ConfigVersion
    preempt     RUNNING/PAUSED   platform only (jobs.preemption): the runtime checkpoints and exits;
                             jobs.lifecycle then moves the run PREEMPTED -> QUEUED

Permission checks are the caller's, as in jobs.handler.
"""

from __future__ import annotations

import copy
import datetime
from typing import Any

from django.conf import settings
from django.core.exceptions import ObjectDoesNotExist
from django.db import transaction
from django.db.models import F, Max, Q
from django.utils import timezone

from jobs import handler, series_store, stream
from jobs.handler import Conflict, InvalidInput
from jobs.metrics import instruments
from jobs.models import CheckpointRecord, Command, CommandKind, CommandState, ConfigVersion, Run
from jobs.states import CANCELLABLE_STATES, IllegalTransition, RunState
from rlplatform import audit
from runtime.contract import LIVE_PARAMS, live_param_problems
from runtime.spec import SpecError, resolved_value, validate_spec

__all__ = [
    "RESULT_STATES",
    "CommandNotFound",
    "complete",
    "create",
    "deliver",
    "effective_params",
]

RESULT_STATES = (CommandState.DONE.value, CommandState.FAILED.value)
REDELIVER_AFTER = datetime.timedelta(seconds=30)
AUDITED_FIELDS = ("run", "kind", "args", "state", "message")

S = RunState
ALLOWED_FROM: dict[str, frozenset[RunState]] = {
    CommandKind.PAUSE: frozenset({S.RUNNING}),
    CommandKind.RESUME: frozenset({S.PAUSED}),
    CommandKind.STOP: frozenset({S.RUNNING, S.PAUSED}),
    CommandKind.CANCEL: CANCELLABLE_STATES,
    CommandKind.ROLLBACK: frozenset({S.RUNNING, S.PAUSED}),
    CommandKind.FORK: frozenset(RunState),
    CommandKind.SET_PARAMS: frozenset({S.ADMITTED, S.STARTING, S.RUNNING, S.PAUSED}),
    CommandKind.PREEMPT: frozenset({S.RUNNING, S.PAUSED}),
}
# Where a run goes when the runtime reports one of these commands done.
STATE_AFTER_DONE = {CommandKind.PAUSE: S.PAUSED, CommandKind.RESUME: S.RUNNING, CommandKind.STOP: S.COMPLETED}


class CommandNotFound(ObjectDoesNotExist):
    """No such command for this run (404)."""


def _redeliver_after() -> datetime.timedelta:
    seconds = getattr(settings, "TANDEM_COMMAND_REDELIVER_S", None)
    return datetime.timedelta(seconds=seconds) if seconds else REDELIVER_AFTER


def _team_id(run: Run) -> int:
    return Run.objects.filter(pk=run.pk).values_list("experiment__team_id", flat=True).get()


def _record(actor, action: str, command: Command, before: dict | None) -> None:
    audit.record(actor, action, command, before, audit.snapshot(command, AUDITED_FIELDS), team=_team_id(command.run))


# --- create ------------------------------------------------------------------------------------------


def create(actor, run: Run, kind: str, args: dict[str, Any] | None = None) -> Command:
    """Validate and persist a command for ``run`` (audited). Bad input: InvalidInput naming the field;
    a kind the run's state does not allow: Conflict."""
    if kind not in CommandKind.values:
        raise InvalidInput.one("kind", f"must be one of {', '.join(CommandKind.values)}")
    if kind == CommandKind.PREEMPT and actor is not None:
        raise InvalidInput.one("kind", "preempt is issued by the platform's scheduler only (jobs.preemption)")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise InvalidInput.one("args", "must be an object")
    run.refresh_from_db(fields=["state"])
    if RunState(run.state) not in ALLOWED_FROM[kind]:
        raise Conflict(f"cannot {kind} run {run.pk} while it is {run.state}")
    user = actor if getattr(actor, "is_authenticated", False) else None
    if kind == CommandKind.CANCEL:
        return _create_cancel(actor, user, run, args)
    if kind == CommandKind.FORK:
        return _create_fork(actor, user, run, args)
    with transaction.atomic():
        if kind == CommandKind.ROLLBACK:
            args = _rollback_args(run, args)
        elif kind == CommandKind.SET_PARAMS:
            Run.objects.select_for_update().filter(pk=run.pk).get()  # numbers versions one at a time
            params = _validated_params(run, args)
            args = {"params": params}
        elif args:
            raise InvalidInput.one(f"args.{next(iter(args))}", f"{kind} takes no arguments")
        command = Command.objects.create(run=run, kind=kind, args=args, created_by=user)
        if kind == CommandKind.SET_PARAMS:
            number = (ConfigVersion.objects.filter(run=run).aggregate(n=Max("number"))["n"] or 0) + 1
            ConfigVersion.objects.create(run=run, number=number, params=params, command=command, created_by=user)
            stream.append(run.pk, "config", {"number": number, "params": params})
        _record(actor, "command.create", command, None)
        _stream(command)
    return command


def _stream(command: Command) -> None:
    stream.append(
        command.run_id,
        "command",
        {"id": command.pk, "kind": command.kind, "state": command.state, "message": command.message},
    )


def _checkpoint_of(run: Run, args: dict[str, Any]) -> CheckpointRecord:
    ref = args.get("checkpoint")
    if isinstance(ref, bool) or not isinstance(ref, int):
        raise InvalidInput.one("args.checkpoint", "must be the id of one of this run's checkpoints")
    record = CheckpointRecord.objects.filter(pk=ref).first()
    if record is None:
        raise InvalidInput.one("args.checkpoint", f"no checkpoint {ref}")
    if record.run_id != run.pk:
        raise InvalidInput.one("args.checkpoint", f"checkpoint {ref} belongs to run {record.run_id}, not run {run.pk}")
    return record


def _rollback_args(run: Run, args: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(args) - {"checkpoint"})
    if unknown:
        raise InvalidInput.one(f"args.{unknown[0]}", "unknown field")
    record = _checkpoint_of(run, args)
    return {"checkpoint": record.pk, "step": record.step, "path": record.path, "weight_version": record.weight_version}


def live_params(run: Run) -> tuple[str, ...]:
    """The live parameters (runtime.contract.LIVE_PARAMS) that act in the run's mode: those its resolved spec
    records (it leaves out a knob its mode ignores, such as pipeline.max_policy_lag outside async)."""
    return tuple(key for key in LIVE_PARAMS if resolved_value(run.resolved_spec, key) is not None)


def effective_params(run: Run) -> dict[str, Any]:
    """The live parameters now in force: the resolved spec's, overlaid by every config version not failed
    (a stored value of a parameter that does not act in the run's mode is never handed to the runtime)."""
    keys = live_params(run)
    values = {key: resolved_value(run.resolved_spec, key) for key in keys}
    for version in ConfigVersion.objects.filter(run=run).exclude(command__state=CommandState.FAILED):
        values.update({k: v for k, v in version.params.items() if k in keys})
    return values


def _validated_params(run: Run, args: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(args) - {"params"})
    if unknown:
        raise InvalidInput.one(f"args.{unknown[0]}", "unknown field")
    params = args.get("params")
    problems = live_param_problems(params)
    if problems:
        raise InvalidInput([{"field": f"args.{p['field']}", "message": p["message"]} for p in problems])
    data = copy.deepcopy(run.resolved_spec)
    for key, value in {**effective_params(run), **params}.items():
        section, name = key.split(".")
        data.setdefault(section, {})[name] = value
    try:
        spec = validate_spec(data)
    except SpecError as exc:
        raise InvalidInput(
            [{"field": f"args.params.{e['field']}", "message": e["message"]} for e in exc.errors]
        ) from None
    # Store the validated values ("1e-5" given as text is stored as the number the runtime will use).
    resolved = spec.resolved()
    return {key: resolved_value(resolved, key) for key in params}


def _create_cancel(actor, user, run: Run, args: dict[str, Any]) -> Command:
    if args:
        raise InvalidInput.one(f"args.{next(iter(args))}", "cancel takes no arguments")
    with transaction.atomic():
        started = RunState(run.state) not in (S.QUEUED,)
        handler.cancel_run(actor, run)  # audited as run.cancel; frees the devices at once
        command = Command.objects.create(run=run, kind=CommandKind.CANCEL, created_by=user)
        # Done at once: no runtime will ever ask for it. A queued run has none; a started one's run token ended
        # with the run (jobs.ingest.tokens), and its hosts' supervisors stop its processes (jobs.supervisor).
        message = (
            "cancelled; the role processes are stopped by their hosts" if started else "cancelled before admission"
        )
        Command.objects.filter(pk=command.pk).update(
            state=CommandState.DONE, message=message, finished_at=timezone.now()
        )
        command.refresh_from_db()
        _record(actor, "command.create", command, None)
        _stream(command)
    return command


def _create_fork(actor, user, run: Run, args: dict[str, Any]) -> Command:
    unknown = sorted(set(args) - {"checkpoint", "spec", "overrides", "name"})
    if unknown:
        raise InvalidInput.one(f"args.{unknown[0]}", "unknown field")
    record = _checkpoint_of(run, args)
    spec = args.get("spec") if args.get("spec") is not None else run.spec
    overrides = args.get("overrides") or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise InvalidInput.one("args.overrides", "must be a list of `section.field=value` strings")
    name = args.get("name")
    with transaction.atomic():
        try:
            child, _created = handler.submit_run(
                actor, run.experiment, spec, overrides=overrides, name=name, parent_checkpoint=record.path
            )
        except InvalidInput as exc:
            raise InvalidInput(
                [
                    {
                        "field": "args.name" if e["field"] == "name" else f"args.spec.{e['field']}",
                        "message": e["message"],
                    }
                    for e in exc.errors
                ]
            ) from None
        stored = {"checkpoint": record.pk, "step": record.step, "path": record.path, "run": child.pk}
        if args.get("spec") is not None:
            stored["spec"] = args["spec"]
        if overrides:
            stored["overrides"] = overrides
        command = Command.objects.create(
            run=run,
            kind=CommandKind.FORK,
            args=stored,
            created_by=user,
            state=CommandState.DONE,
            message=f"forked as run {child.pk}",
            finished_at=timezone.now(),
        )
        _record(actor, "command.create", command, None)
        _stream(command)
    return command


# --- deliver and complete ----------------------------------------------------------------------------


def deliver(run_id: int) -> list[dict[str, Any]]:
    """Commands to put on a reply to the run's runtime, moved to delivered: the pending ones and the
    delivered ones not acknowledged for REDELIVER_AFTER. Oldest first."""
    now = timezone.now()
    due = Q(state=CommandState.PENDING) | Q(state=CommandState.DELIVERED, delivered_at__lt=now - _redeliver_after())
    with transaction.atomic():
        # skip_locked: a concurrent reply of the same run takes what it locked; no command rides on both.
        rows = list(
            Command.objects.select_for_update(skip_locked=True)
            .filter(due, run_id=run_id)
            .order_by("pk")
            .values("pk", "kind", "args")
        )
        if rows:
            Command.objects.filter(pk__in=[r["pk"] for r in rows]).update(
                state=CommandState.DELIVERED, delivered_at=now, deliveries=F("deliveries") + 1
            )
    return [{"id": r["pk"], "kind": r["kind"], "args": r["args"]} for r in rows]


def complete(run_id: int, command_id: int, state: str, message: str = "") -> Command:
    """The runtime's result for a command: done or failed, with a message. Audited.

    A repeated identical result is a no-op (a retried ack); a contradicting one is a Conflict.
    On done the run moves on (pause -> PAUSED, resume -> RUNNING, stop -> COMPLETED) and a
    rollback marks the metric points after its checkpoint's step as rewound.
    """
    if state not in RESULT_STATES:
        raise InvalidInput.one("state", f"must be one of {', '.join(RESULT_STATES)}")
    with transaction.atomic():
        command = Command.objects.select_for_update().filter(pk=command_id, run_id=run_id).first()
        if command is None:
            raise CommandNotFound(f"run {run_id} has no command {command_id}")
        if command.state in RESULT_STATES:
            if command.state == state:
                return command
            raise Conflict(f"command {command_id} is already {command.state}")
        before = audit.snapshot(command, AUDITED_FIELDS)
        command.state, command.message, command.finished_at = state, message, timezone.now()
        command.save(update_fields=["state", "message", "finished_at"])
        _record(None, "command.complete", command, before)
        instruments.observe_command_ack(command.kind, state, (command.finished_at - command.created_at).total_seconds())
        rollback = state == CommandState.DONE and command.kind == CommandKind.ROLLBACK
        if rollback:
            # Metric rows before the stream counter, the order ingest takes them in: a replay merging rows
            # past the rollback step while this completes must not deadlock with it.
            mark_rewound(command.run_id, int(command.args["step"]))
        _stream(command)
        if state == CommandState.DONE:
            _apply_done(command)
    return command


def _apply_done(command: Command) -> None:
    if command.kind == CommandKind.ROLLBACK:  # its points were marked rewound before the command was streamed
        stream.append(command.run_id, "rewound", {"after_step": int(command.args["step"])})
    target = STATE_AFTER_DONE.get(command.kind)
    if target is not None:
        try:
            handler.transition(command.run, target)
        except IllegalTransition:
            pass  # the run moved meanwhile (e.g. cancelled); the command's own result still stands


def mark_rewound(run_id: int, step: int) -> int:
    """Mark the run's live metric points after ``step`` rewound (kept, hidden by default); returns how many."""
    return series_store.rewind(run_id, step)  # the JSON rows and the chart-data store together
