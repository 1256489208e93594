"""Delivering an alert transition to the run's webhook (its own, else its experiment's default: ``target``): a JSON POST from a Celery task (jobs.alerts.tasks),
retried with exponential backoff, its outcome kept on the AlertDelivery row; a delivery that fails for good
is also an ``alert_webhook_failed`` run event.

The URL is user-given, so the platform making the request is a server-side request forgery risk: by default
a delivery to a loopback, private, link-local, multicast or reserved address is refused (not retried), and
redirects are never followed. ``TANDEM_ALERT_WEBHOOK_ALLOW_PRIVATE=1`` allows private addresses (a webhook
receiver inside the cluster's network). The name is resolved once per attempt, every address it gives is
checked, and the request connects to the checked address (with the URL's host name in the Host header, and
for https as the TLS server name the certificate is verified against): a name that would resolve to another
address at connect time (DNS rebinding) cannot redirect the request.
"""

from __future__ import annotations

import functools
import http.client
import ipaddress
import json
import socket
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from jobs import run_events
from jobs.alerts import events
from jobs.models import AlertDelivery

USER_AGENT = "tandem-alerts/1"


def target(own_url: str | None, off: bool | None, default_url: str | None) -> str:
    """Where a run's transitions go ("" nowhere): the run's own webhook URL; else, unless the run opted out
    (``off``), its experiment's default; else nowhere. The arguments are the run's AlertWebhook row's fields
    (None: no row) and its experiment's ExperimentAlertWebhook URL (None: no default)."""
    if off:
        return ""
    return own_url or default_url or ""


def _setting(name: str, default: Any) -> Any:
    return getattr(settings, name, default)


def retries() -> int:
    return int(_setting("TANDEM_ALERT_WEBHOOK_RETRIES", 5))


def backoff_s(retry: int) -> float:
    """Seconds before retry number ``retry`` (0-based): base x 2**retry."""
    return float(_setting("TANDEM_ALERT_WEBHOOK_BACKOFF_S", 2.0)) * 2**retry


def resolve(url: str) -> tuple[str | None, str | None]:
    """``(address to connect to, None)``, or ``(None, why the URL's host may not be called)`` (a non-public
    address, private ones not allowed), or ``(None, None)`` when the name does not resolve now (the POST then
    fails and is retried)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        infos = socket.getaddrinfo(
            host, parts.port or (443 if parts.scheme == "https" else 80), proto=socket.IPPROTO_TCP
        )
    except OSError:
        return None, None
    addresses = [str(info[4][0]) for info in infos]
    if not _setting("TANDEM_ALERT_WEBHOOK_ALLOW_PRIVATE", False):
        for text in addresses:
            address = ipaddress.ip_address(text)
            if not address.is_global or address.is_multicast:
                return None, (
                    f"{host} resolves to {address}, a non-public address: refused "
                    "(TANDEM_ALERT_WEBHOOK_ALLOW_PRIVATE allows private addresses)"
                )
    return (addresses[0] if addresses else None), None


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to an address checked beforehand, whatever the host name resolves to now."""

    def __init__(self, host: str, *, address: str, **kwargs: Any):
        super().__init__(host, **kwargs)
        self.address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to a checked address; the certificate is still verified against the URL's host name."""

    def __init__(self, host: str, *, address: str, **kwargs: Any):
        super().__init__(host, **kwargs)
        self.address = address

    def connect(self) -> None:
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


class _PinnedHandler(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    def __init__(self, address: str):
        urllib.request.HTTPHandler.__init__(self)
        urllib.request.HTTPSHandler.__init__(self)
        self.address = address

    def http_open(self, req):  # type: ignore[no-untyped-def]
        return self.do_open(functools.partial(_PinnedHTTP, address=self.address), req)

    def https_open(self, req):  # type: ignore[no-untyped-def]
        return self.do_open(functools.partial(_PinnedHTTPS, address=self.address), req, context=self._context)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # a 3xx is then an HTTPError: the delivery failed


def post(url: str, body: dict[str, Any], address: str | None = None) -> str | None:
    """POST the body (connecting to ``address``, the host's checked address, when given); None when the
    receiver answered 2xx, else why not."""
    handlers: list[Any] = [urllib.request.ProxyHandler({}), _NoRedirects]
    if address is not None:
        handlers.append(_PinnedHandler(address))
    opener = urllib.request.build_opener(*handlers)
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "User-Agent": USER_AGENT},
    )
    try:
        with opener.open(request, timeout=float(_setting("TANDEM_ALERT_WEBHOOK_TIMEOUT_S", 5.0))) as reply:
            reply.read(65536)
            return None if 200 <= reply.status < 300 else f"HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"[:500]


def attempt(delivery_id: int, retry: int) -> float | None:
    """One attempt of a delivery: returns the seconds to wait before the next attempt, or None when done
    (delivered, failed for good, or not pending any more)."""
    delivery = AlertDelivery.objects.filter(pk=delivery_id, state=AlertDelivery.PENDING).first()
    if delivery is None:
        return None
    address, refused = resolve(delivery.url)
    error = refused or post(delivery.url, delivery.body, address)
    AlertDelivery.objects.filter(pk=delivery_id).update(attempts=F("attempts") + 1, error=error or "")
    if error is None:
        AlertDelivery.objects.filter(pk=delivery_id).update(state=AlertDelivery.DELIVERED, finished_at=timezone.now())
        return None
    if refused is None and retry < retries():
        return backoff_s(retry)
    fail(delivery, error, retry + 1)
    return None


def fail(delivery: AlertDelivery, error: str, attempts: int) -> None:
    with transaction.atomic():  # the FAILED state and its event commit together: a reader of one sees both
        AlertDelivery.objects.filter(pk=delivery.pk).update(state=AlertDelivery.FAILED, finished_at=timezone.now())
        run_events.record(
            delivery.run_id,
            events.WEBHOOK_FAILED,
            {
                "delivery": delivery.pk,
                "rule": delivery.rule_id,
                "state": delivery.body.get("state"),
                "url": delivery.url,
                "attempts": attempts,
                "error": error,
            },
        )
