"""Ingest logic: validate a runtime's batch, store it idempotently in bulk, hand back pending commands.

Every function takes the authenticated RunToken: writes go to its run and
attempt only. A batch is validated completely before anything is written, so a
malformed batch stores nothing (InvalidInput, 400, naming the field such as
``points[3].step``); a body naming another run or attempt raises WrongRun (403).

Idempotency keys: metric values (run, attempt, step, metric) — a replayed
step merges only keys it did not have, the first value of a key wins; events
(run, attempt, role, seq); checkpoints (run, path); heartbeats (run, role,
attempt). Metric points of a batch go to the database in one statement.
"""

from __future__ import annotations

import datetime
import json
import math
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from django.db import transaction
from django.utils import timezone

from jobs import commands, confinement, series_store, sql, stream
from jobs.alerts import evaluate as alerts
from jobs.handler import IllegalTransition, InvalidInput, transition
from jobs.models import CheckpointRecord, RoleHeartbeat, Run, RunEvent, RunToken
from jobs.states import RunState
from runtime.contract import (
    EVENT_CHECKPOINT,
    EVENT_RESUME,
    EVENT_ROLLBACK,
    INT_RANGE,
    MAX_ROLE_NAME,
    MAX_STEP,
    TRAINER_ROLE,
    read_batch,
)

# A batch's limits are the contract's (runtime.contract.IngestBatch); TRAINER_ROLE is the one role whose
# heartbeats take commands.
MAX_ROLE = MAX_ROLE_NAME
MAX_ERRORS = 20  # reported per bad batch; the rest is noise


class WrongRun(Exception):
    """The body names a run or attempt other than the token's (403)."""


@dataclass
class Batch:
    role: str = ""
    points: dict[int, tuple[float, dict[str, Any]]] = field(default_factory=dict)  # step -> (time, metrics)
    events: list[dict[str, Any]] = field(default_factory=list)


class _Errors:
    def __init__(self):
        self.items: list[dict[str, str]] = []

    def add(self, where: str, message: str) -> None:
        if len(self.items) < MAX_ERRORS:
            self.items.append({"field": where, "message": message})

    def raise_any(self) -> None:
        if self.items:
            raise InvalidInput(self.items)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return _is_int(value) and INT_RANGE[0] <= value <= INT_RANGE[1]


def _has_nul(value: Any) -> bool:
    """PostgreSQL text and jsonb cannot hold U+0000; refuse it as bad input instead of failing the insert."""
    if isinstance(value, str):
        return "\x00" in value
    return "\\u0000" in json.dumps(value)


def _check_scope(token: RunToken, body: dict[str, Any], errors: _Errors) -> None:
    """``run`` and ``attempt`` in a body are optional; when present they must be the token's."""
    run = body.get("run")
    if run not in (None, "") and str(run) != str(token.run_id):
        raise WrongRun(f"this token writes to run {token.run_id}, not run {run}")
    attempt = body.get("attempt")
    if attempt is not None:
        if not _is_int(attempt) or attempt < 0:
            errors.add("attempt", "must be a non-negative integer")
        elif attempt != token.attempt:
            raise WrongRun(f"this token writes to attempt {token.attempt} of run {token.run_id}, not attempt {attempt}")


def _role(body: dict[str, Any], errors: _Errors, *, required: bool = False) -> str:
    role = body.get("role", "")
    if role is None:
        role = ""
    if not isinstance(role, str) or len(role) > MAX_ROLE or (required and not role.strip()) or _has_nul(role):
        errors.add("role", f"must be a string of {'1' if required else '0'} to {MAX_ROLE} characters")
        return ""
    return role.strip()


def parse_batch(token: RunToken, body: Any) -> Batch:
    """Validate a reporter body ``{run, attempt, role, points: [...], events: [...]}`` against the contract's
    schema (runtime.contract.IngestBatch), then what only the platform knows: the token's run and attempt,
    and that the checkpoint paths events record lie inside the run's directory."""
    if not isinstance(body, dict):
        raise InvalidInput.one("body", "must be a JSON object")
    errors = _Errors()
    _check_scope(token, body, errors)
    scope_problems = {e["field"] for e in errors.items}  # a bad attempt, named once
    parsed, problems = read_batch(body)
    for problem in problems:
        if problem["field"] not in scope_problems:
            errors.add(problem["field"], problem["message"])
    if parsed is None:
        errors.raise_any()
    now = timezone.now().timestamp()
    batch = Batch(role=parsed.role)
    for point in parsed.points:
        # The same step twice in one batch (two reporters' records, or a retry glued on): merge, first value wins.
        earlier = batch.points.get(point.step)
        if earlier is None:
            batch.points[point.step] = (now if point.time is None else float(point.time), point.metrics)
        else:
            for name, value in point.metrics.items():
                earlier[1].setdefault(name, value)
    for i, event in enumerate(parsed.events):
        _check_checkpoint_paths(token, event.kind, event.payload, f"events[{i}].payload", errors)
        when = now if event.time is None else float(event.time)
        batch.events.append({"seq": event.seq, "kind": event.kind, "payload": event.payload, "time": when})
    errors.raise_any()
    return batch


