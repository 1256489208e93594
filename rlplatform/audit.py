"""The audit trail: one row per change of a quota, priority, membership or token, and per cancel.

Call ``record`` explicitly where the change happens (handlers and admin), in
the same transaction as the change, so a rolled-back change leaves no row.
"""

from __future__ import annotations

import datetime
import decimal
from typing import Any

from django.db import models

from rlplatform.models import AuditLog, Team


def snapshot(instance: models.Model, fields: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """The named fields of ``instance`` as JSON-compatible values (foreign keys by id)."""
    data: dict[str, Any] = {}
    for name in fields:
        field = instance._meta.get_field(name)
        value = getattr(instance, field.attname)
        data[name] = _jsonable(value)
    return data


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime.datetime | datetime.date):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return float(value)
    return value


def _team_of(target: models.Model | None) -> Team | int | None:
    if target is None:
        return None
    if isinstance(target, Team):
        return target
    if getattr(target, "team_id", None) is not None:
        return target.team_id
    experiment = getattr(target, "experiment", None)  # a Run
    if experiment is not None:
        return experiment.team_id
    return None


def record(
    actor,
    action: str,
    target: models.Model,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
    *,
    team: Team | None = None,
) -> AuditLog:
    """Write one audit row. ``actor`` is a user or None for the system; ``team`` defaults to the target's."""
    actor_obj = actor if getattr(actor, "is_authenticated", False) else None
    team_ref = team if team is not None else _team_of(target)
    return AuditLog.objects.create(
        actor=actor_obj,
        actor_name=actor_obj.get_username() if actor_obj else "system",
        team_id=team_ref.pk if isinstance(team_ref, Team) else team_ref,
        action=action,
        target_type=target._meta.label_lower,
        target_id=str(target.pk),
        target_repr=str(target)[:200],
        before=before,
        after=after,
    )
