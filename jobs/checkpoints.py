"""The checkpoint browser: files of a checkpoint, safe file access, pin / unpin / delete, retention.

Every file listed, served or deleted must resolve (symlinks followed) to a path
inside its run's own directory, ``<TANDEM_CHECKPOINT_ROOT>/run-<id>``
(jobs.confinement); a checkpoint's path is taken relative to the root when it
is relative. Anything else — ``..``, an absolute path elsewhere, another run's
directory, a symlink pointing out — is treated as absent (the view answers 404;
retention and delete drop such a record but touch no file). Ingest refuses such
records; this guards rows stored before it did.

Retention (``apply_retention``, run by the periodic task): per run, keep what
the run's ``checkpoint`` policy keeps (``runtime.contract.retained``, the rule the
runtime rotates by outside the platform: the newest ``keep_last`` of its resolved
spec and the best by ``keep_best_metric``), every pinned one, and any a fork
started from or a pending rollback points at; delete the rest (record and files).
A managed run's runtime deletes nothing itself (runtime.managed.entry).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from django.db import transaction

from jobs import confinement, stream
from jobs.handler import Conflict
from jobs.models import CheckpointRecord, Command, CommandKind, CommandState, Run
from rlplatform import audit
from runtime.contract import retained

__all__ = ["CheckpointFileNotFound", "apply_retention", "delete", "file_path", "files", "set_pinned", "to_keep"]

log = logging.getLogger(__name__)
MAX_LISTED_FILES = 1000
AUDITED_FIELDS = ("run", "step", "path", "pinned")


class CheckpointFileNotFound(Exception):
    """No such file inside the checkpoint (also for any path that would leave the root): 404."""


def directory(record: CheckpointRecord) -> Path | None:
    """The checkpoint's directory, resolved; None when it lies outside its run's own directory."""
    return confinement.inside_run(record.run_id, record.path)


def checkpoint_dir_for_path(recorded: str) -> Path | None:
    """A checkpoint path as the runtime reported it, resolved; None when it lies outside the root.
    (A fork's parent: confined to the team's runs when the fork was submitted, jobs.confinement.)"""
    base = confinement.checkpoint_root()
    path = (base / recorded).resolve()  # an absolute path replaces base, then must still be inside it
    return path if path.is_relative_to(base) else None


def file_path(record: CheckpointRecord, relative: str) -> Path:
    """The file ``relative`` of the checkpoint, guaranteed inside both the checkpoint and its run's directory."""
    ckpt = directory(record)
    if ckpt is None or not relative or "\x00" in relative or Path(relative).is_absolute():
        raise CheckpointFileNotFound(relative)
    path = (ckpt / relative).resolve()
    if not path.is_relative_to(ckpt) or not path.is_relative_to(confinement.checkpoint_root()) or not path.is_file():
        raise CheckpointFileNotFound(relative)
    return path


def files(record: CheckpointRecord) -> list[dict[str, Any]]:
    """``[{"path": relative, "size": bytes}]`` of the checkpoint's files (none if missing or outside its run)."""
    ckpt = directory(record)
    if ckpt is None or not ckpt.is_dir():
        return []
    out = []
    for path in sorted(ckpt.rglob("*")):
        if len(out) >= MAX_LISTED_FILES:
            break
        resolved = path.resolve()
        if path.is_file() and resolved.is_relative_to(ckpt):  # a symlink out is not listed (nor served)
            out.append({"path": path.relative_to(ckpt).as_posix(), "size": path.stat().st_size})
    return out


def set_pinned(actor, record: CheckpointRecord, pinned: bool) -> CheckpointRecord:
    """Pin (kept by retention, not deletable) or unpin. Audited."""
    with transaction.atomic():
        locked = CheckpointRecord.objects.select_for_update().get(pk=record.pk)
        if locked.pinned != pinned:
            before = audit.snapshot(locked, AUDITED_FIELDS)
            locked.pinned = pinned
            locked.save(update_fields=["pinned"])
            action = "checkpoint.pin" if pinned else "checkpoint.unpin"
            audit.record(actor, action, locked, before, audit.snapshot(locked, AUDITED_FIELDS), team=_team(locked))
    record.refresh_from_db()
    return record


def delete(actor, record: CheckpointRecord) -> None:
    """Delete the checkpoint's record and its directory (only inside its run's). Pinned: Conflict. Audited."""
    with transaction.atomic():
        locked = CheckpointRecord.objects.select_for_update().filter(pk=record.pk).first()
        if locked is None:
            return
        if locked.pinned:
            raise Conflict(f"checkpoint {locked.pk} is pinned; unpin it first")
        _delete_locked(actor, locked)


def _delete_locked(actor, record: CheckpointRecord) -> None:
    ckpt = directory(record)
    before = audit.snapshot(record, AUDITED_FIELDS)
    audit.record(actor, "checkpoint.delete", record, before, None, team=_team(record))
    record.delete()
    if ckpt is not None and ckpt != confinement.run_directory(record.run_id):
        # After commit: a rolled-back delete must not have lost the files.
        transaction.on_commit(lambda: shutil.rmtree(ckpt, ignore_errors=True))
    stream.append(record.run_id, "event", {"kind": "checkpoint_deleted", "payload": {"step": record.step}})


def _team(record: CheckpointRecord) -> int:
    return Run.objects.filter(pk=record.run_id).values_list("experiment__team_id", flat=True).get()


def to_keep(run: Run, records: list[CheckpointRecord]) -> set[int]:
    """Ids of the run's checkpoints the retention policy keeps (see the module docstring)."""
    policy = (run.resolved_spec or {}).get("checkpoint", {})
    by_age = sorted(records, key=lambda r: r.pk)  # among equal steps the later record is the newer
    keep = retained(
        ((r.pk, r.step, r.metrics or {}) for r in by_age),
        int(policy.get("keep_last") or 3),
        policy.get("keep_best_metric") or None,
        policy.get("keep_best_mode", "max"),
    )
    keep |= {r.pk for r in records if r.pinned}
    paths_in_use = set(
        Run.objects.filter(parent_checkpoint__in=[r.path for r in records]).values_list("parent_checkpoint", flat=True)
    )
    pending = Command.objects.filter(
        run=run, kind=CommandKind.ROLLBACK, state__in=[CommandState.PENDING, CommandState.DELIVERED]
    ).values_list("args", flat=True)
    rollback_targets = {a.get("checkpoint") for a in pending}
    keep |= {r.pk for r in records if r.path in paths_in_use or r.pk in rollback_targets}
    return keep


def apply_retention(run: Run) -> list[int]:
    """Delete the run's checkpoints the policy does not keep; returns the deleted ids."""
    with transaction.atomic():
        records = list(CheckpointRecord.objects.select_for_update().filter(run=run).order_by("pk"))
        keep = to_keep(run, records)
        deleted = []
        for record in records:
            if record.pk not in keep:
                deleted.append(record.pk)
                _delete_locked(None, record)
    return deleted
