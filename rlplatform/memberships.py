"""Adding, changing and removing team members — always audited."""

from __future__ import annotations

from django.db import transaction

from rlplatform import audit, locks
from rlplatform.models import Membership, Role, Team

AUDITED_FIELDS = ("team", "user", "role")


class MembershipError(ValueError):
    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


def _check_role(role: str) -> Role:
    try:
        return Role(role)
    except ValueError:
        raise MembershipError("role", f"unknown role {role!r} (use viewer, editor or admin)") from None


def set_member(team: Team, user, role: str, actor=None) -> Membership:
    """Add ``user`` to ``team`` with ``role``, or change their role. Audited when something changed."""
    role = _check_role(role)
    with transaction.atomic():
        membership = locks.lock_membership(team.pk, user.pk)
        if membership is None:
            membership = Membership.objects.create(team=team, user=user, role=role)
            audit.record(actor, "membership.create", membership, None, audit.snapshot(membership, AUDITED_FIELDS))
        elif membership.role != role:
            before = audit.snapshot(membership, AUDITED_FIELDS)
            membership.role = role
            membership.save(update_fields=["role"])
            audit.record(actor, "membership.update", membership, before, audit.snapshot(membership, AUDITED_FIELDS))
        return membership


def remove_member(team: Team, user, actor=None) -> bool:
    """Remove ``user`` from ``team``; False if they were not a member. Their tokens for the team stop working."""
    with transaction.atomic():
        membership = locks.lock_membership(team.pk, user.pk)
        if membership is None:
            return False
        before = audit.snapshot(membership, AUDITED_FIELDS)
        audit.record(actor, "membership.delete", membership, before, None, team=team)
        membership.delete()
        return True
