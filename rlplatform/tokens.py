"""API tokens: minted once, stored as a hash, expiring, revocable, scoped to a team.

A token reads ``tdm_<prefix>_<secret>``. The prefix (public, unique) finds the
row; the SHA-256 of the whole token must match the stored hash. SHA-256 without
salt is enough here because the secret has 256 bits of entropy: there is no
dictionary to attack, unlike a password.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import secrets

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone

from rlplatform import audit
from rlplatform.models import ROLE_RANK, APIToken, Membership, Team

TOKEN_PREFIX = "tdm_"
# last_used_at is written at most this often, so reads stay read-only under load.
LAST_USED_RESOLUTION = datetime.timedelta(seconds=60)
MAX_TTL = datetime.timedelta(days=3650)
AUDITED_FIELDS = ("name", "user", "team", "prefix", "expires_at", "revoked_at")


class TokenError(ValueError):
    """Bad token request; ``field`` names the offending input."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def mint(
    user,
    team: Team,
    name: str,
    *,
    expires_at: datetime.datetime | None = None,
    ttl: datetime.timedelta | None = None,
    actor=None,
) -> tuple[APIToken, str]:
    """Create a token for ``user`` in ``team``; return it and the plaintext (shown once, never stored).

    Default lifetime: settings.TANDEM_TOKEN_TTL_DAYS. The user must be a member of the team.
    """
    now = timezone.now()
    name = (name or "").strip()
    if not name or len(name) > 100:
        raise TokenError("name", "give a name of 1 to 100 characters")
    if expires_at is None:
        expires_at = now + (ttl if ttl is not None else datetime.timedelta(days=settings.TANDEM_TOKEN_TTL_DAYS))
    if expires_at <= now:
        raise TokenError("expires_at", "must be in the future")
    if expires_at - now > MAX_TTL:
        raise TokenError("expires_at", "must be at most 10 years from now")
    if not user.is_superuser and not Membership.objects.filter(team=team, user=user).exists():
        raise TokenError("team", f"{user.get_username()} is not a member of team {team.name}")
    for _attempt in range(5):
        prefix = secrets.token_hex(4)
        raw = f"{TOKEN_PREFIX}{prefix}_{secrets.token_urlsafe(32)}"
        try:
            with transaction.atomic():
                token = APIToken.objects.create(
                    user=user,
                    team=team,
                    name=name,
                    prefix=prefix,
                    token_hash=hash_token(raw),
                    created_at=now,
                    expires_at=expires_at,
                )
                audit.record(actor or user, "token.create", token, None, audit.snapshot(token, AUDITED_FIELDS))
            return token, raw
        except IntegrityError:
            continue  # prefix collision (1 in 4 billion per pair): draw again
    raise RuntimeError("could not allocate a unique token prefix")


class RevokeDenied(PermissionError):
    """The actor ranks below the token's owner in the token's team."""


# A superuser outranks every team role.
SUPERUSER_RANK = max(ROLE_RANK.values()) + 1


def _rank_in_team(user, team_id: int) -> int:
    """The user's rank in the team: superuser above admin, 0 for a non-member."""
    if user.is_superuser:
        return SUPERUSER_RANK
    role = Membership.objects.filter(team_id=team_id, user=user).values_list("role", flat=True).first()
    return ROLE_RANK.get(role, 0) if role else 0


def may_revoke(actor, token: APIToken) -> bool:
    """The token's owner, or someone of at least the owner's rank in the token's team, may revoke it."""
    if actor.pk == token.user_id:
        return True
    return _rank_in_team(actor, token.team_id) >= _rank_in_team(token.user, token.team_id)


def revoke(token: APIToken, actor=None) -> bool:
    """Revoke a token; False if it already was. Audited.

    With an ``actor`` (a person, not the platform itself) the rank rule of ``may_revoke`` applies:
    raises RevokeDenied, and nothing changes, when the actor is outranked by the token's owner.
    """
    if actor is not None and not may_revoke(actor, token):
        raise RevokeDenied(
            f"token {token.prefix} belongs to {token.user.get_username()}, who outranks you in its team;"
            " only they or someone of their rank can revoke it"
        )
    with transaction.atomic():
        before = audit.snapshot(token, AUDITED_FIELDS)
        now = timezone.now()
        changed = APIToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=now)
        if not changed:
            return False
        token.revoked_at = now
        audit.record(actor, "token.revoke", token, before, audit.snapshot(token, AUDITED_FIELDS))
        return True


def _split(raw: str, token_prefix: str = TOKEN_PREFIX) -> str | None:
    """The lookup prefix of ``<token_prefix><prefix>_<secret>``, or None when ``raw`` is not of that form
    (scrape tokens, rlplatform.scrape_tokens, share the format under their own ``token_prefix``)."""
    if not raw or not raw.startswith(token_prefix):
        return None
    prefix, sep, secret = raw[len(token_prefix) :].partition("_")
    if not sep or len(prefix) != 8 or not secret:
        return None
    return prefix


def authenticate_token(raw: str) -> APIToken | None:
    """The valid token for ``raw`` (with ``user`` loaded), or None.

    Invalid: unknown, wrong secret, revoked, expired, inactive user, or a user
    no longer in the token's team (superusers excepted).
    """
    prefix = _split(raw)
    if prefix is None:
        return None
    # One query on the hot path (CI polling a run): the token, its user, and whether
    # the user is still in the token's team, as an EXISTS subquery.
    membership = Membership.objects.filter(team_id=OuterRef("team_id"), user_id=OuterRef("user_id"))
    token = (
        APIToken.objects.select_related("user").annotate(user_in_team=Exists(membership)).filter(prefix=prefix).first()
    )
    if token is None or not hmac.compare_digest(token.token_hash, hash_token(raw)):
        return None
    now = timezone.now()
    if not token.is_valid(now) or not token.user.is_active:
        return None
    if not token.user.is_superuser and not token.user_in_team:
        return None
    if token.last_used_at is None or now - token.last_used_at >= LAST_USED_RESOLUTION:
        APIToken.objects.filter(pk=token.pk).update(last_used_at=now)
        token.last_used_at = now
    return token