def _dt(ts: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC)


def store_points(token: RunToken, points: dict[int, tuple[float, dict[str, Any]]]) -> dict[str, int]:
    """Upsert the points (jobs.sql.upsert_metric_points, one statement on PostgreSQL); returns counts of rows
    inserted, merged (new keys) and unchanged (pure replays)."""
    return _store_points(token, points)[0]


def _store_points(token: RunToken, points: dict[int, tuple[float, dict[str, Any]]]) -> tuple[dict[str, int], list]:
    """``store_points``, and the rows it wrote (jobs.sql.upsert_metric_points': a pure replay writes none)."""
    if not points:
        return {"inserted": 0, "merged": 0, "unchanged": 0}, []
    written = sql.upsert_metric_points(token.run_id, token.attempt, points)
    series_store.add_points(token.run_id, token.attempt, written, points)  # the chart-data store follows
    inserted = sum(row[3] for row in written)
    counts = {"inserted": inserted, "merged": len(written) - inserted, "unchanged": len(points) - len(written)}
    return counts, written


def _check_checkpoint_paths(token: RunToken, kind: Any, payload: dict[str, Any], where: str, errors: _Errors) -> None:
    """The checkpoint paths an event would record (``checkpoint``: path; ``rollback``: set_aside) must lie
    inside the run's own directory (jobs.confinement): a refused one fails the whole batch."""
    if kind == EVENT_CHECKPOINT and isinstance(payload.get("path"), str) and payload["path"]:
        if confinement.inside_run(token.run_id, payload["path"][:500]) is None:  # as _checkpoint_from_event stores it
            errors.add(f"{where}.path", confinement.OUTSIDE_RUN)
    moved = payload.get("set_aside") if kind == EVENT_ROLLBACK else None
    for i, new_path in enumerate(moved if isinstance(moved, list) else []):
        if isinstance(new_path, str) and new_path and confinement.inside_run(token.run_id, new_path) is None:
            errors.add(f"{where}.set_aside[{i}]", confinement.OUTSIDE_RUN)


def _checkpoint_from_event(token: RunToken, event: dict[str, Any]) -> CheckpointRecord | None:
    """The runtime's ``checkpoint`` event ({step, path, ...}) also registers the checkpoint."""
    payload = event["payload"]
    step, path = payload.get("step"), payload.get("path")
    if event["kind"] != EVENT_CHECKPOINT or not _is_int(step) or step < 0 or not isinstance(path, str) or not path:
        return None
    version = payload.get("weight_version")
    size = payload.get("size")
    metrics = payload.get("metrics")
    return CheckpointRecord(
        run_id=token.run_id,
        attempt=token.attempt,
        step=step,
        path=path[:500],
        weight_version=version if _is_int(version) else None,
        size=size if _is_int(size) and size >= 0 else None,
        metrics=metrics if isinstance(metrics, dict) else {},
        created=_dt(event["time"]),
    )


def ingest_batch(token: RunToken, body: Any, *, deliver_commands: bool = True) -> dict[str, Any]:
    """Store a reporter batch; return the reply: what was stored and the commands to deliver (none when
    ``deliver_commands`` is off: the platform replaying an ended role's spool has nobody to give them to)."""
    batch = parse_batch(token, body)
    with transaction.atomic():
        counts, written = _store_points(token, batch.points)
        # Alert rules over the steps this batch wrote (a replay wrote none); never fails the batch.
        alerts.on_points(token.run, [(step, batch.points[step][1]) for step in sorted(row[1] for row in written)])
        new_events: list[dict[str, Any]] = []
        new_checkpoints: list[CheckpointRecord] = []
        if batch.events:
            # Replayed events are stored once (ignore_conflicts) and must reach the stream once too.
            seen = set(
                RunEvent.objects.filter(
                    run_id=token.run_id,
                    attempt=token.attempt,
                    role=batch.role,
                    seq__in=[e["seq"] for e in batch.events],
                ).values_list("seq", flat=True)
            )
            new_events = [e for e in batch.events if e["seq"] not in seen]
            _rewind_earlier_attempts(token, new_events)
            _follow_set_aside_checkpoints(token, new_events)
            RunEvent.objects.bulk_create(
                [
                    RunEvent(
                        run_id=token.run_id,
                        attempt=token.attempt,
                        role=batch.role,
                        seq=e["seq"],
                        kind=e["kind"],
                        payload=e["payload"],
                        time=_dt(e["time"]),
                    )
                    for e in batch.events
                ],
                ignore_conflicts=True,
            )
            checkpoints = [c for c in (_checkpoint_from_event(token, e) for e in batch.events) if c is not None]
            if checkpoints:
                paths = [c.path for c in checkpoints]
                known = set(
                    CheckpointRecord.objects.filter(run_id=token.run_id, path__in=paths).values_list("path", flat=True)
                )
                CheckpointRecord.objects.bulk_create(checkpoints, ignore_conflicts=True)
                fresh = [p for p in paths if p not in known]
                new_checkpoints = list(CheckpointRecord.objects.filter(run_id=token.run_id, path__in=fresh))
        _stream_batch(token, batch, counts, new_events, new_checkpoints)
        delivered = commands.deliver(token.run_id) if deliver_commands else []
    return {"points": counts, "events": len(batch.events), "commands": delivered}


