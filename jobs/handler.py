"""The jobs domain layer: experiments, quotas, submitting runs and moving them through their states.

Views and tasks call these functions and map the exceptions below to HTTP
codes (InvalidInput 400, Conflict 409, IllegalTransition 409). Permission
checks are the caller's (rlplatform.permissions): these functions trust that
the actor may act.

Every change of run state goes through ``transition``: it takes the group
lock (rlplatform.locks order), re-reads the state, refuses illegal moves,
applies the move as a conditional UPDATE, releases devices when a run stops
holding them, revokes the run's tokens when it ends, and runs admission in the
same transaction so freed devices go to the next runs at once. Every admission
pass here requests the launch of what it admitted (jobs.lifecycle.dispatch),
sent once the transaction commits.
"""

from __future__ import annotations

import datetime
import json
import re
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from jobs import accounting, admission, confinement, queue_order, spec_files, stream
from jobs.alerts import kinds as alert_kinds
from jobs.ingest.tokens import REVOKED_AT, revoke_run_tokens
from jobs.lifecycle.dispatch import request_launch
from jobs.models import Experiment, Run
from jobs.states import ACTIVE_STATES, REASON_REQUIRED, TERMINAL_STATES, IllegalTransition, RunState, check_transition
from rlplatform import audit, locks
from rlplatform.models import SPEC_DEVICE_TO_KIND, Device, Quota, ResourceGroup, Team
from runtime.spec import RunSpec, SpecError, apply_overrides, parse_spec_text, validate_spec

__all__ = [
    "Conflict",
    "HandlerError",
    "IllegalTransition",
    "InvalidInput",
    "admit_and_stream",
    "cancel_run",
    "create_experiment",
    "create_quota",
    "finish_run",
    "queue_info",
    "requeue_run",
    "set_priority",
    "submit_run",
    "transition",
    "update_quota",
]

MAX_SPEC_BYTES = 256 * 1024
PRIORITY_RANGE = (-1000, 1000)
SUBMISSION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,127}$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
QUOTA_LIMIT_FIELDS = ("max_devices", "max_concurrent_runs", "max_rollout_workers")
QUOTA_MAX_LIMIT = 1_000_000


class HandlerError(Exception):
    """Base of the domain errors the API maps to HTTP codes."""


class InvalidInput(HandlerError):
    """Bad input (400). ``errors``: ``[{"field": "resources.trainer_devices", "message": "..."}]``."""

    def __init__(self, errors: list[dict[str, str]]):
        self.errors = errors
        super().__init__("; ".join(f"{e['field']}: {e['message']}" for e in errors))

    @classmethod
    def one(cls, field: str, message: str) -> InvalidInput:
        return cls([{"field": field, "message": message}])


class Conflict(HandlerError):
    """The request contradicts existing state (409), e.g. a submission_id reused with another spec."""


# --- quotas and experiments ------------------------------------------------------------------


def _clean_quota_values(values: dict[str, Any]) -> dict[str, Any]:
    errors = []
    clean: dict[str, Any] = {}
    for field, value in values.items():
        if field == "name":
            if not isinstance(value, str) or not NAME_RE.match(value):
                errors.append({"field": "name", "message": "1-100 letters, digits, '.', '_' or '-'"})
            else:
                clean[field] = value
        elif field in QUOTA_LIMIT_FIELDS:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= QUOTA_MAX_LIMIT:
                errors.append({"field": field, "message": f"must be an integer from 0 to {QUOTA_MAX_LIMIT}"})
            else:
                clean[field] = value
        elif field == "priority":
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not PRIORITY_RANGE[0] <= value <= PRIORITY_RANGE[1]
            ):
                errors.append(
                    {"field": field, "message": f"must be an integer from {PRIORITY_RANGE[0]} to {PRIORITY_RANGE[1]}"}
                )
            else:
                clean[field] = value
        elif field == "device_hour_budget":
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1e9
            ):
                errors.append({"field": field, "message": "must be a number of hours >= 0, or null for unlimited"})
            else:
                clean[field] = None if value is None else float(value)
        else:
            errors.append({"field": field, "message": "unknown field"})
    if errors:
        raise InvalidInput(errors)
    return clean


