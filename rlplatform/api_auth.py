"""DRF authentication by API token: ``Authorization: Bearer tdm_<prefix>_<secret>``.

The token acts as its user, but only within its team: views pass
``request.auth`` (the APIToken) to ``rlplatform.permissions`` so every other
team's objects are invisible to it. Session authentication (the web pages)
comes second in settings and leaves ``request.auth`` None.
"""

from __future__ import annotations

import hmac

from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions

from rlplatform import sql, tokens
from rlplatform.models import APIToken

KEYWORD = "Bearer"


def bearer_credential(request, what: str = "token") -> str | None:
    """The raw credential of an ``Authorization: Bearer …`` header; None when there is no such header."""
    return parse_bearer(authentication.get_authorization_header(request), what)


def parse_bearer(header: bytes, what: str = "token") -> str | None:
    """The credential of an ``Authorization`` header's value ``Bearer <credential>``; None when it is not a
    bearer header; AuthenticationFailed when it is one but malformed."""
    parts = header.split()
    if not parts or parts[0].lower() != KEYWORD.lower().encode():
        return None
    if len(parts) != 2:
        raise exceptions.AuthenticationFailed(f"Authorization header must be 'Bearer <{what}>'")
    try:
        return parts[1].decode()
    except UnicodeError:
        raise exceptions.AuthenticationFailed("token contains invalid characters") from None


def authenticate_token(raw: str) -> APIToken | None:
    """The valid token for ``raw`` (with ``user`` loaded), or None: rlplatform.tokens.authenticate_token's
    rules (unknown, wrong secret, revoked, expired, inactive user, user no longer in the token's team).

    The one token check of the API: DRF's TokenAuthentication below and the run-status fast path
    (jobs.api.fast_status) both call it. Its query is rlplatform.sql.find_token (hand-written on
    PostgreSQL: the hot path); tests/api/test_api_runs.py checks it agrees with rlplatform.tokens.
    """
    prefix = tokens._split(raw)  # the token format lives in rlplatform.tokens
    if prefix is None:
        return None
    token = sql.find_token(prefix)
    if token is None or not hmac.compare_digest(token.token_hash, tokens.hash_token(raw)):
        return None
    now = timezone.now()
    if not token.is_valid(now) or not token.user.is_active:
        return None
    if not token.user.is_superuser and not token.user_in_team:
        return None
    if token.last_used_at is None or now - token.last_used_at >= tokens.LAST_USED_RESOLUTION:
        APIToken.objects.filter(pk=token.pk).update(last_used_at=now)
        token.last_used_at = now
    return token


class TokenAuthentication(authentication.BaseAuthentication):
    def authenticate(self, request):
        raw = bearer_credential(request)
        if raw is None:
            return None  # not ours: let session authentication try
        token = authenticate_token(raw)
        if token is None:
            # One message for unknown, expired and revoked: the reply must not help guessing.
            raise exceptions.AuthenticationFailed("invalid, expired or revoked token")
        return token.user, token

    def authenticate_header(self, request) -> str:
        # Present, so DRF answers 401 (not 403) to requests without credentials.
        return f'{KEYWORD} realm="api"'


def request_token(request) -> APIToken | None:
    """The API token of this request, or None for a session login."""
    auth = getattr(request, "auth", None)
    return auth if isinstance(auth, APIToken) else None


class TokenAuthenticationScheme(OpenApiAuthenticationExtension):
    """Describes the bearer token in the OpenAPI schema."""

    target_class = "rlplatform.api_auth.TokenAuthentication"
    name = "tokenAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "API token: `Authorization: Bearer tdm_...`"}