def _stream_batch(token, batch: Batch, counts: dict[str, int], events, checkpoints) -> None:
    """What the batch changed, for the live UI (jobs.stream); a pure replay appends nothing."""
    entries: list[tuple[str, dict[str, Any]]] = []
    if counts["inserted"] or counts["merged"]:
        points = [{"step": s, "time": t, "values": m} for s, (t, m) in sorted(batch.points.items())]
        entries.append(("metrics", {"attempt": token.attempt, "points": points}))
        newest = points[-1]
        stream.send_key_metrics(token.run_id, token.run.experiment.team_id, newest["step"], newest["values"])
    for e in events:
        entries.append(("event", {"kind": e["kind"], "payload": e["payload"], "role": batch.role, "time": e["time"]}))
    for record in checkpoints:
        entries.append(("checkpoint", checkpoint_entry(record)))
    stream.append_many(token.run_id, entries)


def checkpoint_entry(record: CheckpointRecord) -> dict[str, Any]:
    return {
        "id": record.pk,
        "step": record.step,
        "weight_version": record.weight_version,
        "size": record.size,
        "metrics": record.metrics,
    }


def register_checkpoint(token: RunToken, body: Any) -> dict[str, Any]:
    """``{step, path, weight_version?, size?, metrics?}``; re-registering a path updates its record."""
    if not isinstance(body, dict):
        raise InvalidInput.one("body", "must be a JSON object")
    errors = _Errors()
    _check_scope(token, body, errors)
    step, path = body.get("step"), body.get("path")
    version, size, metrics = body.get("weight_version"), body.get("size"), body.get("metrics", {})
    if not _is_int(step) or not 0 <= step <= MAX_STEP:
        errors.add("step", "must be a non-negative integer")
    if not isinstance(path, str) or not 1 <= len(path) <= 500 or _has_nul(path):
        errors.add("path", "must be a string of 1 to 500 characters")
    elif confinement.inside_run(token.run_id, path) is None:
        errors.add("path", confinement.OUTSIDE_RUN)
    if version is not None and (not _is_int(version) or version < 0):
        errors.add("weight_version", "must be a non-negative integer or null")
    if size is not None and (not _is_int(size) or size < 0):
        errors.add("size", "must be a number of bytes or null")
    if metrics is None:
        metrics = {}
    if (
        not isinstance(metrics, dict)
        or _has_nul(metrics)
        or any(v is not None and not _is_number(v) for v in metrics.values())
    ):
        errors.add("metrics", "must be an object of name: number")
    errors.raise_any()
    with transaction.atomic():
        CheckpointRecord.objects.bulk_create(
            [
                CheckpointRecord(
                    run_id=token.run_id,
                    attempt=token.attempt,
                    step=step,
                    path=path,
                    weight_version=version,
                    size=size,
                    metrics=metrics,
                )
            ],
            update_conflicts=True,
            unique_fields=["run", "path"],
            update_fields=["attempt", "step", "weight_version", "size", "metrics"],
        )
        record = CheckpointRecord.objects.get(run_id=token.run_id, path=path)
        stream.append(token.run_id, "checkpoint", checkpoint_entry(record))
        delivered = commands.deliver(token.run_id)
    return {"checkpoint": record.pk, "commands": delivered}


