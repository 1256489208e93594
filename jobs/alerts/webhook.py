"""Delivering an alert transition to the run's webhook: a JSON POST from a Celery task (jobs.alerts.tasks),
retried with exponential backoff, its outcome kept on the AlertDelivery row; a delivery that fails for good
is also an ``alert_webhook_failed`` run event.

The URL is user-given, so the platform making the request is a server-side request forgery risk: by default
a delivery to a loopback, private, link-local, multicast or reserved address is refused (not retried), and
redirects are never followed. ``TANDEM_ALERT_WEBHOOK_ALLOW_PRIVATE=1`` allows private addresses (a webhook
receiver inside the cluster's network). The address is checked when the task resolves the name; a name that
resolves differently at connect time (DNS rebinding) is not caught here: deployments that need more put the
workers behind an egress proxy or firewall.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.db.models import F
from django.utils import timezone

from jobs.alerts import events
from jobs.models import AlertDelivery

USER_AGENT = "tandem-alerts/1"


def _setting(name: str, default: Any) -> Any:
    return getattr(settings, name, default)


def retries() -> int:
    return int(_setting("TANDEM_ALERT_WEBHOOK_RETRIES", 5))


def backoff_s(retry: int) -> float:
    """Seconds before retry number ``retry`` (0-based): base x 2**retry."""
    return float(_setting("TANDEM_ALERT_WEBHOOK_BACKOFF_S", 2.0)) * 2**retry


def refused_address(url: str) -> str | None:
    """Why the URL's host may not be called (a non-public address and private ones not allowed), or None."""
    if _setting("TANDEM_ALERT_WEBHOOK_ALLOW_PRIVATE", False):
        return None
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        infos = socket.getaddrinfo(
            host, parts.port or (443 if parts.scheme == "https" else 80), proto=socket.IPPROTO_TCP
        )
    except OSError:
        return None  # not resolvable now: the POST fails and is retried
    for info in infos:
        address = ipaddress.ip_address(info[4][0])
        if not address.is_global or address.is_multicast:
            return (
                f"{host} resolves to {address}, a non-public address: refused "
                "(TANDEM_ALERT_WEBHOOK_ALLOW_PRIVATE allows private addresses)"
            )
    return None


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # a 3xx is then an HTTPError: the delivery failed


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirects)


def post(url: str, body: dict[str, Any]) -> str | None:
    """POST the body; None when the receiver answered 2xx, else why not."""
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "User-Agent": USER_AGENT},
    )
    try:
        with _OPENER.open(request, timeout=float(_setting("TANDEM_ALERT_WEBHOOK_TIMEOUT_S", 5.0))) as reply:
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
    refused = refused_address(delivery.url)
    error = refused or post(delivery.url, delivery.body)
    AlertDelivery.objects.filter(pk=delivery_id).update(attempts=F("attempts") + 1, error=error or "")
    if error is None:
        AlertDelivery.objects.filter(pk=delivery_id).update(state=AlertDelivery.DELIVERED, finished_at=timezone.now())
        return None
    if refused is None and retry < retries():
        return backoff_s(retry)
    fail(delivery, error, retry + 1)
    return None


def fail(delivery: AlertDelivery, error: str, attempts: int) -> None:
    AlertDelivery.objects.filter(pk=delivery.pk).update(state=AlertDelivery.FAILED, finished_at=timezone.now())
    events.record(
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
