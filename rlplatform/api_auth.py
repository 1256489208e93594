"""DRF authentication by API token: ``Authorization: Bearer tdm_<prefix>_<secret>``.

The token acts as its user, but only within its team: views pass
``request.auth`` (the APIToken) to ``rlplatform.permissions`` so every other
team's objects are invisible to it. Session authentication (the web pages)
comes second in settings and leaves ``request.auth`` None.
"""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions

from rlplatform.models import APIToken
from rlplatform.tokens import authenticate_token

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