def create_quota(actor, team: Team, group: ResourceGroup, name: str, **limits: Any) -> Quota:
    """Create a quota for ``team`` in ``group`` (defaults: settings.TANDEM_DEFAULT_QUOTA). Audited."""
    values = {**settings.TANDEM_DEFAULT_QUOTA, **limits, "name": name}
    clean = _clean_quota_values(values)
    if Quota.objects.filter(team=team, group=group, name=clean["name"]).exists():
        raise InvalidInput.one("name", f"team {team.name} already has a quota {clean['name']!r} in group {group.name}")
    with transaction.atomic():
        quota = Quota.objects.create(team=team, group=group, **clean)
        audit.record(actor, "quota.create", quota, None, audit.snapshot(quota, Quota.AUDITED_FIELDS))
    return quota


def update_quota(actor, quota: Quota, **changes: Any) -> Quota:
    """Change a quota's limits or priority. Audited; queued runs are re-evaluated at once.

    Lowering a limit below current use stops nothing that holds devices: new admissions wait.
    """
    clean = _clean_quota_values(changes)
    with transaction.atomic():
        group = locks.lock_group(quota.group_id)
        quotas = locks.lock_group_quotas(quota.group_id)
        locked = quotas[quota.pk]
        before = audit.snapshot(locked, Quota.AUDITED_FIELDS)
        for field, value in clean.items():
            setattr(locked, field, value)
        after = audit.snapshot(locked, Quota.AUDITED_FIELDS)
        if after != before:
            locked.save()
            audit.record(actor, "quota.update", locked, before, after)
            moved = _admit(group, quotas, timezone.now())
            stream.tell_changes(quota.group_id, moved.admitted, queue_moved=moved.moved_queue)
    quota.refresh_from_db()
    return quota


def create_experiment(
    actor, team: Team, name: str, group: ResourceGroup, quota: Quota | None = None, description: str = ""
) -> Experiment:
    """Create an experiment in a group granted to the team; without ``quota`` one is created with defaults."""
    errors = []
    if not isinstance(name, str) or not NAME_RE.match(name):
        errors.append({"field": "name", "message": "1-100 letters, digits, '.', '_' or '-'"})
    elif Experiment.objects.filter(team=team, name=name).exists():
        errors.append({"field": "name", "message": f"team {team.name} already has an experiment {name!r}"})
    if not group.teams.filter(pk=team.pk).exists():
        errors.append({"field": "group", "message": f"resource group {group.name} is not granted to team {team.name}"})
    if quota is not None and (quota.team_id != team.pk or quota.group_id != group.pk):
        errors.append(
            {"field": "quota", "message": f"quota {quota.name} is not a quota of team {team.name} in {group.name}"}
        )
    if errors:
        raise InvalidInput(errors)
    with transaction.atomic():
        if quota is None:
            quota_name = name
            if Quota.objects.filter(team=team, group=group, name=quota_name).exists():
                quota_name = f"{name}-{timezone.now():%Y%m%d%H%M%S}"
            quota = create_quota(actor, team, group, quota_name)
        try:
            with transaction.atomic():
                return Experiment.objects.create(
                    team=team, name=name, group=group, quota=quota, description=description, created_by=_user(actor)
                )
        except IntegrityError:
            raise InvalidInput.one("name", f"team {team.name} already has an experiment {name!r}") from None


def _user(actor):
    return actor if getattr(actor, "is_authenticated", False) else None


# --- submitting ------------------------------------------------------------------------------


