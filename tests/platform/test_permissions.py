"""Roles: viewer < editor < admin; superusers admin everywhere; outsiders see nothing."""

import pytest

from rlplatform import permissions
from rlplatform.models import Role

pytestmark = pytest.mark.django_db


def test_roles_of_personas(owner, editor, viewer, outsider, superuser, team_a, team_b):
    assert [permissions.role_of(u, team_a) for u in (owner, editor, viewer, outsider, superuser)] == [
        Role.ADMIN,
        Role.EDITOR,
        Role.VIEWER,
        None,
        Role.ADMIN,
    ]
    table = {
        u.username: (permissions.can_view(u, team_a), permissions.can_edit(u, team_a), permissions.can_admin(u, team_a))
        for u in (owner, editor, viewer, outsider)
    }
    assert table == {
        "owner": (True, True, True),
        "editor": (True, True, False),
        "viewer": (True, False, False),
        "outsider": (False, False, False),
    }
    assert permissions.can_edit(outsider, team_b) is True


def test_team_and_group_visibility(owner, outsider, superuser, team_a, team_b, cpu_group, make_group):
    private = make_group("private", teams=[team_b])
    assert list(permissions.teams_for(owner)) == [team_a]
    assert list(permissions.teams_for(owner, minimum=Role.ADMIN)) == [team_a]
    assert list(permissions.teams_for(outsider)) == [team_b]
    assert set(permissions.groups_for(owner)) == {cpu_group}
    assert set(permissions.groups_for(outsider)) == {cpu_group, private}
    assert set(permissions.groups_for(superuser)) == {cpu_group, private}


def test_inactive_and_anonymous_users_have_no_role(owner, team_a):
    from django.contrib.auth.models import AnonymousUser

    assert permissions.role_of(AnonymousUser(), team_a) is None
    owner.is_active = False
    owner.save()
    assert permissions.role_of(owner, team_a) is None
    assert list(permissions.teams_for(owner)) == []


def test_only_staff_manage_groups(owner, superuser):
    assert permissions.can_manage_groups(owner) is False
    assert permissions.can_manage_groups(superuser) is True
