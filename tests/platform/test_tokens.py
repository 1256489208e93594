"""API tokens: shown once, hashed at rest, expiring, revocable, scoped to a team."""

import datetime

import pytest
from django.utils import timezone

from rlplatform import permissions, tokens
from rlplatform.memberships import remove_member
from rlplatform.models import APIToken, AuditLog

pytestmark = pytest.mark.django_db


def test_mint_returns_plaintext_once_and_stores_only_a_hash(owner, team_a):
    token, raw = tokens.mint(owner, team_a, "ci")
    assert raw.startswith(f"tdm_{token.prefix}_")
    stored = APIToken.objects.values().get(pk=token.pk)
    assert raw not in str(stored)
    assert stored["token_hash"] == tokens.hash_token(raw)
    assert token.expires_at - token.created_at == datetime.timedelta(days=90)
    assert tokens.authenticate_token(raw) == token


def test_authenticate_updates_last_used(owner, team_a):
    token, raw = tokens.mint(owner, team_a, "ci")
    assert token.last_used_at is None
    found = tokens.authenticate_token(raw)
    assert found.last_used_at is not None
    assert APIToken.objects.get(pk=token.pk).last_used_at == found.last_used_at


@pytest.mark.parametrize(
    "mangle",
    [
        lambda raw: raw[:-1] + ("A" if raw[-1] != "A" else "B"),  # wrong secret
        lambda raw: "tdm_00000000_" + raw.split("_", 2)[2],  # unknown prefix
        lambda raw: raw.replace("tdm_", "xyz_"),
        lambda raw: "",
        lambda raw: "tdm_short",
    ],
)
def test_wrong_tokens_are_rejected(owner, team_a, mangle):
    _, raw = tokens.mint(owner, team_a, "ci")
    assert tokens.authenticate_token(mangle(raw)) is None


def test_expired_token_is_rejected(owner, team_a):
    token, raw = tokens.mint(owner, team_a, "ci", ttl=datetime.timedelta(hours=1))
    APIToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - datetime.timedelta(seconds=1))
    assert tokens.authenticate_token(raw) is None


def test_revoked_token_is_rejected_and_revocation_is_audited(owner, team_a, editor):
    token, raw = tokens.mint(editor, team_a, "ci")
    assert tokens.revoke(token, actor=owner) is True
    assert tokens.authenticate_token(raw) is None
    assert tokens.revoke(token, actor=owner) is False  # already revoked: no second audit row
    entries = list(AuditLog.objects.filter(action="token.revoke"))
    assert len(entries) == 1
    assert (entries[0].actor, entries[0].team, entries[0].before["revoked_at"]) == (owner, team_a, None)
    assert entries[0].after["revoked_at"] is not None


def test_token_stops_working_when_its_user_leaves_the_team(owner, editor, team_a):
    _, raw = tokens.mint(editor, team_a, "ci")
    remove_member(team_a, editor, actor=owner)
    assert tokens.authenticate_token(raw) is None


def test_token_of_an_inactive_user_is_rejected(editor, team_a):
    _, raw = tokens.mint(editor, team_a, "ci")
    editor.is_active = False
    editor.save()
    assert tokens.authenticate_token(raw) is None


def test_mint_refuses_bad_input_and_writes_nothing(outsider, team_a, owner):
    with pytest.raises(tokens.TokenError) as info:
        tokens.mint(outsider, team_a, "ci")
    assert info.value.field == "team"
    with pytest.raises(tokens.TokenError) as info:
        tokens.mint(owner, team_a, "ci", expires_at=timezone.now() - datetime.timedelta(days=1))
    assert info.value.field == "expires_at"
    with pytest.raises(tokens.TokenError) as info:
        tokens.mint(owner, team_a, "  ")
    assert info.value.field == "name"
    assert APIToken.objects.count() == 0
    assert AuditLog.objects.count() == 0


def test_mint_is_audited(owner, team_a):
    token, _ = tokens.mint(owner, team_a, "ci")
    entry = AuditLog.objects.get(action="token.create")
    assert (entry.actor, entry.team, entry.target_id, entry.before) == (owner, team_a, str(token.pk), None)
    assert entry.after["name"] == "ci" and "token_hash" not in entry.after


def test_a_token_acts_only_within_its_team(make_user, team_a, team_b):
    from rlplatform.memberships import set_member

    both = make_user("both")
    set_member(team_a, both, "admin")
    set_member(team_b, both, "admin")
    token, _ = tokens.mint(both, team_a, "ci")
    assert permissions.can_admin(both, team_b) is True
    assert permissions.can_view(both, team_b, token=token) is False
    assert permissions.can_admin(both, team_a, token=token) is True
    assert list(permissions.teams_for(both, token=token)) == [team_a]