def _parse_spec(spec: str | dict[str, Any], overrides: list[str] | None) -> tuple[str, RunSpec]:
    """The stored spec text and the validated RunSpec. Never reads files (unlike runtime.spec.load_spec)."""
    if isinstance(spec, dict):
        text = json.dumps(spec, indent=2)
        data = json.loads(text)
    elif isinstance(spec, str):
        if len(spec.encode()) > MAX_SPEC_BYTES:
            raise InvalidInput.one("spec", f"larger than {MAX_SPEC_BYTES // 1024} KiB")
        text = spec
        data = None
    else:
        raise InvalidInput.one("spec", "must be YAML/JSON text or a mapping")
    try:
        if data is None:
            data = parse_spec_text(text)
        apply_overrides(data, list(overrides or []))
        return text, validate_spec(data)
    except SpecError as exc:
        raise InvalidInput(exc.errors) from None


def check_fits(experiment: Experiment, parsed: RunSpec) -> None:
    """The spec's devices exist in the experiment's group and fit its quota (InvalidInput naming the field)."""
    group = experiment.group
    quota = experiment.quota
    resources = parsed.resources
    need = resources.total_devices
    errors = []
    kind = SPEC_DEVICE_TO_KIND[resources.device]
    if kind != group.kind:
        errors.append(
            {
                "field": "resources.device",
                "message": f"group {group.name} has {group.kind} devices, not {resources.device}",
            }
        )
    group_size = Device.objects.filter(host__group_id=group.pk).count()
    if need > group_size:
        errors.append(
            {
                "field": "resources",
                "message": f"request exceeds the whole group: needs {need} devices, group {group.name} has {group_size}",
            }
        )
    elif need > quota.max_devices:
        errors.append(
            {
                "field": "resources",
                "message": f"needs {need} devices; the experiment's quota allows {quota.max_devices}",
            }
        )
    if resources.all_rollout_workers > quota.max_rollout_workers:
        remote = resources.remote_rollout_workers
        errors.append(
            {
                "field": "resources.remote_rollout_workers" if remote else "resources.rollout_workers",
                "message": f"{resources.all_rollout_workers} exceeds the quota's {quota.max_rollout_workers} rollout workers"
                + (f" ({resources.rollout_workers} on the trainer's host + {remote} remote)" if remote else ""),
            }
        )
    if errors:
        raise InvalidInput(errors)


def _check_submit_args(submission_id, priority, name) -> None:
    errors = []
    if submission_id is not None and (not isinstance(submission_id, str) or not SUBMISSION_ID_RE.match(submission_id)):
        errors.append(
            {
                "field": "submission_id",
                "message": "1-128 characters: letters, digits and . _ : @ / + - (first alphanumeric)",
            }
        )
    if priority is not None and (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]
    ):
        errors.append(
            {"field": "priority", "message": f"must be an integer from {PRIORITY_RANGE[0]} to {PRIORITY_RANGE[1]}"}
        )
    if name is not None and (not isinstance(name, str) or not 1 <= len(name) <= 200):
        errors.append({"field": "name", "message": "1-200 characters"})
    if errors:
        raise InvalidInput(errors)


def _same_submission(run: Run, resolved: dict[str, Any], priority: int | None) -> Run:
    if run.resolved_spec != resolved or run.priority != priority:
        raise Conflict(f"submission_id {run.submission_id!r} was already used for run {run.pk} with a different spec")
    return run


def check_submission(
    experiment: Experiment,
    spec: str | dict[str, Any],
    *,
    submission_id: str | None = None,
    priority: int | None = None,
    name: str | None = None,
    overrides: list[str] | None = None,
    parent_checkpoint: str = "",
) -> tuple[str, RunSpec, dict[str, Any]]:
    """A submission's checks that read nothing stored: its arguments, the spec, the paths the experiment's team
    may read, then the files those paths name where the control plane sees them (jobs.spec_files). Returns the
    stored spec text, the validated spec and the resolved one; raises InvalidInput.
    (``check_fits`` follows; a submit looks for an earlier submission of the same id in between.)"""
    _check_submit_args(submission_id, priority, name)
    text, parsed = _parse_spec(spec, overrides)
    resolved = parsed.resolved()
    # Before anything else looks at a path: a refusal must not depend on whether the file exists.
    refused = confinement.refused_spec_paths(experiment.team, resolved, parent_checkpoint)
    if refused:
        raise InvalidInput(refused)
    file_problems = spec_files.spec_file_problems(experiment.team, parsed)
    if file_problems:
        raise InvalidInput(file_problems)
    return text, parsed, resolved


