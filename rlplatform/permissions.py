"""Who may do what within a team.

Roles rank viewer < editor < admin: viewers read, editors also submit and
cancel runs and create experiments, admins also manage members, tokens and
quotas. Superusers act as admin of every team. An API token acts as its user
but only inside its own team: pass it as ``token`` and every other team is
invisible.

An open live-UI socket was authorised when it connected; ``recheck_socket``
decides whether it may stay open now (jobs.consumers asks when the user's
memberships change and on a timer).
"""

from __future__ import annotations

from collections.abc import Collection
from enum import StrEnum

from django.contrib.auth import get_user_model
from django.db.models import QuerySet

from rlplatform.models import ROLE_RANK, APIToken, Membership, ResourceGroup, Role, Team


def role_of(user, team: Team | int, token: APIToken | None = None) -> Role | None:
    """The user's role in ``team`` (None: no access)."""
    team_id = team if isinstance(team, int) else team.pk
    if user is None or not getattr(user, "is_authenticated", False) or not user.is_active:
        return None
    if token is not None and token.team_id != team_id:
        return None
    if user.is_superuser:
        return Role.ADMIN
    role = Membership.objects.filter(team_id=team_id, user=user).values_list("role", flat=True).first()
    return Role(role) if role else None


def has_role(user, team: Team | int, minimum: Role, token: APIToken | None = None) -> bool:
    role = role_of(user, team, token)
    return role is not None and ROLE_RANK[role] >= ROLE_RANK[minimum]


def can_view(user, team: Team | int, token: APIToken | None = None) -> bool:
    return has_role(user, team, Role.VIEWER, token)


def can_edit(user, team: Team | int, token: APIToken | None = None) -> bool:
    return has_role(user, team, Role.EDITOR, token)


def can_admin(user, team: Team | int, token: APIToken | None = None) -> bool:
    return has_role(user, team, Role.ADMIN, token)


def teams_for(user, minimum: Role = Role.VIEWER, token: APIToken | None = None) -> QuerySet[Team]:
    """Teams where the user holds at least ``minimum`` (for filtering list views)."""
    if user is None or not getattr(user, "is_authenticated", False) or not user.is_active:
        return Team.objects.none()
    teams = Team.objects.all()
    if token is not None:
        teams = teams.filter(pk=token.team_id)
    if user.is_superuser:
        return teams
    allowed = [role for role, rank in ROLE_RANK.items() if rank >= ROLE_RANK[minimum]]
    return teams.filter(memberships__user=user, memberships__role__in=allowed).distinct()


def groups_for(user, token: APIToken | None = None) -> QuerySet[ResourceGroup]:
    """Resource groups the user can see: those granted to one of their teams (all, for superusers)."""
    if user is None or not getattr(user, "is_authenticated", False) or not user.is_active:
        return ResourceGroup.objects.none()
    if user.is_superuser and token is None:
        return ResourceGroup.objects.all()
    return ResourceGroup.objects.filter(teams__in=teams_for(user, token=token)).distinct()


def can_manage_groups(user, token: APIToken | None = None) -> bool:
    """Resource groups, hosts and devices are cluster-wide: only platform staff change them."""
    if user is None or not getattr(user, "is_authenticated", False) or not user.is_active:
        return False
    return token is None and (user.is_superuser or user.is_staff)


class SocketAccess(StrEnum):
    """A re-check of an open socket: keep it, or why it must close."""

    KEEP = "keep"
    SIGNED_OUT = "signed_out"  # the user was deleted or deactivated
    LOST_TEAM = "lost_team"  # the user no longer sees a team whose data the socket shows


def recheck_socket(user_id: int, team_ids: Collection[int]) -> SocketAccess:
    """Whether a socket of ``user_id`` showing ``team_ids``' data may stay open, from fresh rows (the
    socket's own user object is as old as the socket)."""
    user = get_user_model().objects.filter(pk=user_id).first()
    if user is None or not user.is_active:
        return SocketAccess.SIGNED_OUT
    wanted = set(team_ids)
    seen = set(teams_for(user).filter(pk__in=wanted).values_list("pk", flat=True))
    return SocketAccess.KEEP if seen == wanted else SocketAccess.LOST_TEAM
