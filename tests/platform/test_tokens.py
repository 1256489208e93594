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
