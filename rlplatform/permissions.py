"""Who may do what within a team.

Roles rank viewer < editor < admin: viewers read, editors also submit and
cancel runs and create experiments, admins also manage members, tokens and
quotas. Superusers act as admin of every team. An API token acts as its user
but only inside its own team: pass it as ``token`` and every other team is
invisible.
"""

from __future__ import annotations

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
