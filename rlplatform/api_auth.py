"""DRF authentication by API token: ``Authorization: Bearer tdm_<prefix>_<secret>``.

The token acts as its user, but only within its team: views pass
``request.auth`` (the APIToken) to ``rlplatform.permissions`` so every other
team's objects are invisible to it. Session authentication (the web pages)
comes second in settings and leaves ``request.auth`` None.
"""

from __future__ import annotations

import hmac
from functools import cache

from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions

from rlplatform import tokens
from rlplatform.models import APIToken, Membership

KEYWORD = "Bearer"


def bearer_credential(request, what: str = "token") -> str | None:
    """The raw credential of an ``Authorization: Bearer …`` header; None when there is no such header."""
    header = authentication.get_authorization_header(request).split()
    if not header or header[0].lower() != KEYWORD.lower().encode():
        return None
    if len(header) != 2:
        raise exceptions.AuthenticationFailed(f"Authorization header must be 'Bearer <{what}>'")
    try:
        return header[1].decode()
    except UnicodeError:
        raise exceptions.AuthenticationFailed("token contains invalid characters") from None


# --- the token check on the hot path ---------------------------------------------------------------------
#
# rlplatform.tokens.authenticate_token with its one query written out: building that query through the
# ORM (token, user, and an EXISTS on the membership) cost about 2 ms of CPU on the 2-core dev machine,
# four times the run-status read it guards. Same rules, same objects; tests/api/test_api_runs.py checks
# the two agree on every kind of token. PostgreSQL only (SQLite hands back naive datetimes that the ORM
# would convert): elsewhere the ORM version runs.


@cache
def _token_query() -> tuple[str, list, list]:
    """(SQL, token fields, user fields): a token by prefix, its user, and whether the user is in its team."""
    q = connection.ops.quote_name
    user_model = get_user_model()
    token_fields, user_fields = list(APIToken._meta.concrete_fields), list(user_model._meta.concrete_fields)
    member = Membership._meta
    columns = [f"t.{q(f.column)}" for f in token_fields] + [f"u.{q(f.column)}" for f in user_fields]
    sql = (
        f"SELECT {', '.join(columns)}, EXISTS (SELECT 1 FROM {q(member.db_table)} m "
        f"WHERE m.{q('team_id')} = t.{q('team_id')} AND m.{q('user_id')} = t.{q('user_id')}) "
        f"FROM {q(APIToken._meta.db_table)} t "
        f"JOIN {q(user_model._meta.db_table)} u ON u.{q(user_model._meta.pk.column)} = t.{q('user_id')} "
        f"WHERE t.{q('prefix')} = %s"
    )
    return sql, token_fields, user_fields


def _find_token(prefix: str) -> APIToken | None:
    sql, token_fields, user_fields = _token_query()
    with connection.cursor() as cursor:
        cursor.execute(sql, [prefix])
        row = cursor.fetchone()
    if row is None:
        return None
    n = len(token_fields)
    token = APIToken.from_db(connection.alias, [f.attname for f in token_fields], row[:n])
    token.user = get_user_model().from_db(connection.alias, [f.attname for f in user_fields], row[n:-1])
    token.user_in_team = row[-1]
    return token


def authenticate_token(raw: str) -> APIToken | None:
    """The valid token for ``raw`` (with ``user`` loaded), or None: rlplatform.tokens.authenticate_token's
    rules (unknown, wrong secret, revoked, expired, inactive user, user no longer in the token's team)."""
    if connection.vendor != "postgresql":
        return tokens.authenticate_token(raw)
    prefix = tokens._split(raw)  # the token format lives in rlplatform.tokens
    if prefix is None:
        return None
    token = _find_token(prefix)
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