def heartbeat(token: RunToken, body: Any) -> dict[str, Any]:
    """``{role, status?, info?}``: the role is alive now; the reply to the trainer role carries pending
    commands (other roles' replies none)."""
    if not isinstance(body, dict):
        raise InvalidInput.one("body", "must be a JSON object")
    errors = _Errors()
    _check_scope(token, body, errors)
    role = _role(body, errors, required=True)
    status = body.get("status", "running")
    info = body.get("info", {})
    if not isinstance(status, str) or not 1 <= len(status) <= 40 or _has_nul(status):
        errors.add("status", "must be a string of 1 to 40 characters")
    if info is None:
        info = {}
    if not isinstance(info, dict) or _has_nul(info):
        errors.add("info", "must be an object (no NUL characters)")
    errors.raise_any()
    now = timezone.now()
    with transaction.atomic():
        previous = (
            RoleHeartbeat.objects.filter(run_id=token.run_id, role=role, attempt=token.attempt)
            .values_list("status", flat=True)
            .first()
        )
        RoleHeartbeat.objects.bulk_create(
            [
                RoleHeartbeat(
                    run_id=token.run_id,
                    role=role,
                    attempt=token.attempt,
                    status=status,
                    info=info,
                    first_seen=now,
                    last_seen=now,
                )
            ],
            update_conflicts=True,
            unique_fields=["run", "role", "attempt"],
            update_fields=["status", "info", "last_seen"],
        )
        if previous != status:
            # Only news goes to the stream (a role appears or changes status); the roles API has last_seen.
            host = info.get("host") if isinstance(info.get("host"), str) else ""
            stream.append(
                token.run_id,
                "role",
                {"role": role, "status": status, "host": host, "attempt": token.attempt, "last_seen": now.timestamp()},
            )
            if status == "running":
                _mark_running(token.run_id)
        # Only the trainer applies commands: delivering one to another role (a remote rollout instance,
        # which ignores them) would mark it delivered, and the trainer would not see it until redelivery.
        delivered = commands.deliver(token.run_id) if role == TRAINER_ROLE else []
    return {"commands": delivered}


def _mark_running(run_id: int) -> None:
    """A role reports it is running: a STARTING run is RUNNING from now on (any other state stays)."""
    run = Run.objects.filter(pk=run_id, state=RunState.STARTING).first()
    if run is not None:
        try:
            transition(run, RunState.RUNNING)
        except IllegalTransition:
            pass  # moved meanwhile (cancelled): that state stands


def _follow_set_aside_checkpoints(token: RunToken, events: list[dict[str, Any]]) -> None:
    """A rollback moves the abandoned timeline's checkpoints to ``checkpoints/rewound/<n>-to-<step>/``
    (payload ``set_aside``: the new paths): their records follow, so browsing and downloads still work."""
    for event in events:
        moved = event["payload"].get("set_aside") if event["kind"] == EVENT_ROLLBACK else None
        if not isinstance(moved, list):
            continue
        for new_path in moved:
            if not isinstance(new_path, str) or not new_path or len(new_path) > 500 or _has_nul(new_path):
                continue
            old_path = str(PurePosixPath(new_path).parents[2] / PurePosixPath(new_path).name)
            CheckpointRecord.objects.filter(run_id=token.run_id, path=old_path).update(path=new_path)


def _rewind_earlier_attempts(token: RunToken, events: list[dict[str, Any]]) -> None:
    """A restarted attempt resumed from step S: the earlier attempts' points after S are rewound (kept,
    hidden by default), since the steps after S are being run again."""
    for event in events:
        step = event["payload"].get("step")
        if event["kind"] == EVENT_RESUME and _is_int(step) and step >= 0 and token.attempt > 0:
            rewound = series_store.rewind(token.run_id, step, before_attempt=token.attempt)
            if rewound:
                stream.append(token.run_id, "rewound", {"after_step": step})


def command_result(token: RunToken, body: Any) -> dict[str, Any]:
    """``{command: id, state: done | failed, message?}``: the runtime acknowledges a command."""
    if not isinstance(body, dict):
        raise InvalidInput.one("body", "must be a JSON object")
    errors = _Errors()
    _check_scope(token, body, errors)
    command_id, state, message = body.get("command"), body.get("state"), body.get("message", "")
    if not _is_int(command_id) or command_id <= 0:
        errors.add("command", "must be a command id")
    if state not in commands.RESULT_STATES:
        errors.add("state", f"must be one of {', '.join(commands.RESULT_STATES)}")
    if message is None:
        message = ""
    if not isinstance(message, str) or len(message) > 10_000 or _has_nul(message):
        errors.add("message", "must be a string of at most 10000 characters")
    errors.raise_any()
    command = commands.complete(token.run_id, command_id, state, message)
    return {"command": command.pk, "state": command.state, "commands": commands.deliver(token.run_id)}