def submit_run(
    actor,
    experiment: Experiment,
    spec: str | dict[str, Any],
    *,
    submission_id: str | None = None,
    priority: int | None = None,
    name: str | None = None,
    overrides: list[str] | None = None,
    parent_checkpoint: str = "",
) -> tuple[Run, bool]:
    """Validate and queue a run, then run admission. Returns ``(run, created)``.

    With a ``submission_id`` already used in this experiment for the same spec
    and priority, returns that run and False (a CI retry); with a different
    spec raises Conflict. Bad input raises InvalidInput and writes nothing; a
    path the experiment's team may not read is bad input (jobs.confinement).
    """
    text, parsed, resolved = check_submission(
        experiment,
        spec,
        submission_id=submission_id,
        priority=priority,
        name=name,
        overrides=overrides,
        parent_checkpoint=parent_checkpoint,
    )
    if submission_id is not None:
        existing = Run.objects.filter(experiment=experiment, submission_id=submission_id).first()
        if existing is not None:
            return _same_submission(existing, resolved, priority), False
    check_fits(experiment, parsed)
    try:
        with transaction.atomic():
            run = Run.objects.create(
                experiment=experiment,
                name=name or parsed.name,
                spec=text,
                resolved_spec=resolved,
                state=RunState.QUEUED,
                reason=admission.WAITING_FOR_ADMISSION,
                priority=priority,
                submission_id=submission_id,
                devices_requested=parsed.resources.total_devices,
                rollout_workers=parsed.resources.all_rollout_workers,
                parent_checkpoint=parent_checkpoint or "",
                created_by=_user(actor),
            )
            alert_kinds.create_defaults(run)  # every run's default alert rules (README "Alerts")
    except IntegrityError:
        # A concurrent submit with the same submission_id won the insert.
        existing = Run.objects.filter(experiment=experiment, submission_id=submission_id).first()
        if submission_id is None or existing is None:
            raise
        return _same_submission(existing, resolved, priority), False
    admit_and_stream(experiment.group_id, also=[run.pk])  # the new run's first state entry, and the queue moved
    run.refresh_from_db()
    return run, True


def admit_and_stream(group_id: int, also: list[int] | tuple[int, ...] = ()) -> list[int]:
    """An admission pass over the group, then the live UI told what it changed (jobs.stream), the runs in
    ``also`` (new in the queue) among them; returns the admitted run ids."""
    with transaction.atomic():
        group = locks.lock_group(group_id)
        quotas = locks.lock_group_quotas(group_id)
        moved = _admit(group, quotas, timezone.now())
        stream.tell_changes(group_id, [*also, *moved.admitted], queue_moved=bool(also) or moved.moved_queue)
    return moved.admitted


def _admit(group: ResourceGroup, quotas: dict[int, Quota], now: datetime.datetime) -> admission.Pass:
    """An admission pass (the caller holds the locks of ``group`` and ``quotas``), and the launch of the runs
    it admitted requested for after commit."""
    moved = admission.admit_locked(group, quotas, now)
    request_launch(moved.admitted)
    return moved


# --- state changes -----------------------------------------------------------------------------


