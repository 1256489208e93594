"""The run-status fast path: ``GET /api/runs/{id}/`` answered in front of Django (rlplatform.asgi mounts it).

CI polls GET /api/runs/{id}/. Through Django's ASGI handler a read costs about 10 ms of CPU on the
2-core dev machine, most of it not the read: each of the middlewares' hooks runs in its own thread hop
(about 0.25 ms each), plus the request signals and DRF's dispatch. This wrapper answers the plain
case (a GET with an API token, no query string, JSON accepted) itself: one hop to a thread, the same
token check (rlplatform.api_auth's parse_bearer and authenticate_token, which DRF's authentication calls
too) and the same run query (jobs.api.serializers.run_status_reply), and the bytes and headers
Django and DRF would send (tested side by side in tests/api/test_api_runs.py). Anything else, and every
answer but a 200 (bad token, another team's run, a disallowed host), goes to Django, which answers as
always. It is on only while the installed middleware is rlplatform.middleware_stack's list.
"""

from __future__ import annotations

import re

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from django.http.request import split_domain_port, validate_host
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.renderers import JSONRenderer

from jobs.api.serializers import run_status_reply
from rlplatform import middleware_stack
from rlplatform.api_auth import authenticate_token, parse_bearer
from rlplatform.security_headers import CONTENT_SECURITY_POLICY, CSP_HEADER

_STATUS_PATH = re.compile(r"/api/runs/([0-9]+)/")
_JSON_ACCEPTS = (None, b"*/*", b"application/json")


def fast_path_enabled() -> bool:
    """Off unless the settings are ones whose effects on this reply the fast path reproduces: the middleware
    list of rlplatform.middleware_stack (the input boundary has nothing to refuse on a GET with no query
    string and no body; the others' effects are the host check and the headers) and no TLS or proxy options."""
    return (
        list(settings.MIDDLEWARE) == list(middleware_stack.MIDDLEWARE)
        and not settings.SECURE_SSL_REDIRECT  # TLS set-ups redirect and add HSTS: Django does that
        and not settings.SECURE_HSTS_SECONDS
        and not settings.USE_X_FORWARDED_HOST
        and not settings.USE_X_FORWARDED_PORT
        and not settings.PREPEND_WWW
        and not settings.DISALLOWED_USER_AGENTS
        and settings.X_FRAME_OPTIONS == "DENY"
        and "DEFAULT_RENDERER_CLASSES" not in settings.REST_FRAMEWORK
    )


def _security_headers() -> list[tuple[bytes, bytes]]:
    """SecurityMiddleware's and ContentSecurityPolicyMiddleware's headers of a plain-HTTP reply."""
    headers = [(CSP_HEADER.encode(), CONTENT_SECURITY_POLICY.encode())]
    if settings.SECURE_CONTENT_TYPE_NOSNIFF:
        headers.append((b"X-Content-Type-Options", b"nosniff"))
    if settings.SECURE_REFERRER_POLICY:
        policy = settings.SECURE_REFERRER_POLICY
        policy = policy if isinstance(policy, str) else ",".join(policy)
        headers.append((b"Referrer-Policy", policy.encode()))
    if settings.SECURE_CROSS_ORIGIN_OPENER_POLICY:
        headers.append((b"Cross-Origin-Opener-Policy", settings.SECURE_CROSS_ORIGIN_OPENER_POLICY.encode()))
    return headers


def _allowed_host(host: bytes) -> bool:
    allowed = settings.ALLOWED_HOSTS
    if settings.DEBUG and not allowed:
        allowed = [".localhost", "127.0.0.1", "[::1]"]
    domain, _port = split_domain_port(host.decode("latin-1"))
    return bool(domain) and validate_host(domain, allowed)


def _credential(authorization: bytes) -> str | None:
    """The bearer credential, parsed as DRF's TokenAuthentication parses it; None for anything else, malformed
    headers included (Django answers those, with DRF's message)."""
    try:
        return parse_bearer(authorization)
    except AuthenticationFailed:
        return None


def _fast_status(run_id: int, host: bytes, credential: str) -> list | None:
    """(headers, body) of the 200 reply, or None: Django answers instead."""
    close_old_connections()  # what Django's request_started / request_finished signals do
    try:
        if not _allowed_host(host):
            return None
        token = authenticate_token(credential)
        if token is None:
            return None
        body = run_status_reply(run_id, [token.team_id])
        if body is None:
            return None
        content = JSONRenderer().render(body)
        headers = [
            (b"Content-Type", b"application/json"),
            (b"Vary", b"Accept"),
            (b"Allow", b"GET, HEAD, OPTIONS"),
            (b"X-Frame-Options", b"DENY"),
            (b"Content-Length", str(len(content)).encode()),
            *_security_headers(),
        ]
        return [headers, content]
    finally:
        close_old_connections()


class RunStatusFastPath:
    """ASGI wrapper around the HTTP application: serves the plain run-status read (see the module) itself."""

    def __init__(self, app):
        self.app = app
        self.enabled = fast_path_enabled()

    async def __call__(self, scope, receive, send):
        match = None
        if self.enabled and scope["type"] == "http" and scope["method"] == "GET" and not scope.get("query_string"):
            match = _STATUS_PATH.fullmatch(scope["path"]) if not scope.get("root_path") else None
        if match is not None:
            headers = dict(scope["headers"])  # ASGI header names are lower-case
            host = headers.get(b"host")
            credential = _credential(headers.get(b"authorization", b""))
            if credential is not None and host is not None and headers.get(b"accept") in _JSON_ACCEPTS:
                reply = await sync_to_async(_fast_status, thread_sensitive=False)(int(match.group(1)), host, credential)
                if reply is not None:
                    await send({"type": "http.response.start", "status": 200, "headers": reply[0]})
                    await send({"type": "http.response.body", "body": reply[1]})
                    return
        await self.app(scope, receive, send)
