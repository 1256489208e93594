"""Scrape tokens: the one credential ``/metrics`` accepts (scope ``metrics:read``), for a Prometheus server.

A scrape token reads ``tdp_<prefix>_<secret>`` and is stored as a hash, like an API token
(rlplatform.tokens, whose format and hash it shares). Unlike one it belongs to no team and acts as no
user: the metrics are cluster-wide, and the token written into a Prometheus configuration can read them
and nothing else. The REST API never accepts it (its prefix is not ``tdm_``), and ``/metrics`` accepts
no API token, so a leaked scrape token changes nothing. Platform staff mint and revoke them with
``python manage.py scrape_token`` (audited).
"""

from __future__ import annotations

import datetime
import hmac
import secrets

from django.db import IntegrityError, transaction
from django.utils import timezone

from rlplatform import audit, tokens
from rlplatform.models import ScrapeToken

SCOPE = "metrics:read"  # what a scrape token may do, and all it may do
TOKEN_PREFIX = "tdp_"
DEFAULT_TTL = datetime.timedelta(days=365)
AUDITED_FIELDS = ("name", "prefix", "expires_at", "revoked_at")


def mint(name: str, *, created_by=None, ttl: datetime.timedelta = DEFAULT_TTL) -> tuple[ScrapeToken, str]:
    """A new scrape token and its plaintext (shown once, never stored). Audited."""
    name = (name or "").strip()
    if not name or len(name) > 100:
        raise tokens.TokenError("name", "give a name of 1 to 100 characters")
    if ttl <= datetime.timedelta(0) or ttl > tokens.MAX_TTL:
        raise tokens.TokenError("ttl", "must be more than 0 and at most 10 years")
    now = timezone.now()
    for _attempt in range(5):
        prefix = secrets.token_hex(4)
        raw = f"{TOKEN_PREFIX}{prefix}_{secrets.token_urlsafe(32)}"
        try:
            with transaction.atomic():
                token = ScrapeToken.objects.create(
                    name=name,
                    prefix=prefix,
                    token_hash=tokens.hash_token(raw),
                    created_by=created_by,
                    created_at=now,
                    expires_at=now + ttl,
                )
                audit.record(created_by, "scrape_token.create", token, None, audit.snapshot(token, AUDITED_FIELDS))
            return token, raw
        except IntegrityError:
            continue  # prefix collision: draw again
    raise RuntimeError("could not allocate a unique token prefix")


def revoke(token: ScrapeToken, actor=None) -> bool:
    """Revoke a scrape token; False if it already was. Audited."""
    with transaction.atomic():
        before = audit.snapshot(token, AUDITED_FIELDS)
        now = timezone.now()
        if not ScrapeToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=now):
            return False
        token.revoked_at = now
        audit.record(actor, "scrape_token.revoke", token, before, audit.snapshot(token, AUDITED_FIELDS))
        return True


def is_scrape_token(raw: str) -> bool:
    """Whether ``raw`` has a scrape token's form (valid or not)."""
    return tokens._split(raw, TOKEN_PREFIX) is not None


def authenticate(raw: str) -> ScrapeToken | None:
    """The valid scrape token for ``raw``, or None (unknown, wrong secret, revoked or expired)."""
    prefix = tokens._split(raw, TOKEN_PREFIX)
    if prefix is None:
        return None
    token = ScrapeToken.objects.filter(prefix=prefix).first()
    if token is None or not hmac.compare_digest(token.token_hash, tokens.hash_token(raw)):
        return None
    return token if token.is_valid() else None
