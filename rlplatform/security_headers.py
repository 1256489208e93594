"""Content-Security-Policy on every response: pages, API replies, static files, errors.

The UI loads its scripts and styles as files from this origin (no inline ``<script>``, no ``on*=``
handlers, no ``style=`` attributes; ``json_script`` data blocks are not scripts), so the policy can
refuse everything inline: an injected ``<script>`` or ``onerror=`` runs nowhere. ``connect-src 'self'``
also covers the live UI's WebSockets to the same host and port (CSP level 3). The run-status fast path
(jobs.api.views) sends the same header.
"""

from __future__ import annotations

from django.utils.deprecation import MiddlewareMixin

CSP_HEADER = "Content-Security-Policy"
CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)


class ContentSecurityPolicyMiddleware(MiddlewareMixin):
    """Adds the policy to every response that does not set its own (sync and async: MiddlewareMixin)."""

    def process_response(self, request, response):
        response.headers.setdefault(CSP_HEADER, CONTENT_SECURITY_POLICY)
        return response
