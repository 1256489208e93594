"""DRF authentication of the ingest API by run-scoped token: ``Authorization: Bearer tdr_...``.

The principal is the run attempt itself, not a user: ``request.auth`` is the
RunToken, and the handler scopes every write to its run and attempt.
"""

from __future__ import annotations

from rest_framework import authentication, exceptions, permissions

from jobs.ingest.tokens import authenticate_run_token
from jobs.models import RunToken
from rlplatform.api_auth import KEYWORD, bearer_credential


class RunPrincipal:
    """Stands in for ``request.user``: authenticated, but no person and no team membership."""

    is_authenticated = True
    is_active = True
    is_anonymous = False
    is_superuser = False
    is_staff = False

    def __init__(self, token: RunToken):
        self.run_id = token.run_id
        self.attempt = token.attempt

    def get_username(self) -> str:
        return f"run-{self.run_id}/{self.attempt}"

    def __str__(self) -> str:
        return self.get_username()


class RunTokenAuthentication(authentication.BaseAuthentication):
    def authenticate(self, request):
        raw = bearer_credential(request, "run token")
        if raw is None:
            return None  # no credentials: HasRunToken answers 401
        token = authenticate_run_token(raw)
        if token is None:
            # One message for unknown, expired and revoked: the reply must not help guessing.
            raise exceptions.AuthenticationFailed("invalid, expired or revoked run token")
        return RunPrincipal(token), token

    def authenticate_header(self, request) -> str:
        # Present, so DRF answers 401 (not 403) to requests without credentials.
        return f'{KEYWORD} realm="ingest"'


class HasRunToken(permissions.BasePermission):
    def has_permission(self, request, view) -> bool:
        return isinstance(request.auth, RunToken)
