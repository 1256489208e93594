"""Adding, changing and removing team members — always audited.

Every change also tells the member's open live-UI sockets (the channel group
``access_group(user)``) to re-check their access at once, after commit: a
removed member's socket closes instead of streaming on (jobs.consumers).
"""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

from rlplatform import audit, locks
from rlplatform.models import Membership, Role, Team

AUDITED_FIELDS = ("team", "user", "role")
ACCESS_CHANGED = "access.changed"  # the message type; the consumers' handler is ``access_changed``

log = logging.getLogger(__name__)


def access_group(user_id: int) -> str:
    """The channel group every open live-UI socket of the user joins."""
    return f"user.{user_id}"


def notify_access_changed(user_id: int) -> None:
    """Once the current transaction commits, ask the user's open sockets to re-check their access."""
    transaction.on_commit(lambda: _send_access_changed(user_id))


def _send_access_changed(user_id: int) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(access_group(user_id), {"type": ACCESS_CHANGED})
    except Exception:  # a channel-layer outage must not fail the committed change; the sockets' timer catches it
        log.warning("could not tell user %s's sockets to re-check their access", user_id, exc_info=True)


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
            notify_access_changed(user.pk)
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
        notify_access_changed(user.pk)
        return True