# --- revocation respects rank (issue 13) -----------------------------------------------------------------


def _revoke_over_api(actor, actor_team, token):
    """POST /api/tokens/<id>/revoke/ as ``actor`` through a fresh token of theirs in ``actor_team``."""
    from rest_framework.test import APIClient

    _, raw = tokens.mint(actor, actor_team, "actor")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client.post(f"/api/tokens/{token.pk}/revoke/")


def test_a_team_admin_token_cannot_revoke_a_superusers_token_in_that_team(owner, superuser, team_a):
    target, raw = tokens.mint(superuser, team_a, "root-ci")
    response = _revoke_over_api(owner, team_a, target)
    assert response.status_code == 403
    message = (
        f"token {target.prefix} belongs to root, who outranks you in its team;"
        " only they or someone of their rank can revoke it"
    )
    assert response.json() == {"detail": message, "errors": [{"field": "request", "message": message}]}
    target.refresh_from_db()
    assert target.revoked_at is None
    assert tokens.authenticate_token(raw) == target
    assert AuditLog.objects.filter(action="token.revoke").count() == 0


def test_a_team_admin_session_cannot_revoke_a_superusers_token_either(owner, superuser, team_a):
    from rest_framework.test import APIClient

    target, _ = tokens.mint(superuser, team_a, "root-ci")
    client = APIClient()
    client.force_login(owner)
    assert client.delete(f"/api/tokens/{target.pk}/").status_code == 403
    assert APIToken.objects.get(pk=target.pk).revoked_at is None


def test_an_admin_cannot_revoke_when_outranked_but_a_peer_admin_or_superuser_can(
    make_user, owner, editor, superuser, team_a
):
    from rlplatform.memberships import set_member

    second_admin = make_user("second-admin")
    set_member(team_a, second_admin, "admin")
    admins_token, _ = tokens.mint(owner, team_a, "owner-ci")
    editors_token, _ = tokens.mint(editor, team_a, "editor-ci")
    roots_token, _ = tokens.mint(superuser, team_a, "root-ci")
    assert _revoke_over_api(second_admin, team_a, admins_token).status_code == 200  # same rank
    assert _revoke_over_api(second_admin, team_a, editors_token).status_code == 200  # lower rank
    assert _revoke_over_api(superuser, team_a, roots_token).status_code == 200  # its owner
    assert APIToken.objects.filter(name__in=["owner-ci", "editor-ci", "root-ci"], revoked_at__isnull=True).count() == 0


def test_a_superuser_may_revoke_another_superusers_token(django_user_model, superuser, team_a):
    other_root = django_user_model.objects.create_superuser(username="root2", password="root2-pass-123")
    target, _ = tokens.mint(other_root, team_a, "root2-ci")
    assert tokens.may_revoke(superuser, target) is True
    assert tokens.revoke(target, actor=superuser) is True


def test_revoke_with_an_outranked_actor_raises_and_changes_nothing(owner, superuser, team_a):
    target, _ = tokens.mint(superuser, team_a, "root-ci")
    with pytest.raises(tokens.RevokeDenied):
        tokens.revoke(target, actor=owner)
    assert APIToken.objects.get(pk=target.pk).revoked_at is None
    assert tokens.revoke(target) is True  # the platform itself (no actor) is not ranked


def test_the_admin_revoke_action_skips_tokens_whose_owner_outranks_the_staff_user(owner, editor, superuser, team_a):
    """A staff team admin selects a superuser's token beside an editor's: the editor's is revoked, the
    superuser's is left working, and the page says which was skipped (no error page)."""
    from django.contrib.auth.models import Permission
    from django.test import Client

    owner.is_staff = True
    owner.save()
    owner.user_permissions.add(*Permission.objects.filter(codename__in=["view_apitoken", "change_apitoken"]))
    theirs, raw = tokens.mint(superuser, team_a, "root-ci")
    editors, _ = tokens.mint(editor, team_a, "editor-ci")
    client = Client()
    client.force_login(owner)
    response = client.post(
        "/admin/rlplatform/apitoken/",
        {"action": "revoke_tokens", "_selected_action": [theirs.pk, editors.pk]},
        follow=True,
    )
    assert response.status_code == 200
    shown = [str(m) for m in response.context["messages"]]
    assert shown == ["Revoked 1 token(s).", f"Not revoked, their owners outrank you in their teams: {theirs.prefix}."]
    assert tokens.authenticate_token(raw) == theirs
    assert APIToken.objects.get(pk=editors.pk).revoked_at is not None