def transition(run: Run, target: RunState | str, reason: str = "") -> Run:
    """Move ``run`` to ``target`` (see jobs.states), releasing devices and admitting the next runs as needed.

    Raises IllegalTransition when the run's current state (re-read under the
    lock) does not allow the move, and ValueError when a QUEUED/FAILED/PREEMPTED
    move comes without a reason. ``run`` is refreshed in place and returned.
    """
    target = RunState(target)
    reason = (reason or "").strip()
    group_id = Experiment.objects.filter(pk=run.experiment_id).values_list("group_id", flat=True).get()
    with transaction.atomic():
        group = locks.lock_group(group_id)
        quotas = locks.lock_group_quotas(group_id)
        now = timezone.now()  # under the lock: release and admission times follow the lock order
        current = Run.objects.filter(pk=run.pk).values_list("state", flat=True).get()
        check_transition(run.pk, current, target, reason)
        fields: dict[str, Any] = {"state": target, "updated_at": now}
        fields["reason"] = reason if (target in REASON_REQUIRED or target in TERMINAL_STATES) else ""
        if target == RunState.RUNNING and run.started_at is None:
            fields["started_at"] = now
        if target in TERMINAL_STATES:
            fields["finished_at"] = now
        if target == RunState.QUEUED:
            fields.update(admitted_at=None, started_at=None, finished_at=None)
        # Conditional: zero rows means another actor moved it first (cannot happen under the lock; kept as a guard).
        if not Run.objects.filter(pk=run.pk, state=current).update(**fields):
            raise IllegalTransition(run.pk, current, target)
        releases = RunState(current) in ACTIVE_STATES and target not in ACTIVE_STATES
        if releases:
            accounting.release_run(run.pk, now)
        in_or_out = RunState.QUEUED in (RunState(current), target)  # it entered or left the queue
        moved = _admit(group, quotas, now) if releases or in_or_out else admission.Pass()
        if target in REVOKED_AT:  # the run ended: its tokens stop writing (jobs/ingest/tokens.py)
            revoke_run_tokens(run)
        stream.tell_changes(group_id, [run.pk, *moved.admitted], queue_moved=in_or_out or moved.moved_queue)
    run.refresh_from_db()
    return run


def cancel_run(actor, run: Run, reason: str | None = None) -> Run:
    """Cancel a queued or active run (audited); its devices go to the next runs."""
    who = actor.get_username() if getattr(actor, "is_authenticated", False) else "system"
    reason = (reason or "").strip() or f"cancelled by {who}"
    group_id = Experiment.objects.filter(pk=run.experiment_id).values_list("group_id", flat=True).get()
    with transaction.atomic():
        locks.lock_group(group_id)  # taken again by transition (same transaction): the state read here stays true
        before = {"state": Run.objects.filter(pk=run.pk).values_list("state", flat=True).get()}
        transition(run, RunState.CANCELLED, reason)
        audit.record(actor, "run.cancel", run, before, {"state": run.state, "reason": run.reason})
    return run


def finish_run(run: Run, state: RunState | str, reason: str = "") -> Run:
    """End a run as COMPLETED, FAILED, CANCELLED or PREEMPTED (reason required for FAILED/PREEMPTED)."""
    state = RunState(state)
    if state not in TERMINAL_STATES:
        raise ValueError(f"finish_run needs a terminal state, not {state}")
    return transition(run, state, reason)


def requeue_run(run: Run, reason: str = "requeued after preemption") -> Run:
    """Put a PREEMPTED run back in the queue; admission then sets its real reason."""
    return transition(run, RunState.QUEUED, reason)


def set_priority(actor, run: Run, priority: int | None) -> Run:
    """Change a run's priority (None: follow the quota's). Audited; the queue is re-ordered at once."""
    _check_submit_args(None, priority, None)
    group_id = run.experiment.group_id
    with transaction.atomic():
        group = locks.lock_group(group_id)
        quotas = locks.lock_group_quotas(group_id)
        old = Run.objects.filter(pk=run.pk).values_list("priority", flat=True).get()
        if old != priority:
            Run.objects.filter(pk=run.pk).update(priority=priority, updated_at=timezone.now())
            audit.record(actor, "run.priority", run, {"priority": old}, {"priority": priority})
            moved = _admit(group, quotas, timezone.now())
            queued = Run.objects.filter(pk=run.pk).queued().exists()  # a queued run's place may have changed
            stream.tell_changes(group_id, moved.admitted, queue_moved=queued or moved.moved_queue)
    run.refresh_from_db()
    return run


def queue_info(run: Run) -> dict[str, Any]:
    """State, reason and (when queued) 1-based position among the group's queued runs."""
    position = queue_order.position_of(run.pk, run.experiment.group_id) if run.state == RunState.QUEUED else None
    return {"state": run.state, "reason": run.reason, "queue_position": position}
