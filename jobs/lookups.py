"""Finding what a request names, among what the caller may use: team, resource group, experiment, quota.

The rules behind the REST API's writes, kept out of the views (which parse,
call and serialise). A name that finds nothing, or more than one thing, is an
``InvalidInput`` on the field that named it (a 400): objects of teams the
caller cannot see are simply not found.
"""

from __future__ import annotations

from jobs.handler import InvalidInput
from jobs.models import Experiment
from rlplatform import permissions as perms
from rlplatform.models import APIToken, Quota, ResourceGroup, Team


def pick_team(user, token: APIToken | None, team_id: int | None) -> Team:
    """The team a create acts in: the one named, else the token's, else the user's only team."""
    teams = perms.teams_for(user, token=token)
    if team_id is not None:
        team = teams.filter(pk=team_id).first()
        if team is None:
            raise InvalidInput.one("team", f"no team {team_id} among yours")
        return team
    candidates = list(teams[:2])
    if len(candidates) != 1:
        raise InvalidInput.one("team", "required: you belong to several teams (or none)")
    return candidates[0]


def visible_group(user, token: APIToken | None, ref: str) -> ResourceGroup:
    """A resource group granted to one of the caller's teams, by id or name."""
    groups = perms.groups_for(user, token)
    group = groups.filter(pk=int(ref)).first() if ref.isdigit() else None
    group = group or groups.filter(name=ref).first()
    if group is None:
        raise InvalidInput.one("group", f"no resource group {ref!r} available to your teams")
    return group


def team_quota(team: Team, quota_id: int) -> Quota:
    """One of ``team``'s quotas (an experiment may only draw on its own team's)."""
    quota = Quota.objects.filter(pk=quota_id, team=team).first()
    if quota is None:
        raise InvalidInput.one("quota", f"team {team.name} has no quota {quota_id}")
    return quota


def resolve_experiment(user, token: APIToken | None, ref: str, team_id: int | None) -> Experiment:
    """An experiment by id or name among the caller's teams; unknown or ambiguous is a 400 on `experiment`."""
    qs = Experiment.objects.filter(team__in=perms.teams_for(user, token=token)).select_related("team", "group", "quota")
    if team_id is not None:
        qs = qs.filter(team_id=team_id)
    ref = ref.strip()
    if ref.isdigit():
        by_id = qs.filter(pk=int(ref)).first()
        if by_id is not None:
            return by_id
    matches = list(qs.filter(name=ref)[:2])
    if not matches:
        raise InvalidInput.one("experiment", f"no experiment {ref!r} in your teams")
    if len(matches) > 1:
        raise InvalidInput.one(
            "experiment", f"{ref!r} names experiments in several of your teams: pass `team` or the experiment id"
        )
    return matches[0]


def granted_pair(team_id: int, group_id: int) -> tuple[Team, ResourceGroup]:
    """The team and resource group a new quota joins (any team: quotas are set by platform staff);
    the group must be granted to the team."""
    team = Team.objects.filter(pk=team_id).first()
    if team is None:
        raise InvalidInput.one("team", f"no team {team_id}")
    group = ResourceGroup.objects.filter(pk=group_id).first()
    if group is None:
        raise InvalidInput.one("group", f"no resource group {group_id}")
    if not group.teams.filter(pk=team.pk).exists():
        raise InvalidInput.one("group", f"resource group {group.name} is not granted to team {team.name}")
    return team, group
