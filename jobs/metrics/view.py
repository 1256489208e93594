"""``GET /metrics``: the Prometheus exposition, for a scrape token only (rlplatform.scrape_tokens).

    no credential, a malformed one, or an unknown / expired / revoked token   401 (WWW-Authenticate: Bearer)
    a valid API token (tdm_...): authenticated, but not with scope metrics:read   403
    a valid scrape token (tdp_...)                                            200, text format (or OpenMetrics,
                                                                              as the scraper's Accept asks)

Each scrape builds a registry of its own: PostgreSQL's figures (platform_state) and the multiprocess
files of every process of this machine (instruments).
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_safe
from prometheus_client import CollectorRegistry, exposition, multiprocess
from rest_framework import exceptions

from jobs import metrics
from jobs.metrics.platform_state import PlatformStateCollector
from rlplatform import api_auth, scrape_tokens
from rlplatform.error_bodies import refusal_body

REALM = 'Bearer realm="metrics"'


def _refuse(status: int, message: str) -> JsonResponse:
    response = JsonResponse(refusal_body(message), status=status)
    if status == 401:
        response["WWW-Authenticate"] = REALM
    return response


def _refusal(request: HttpRequest) -> JsonResponse | None:
    """The reply to a request that may not scrape, or None for a valid scrape token."""
    try:
        raw = api_auth.bearer_credential(request, "scrape token")
    except exceptions.AuthenticationFailed as exc:
        return _refuse(401, str(exc.detail))
    if raw is None:
        return _refuse(401, "send a scrape token: Authorization: Bearer tdp_... (python manage.py scrape_token)")
    if scrape_tokens.authenticate(raw) is not None:
        return None
    if not scrape_tokens.is_scrape_token(raw) and api_auth.authenticate_token(raw) is not None:
        return _refuse(
            403,
            f"/metrics needs a scrape token (scope {scrape_tokens.SCOPE}), not an API token: "
            "platform staff mint one with `python manage.py scrape_token mint`",
        )
    return _refuse(401, "invalid, expired or revoked token")


def scrape_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=metrics.metrics_dir())
    registry.register(PlatformStateCollector())
    return registry


@require_safe
def metrics_view(request: HttpRequest) -> HttpResponse:
    refusal = _refusal(request)
    if refusal is not None:
        return refusal
    encoder, content_type = exposition.choose_encoder(request.headers.get("Accept", ""))
    return HttpResponse(encoder(scrape_registry()), content_type=content_type)
