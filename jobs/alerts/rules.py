"""An alert rule, a webhook URL and a run's webhook setting as the API takes them: each bad field an
``InvalidInput`` naming it; and their reply bodies. The kinds are jobs.alerts.kinds'."""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import urlsplit

from jobs.alerts import webhook
from jobs.alerts.kinds import KINDS, METRIC_KINDS, NON_FINITE, known_metric
from jobs.handler import InvalidInput
from jobs.models import AlertRule, AlertWebhook, ExperimentAlertWebhook, Run

MAX_URL = 500


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def clean_rule(data: Any, rule: AlertRule | None = None) -> dict[str, Any]:
    """The fields of a new rule (``rule`` None) or of a change to ``rule``, checked; every problem is one
    error naming its field (``kind``, ``metric``, ``threshold``, ``enabled``), raised together."""
    if not isinstance(data, dict):
        raise InvalidInput.one("body", "must be a JSON object")
    errors: list[dict[str, str]] = []
    allowed = {"kind", "metric", "threshold", "enabled"} if rule is None else {"metric", "threshold", "enabled"}
    for key in sorted(set(data) - allowed):
        errors.append({"field": key, "message": "is not a field of an alert rule" + (" change" if rule else "")})
    kind_name = data.get("kind") if rule is None else rule.kind
    kind = KINDS.get(kind_name) if isinstance(kind_name, str) else None
    if kind is None:
        errors.append({"field": "kind", "message": f"must be one of {', '.join(KINDS)}"})
        raise InvalidInput(errors)
    out: dict[str, Any] = {"kind": kind.name} if rule is None else {}
    if "metric" in data or rule is None:
        metric = data.get("metric") or ""
        if not isinstance(metric, str):
            errors.append({"field": "metric", "message": "must be a metric name"})
        elif metric and kind.name not in METRIC_KINDS:
            errors.append({"field": "metric", "message": f"a {kind.name} rule watches no metric"})
        elif metric and not known_metric(metric):
            errors.append({"field": "metric", "message": f"{metric[:200]!r} is not a metric the runtime reports"})
        else:
            out["metric"] = metric or kind.metric
    if "threshold" in data or rule is None:
        threshold = _number(data.get("threshold", 0.0 if kind.name == NON_FINITE else None))
        if threshold is None:
            errors.append({"field": "threshold", "message": f"must be a number: {kind.meaning}"})
        elif not kind.low <= threshold <= kind.high or (kind.integer and threshold != int(threshold)):
            what = "an integer" if kind.integer else "a number"
            errors.append(
                {"field": "threshold", "message": f"must be {what} from {kind.low:g} to {kind.high:g}: {kind.meaning}"}
            )
        else:
            out["threshold"] = threshold
    if "enabled" in data:
        if not isinstance(data["enabled"], bool):
            errors.append({"field": "enabled", "message": "must be true or false"})
        else:
            out["enabled"] = data["enabled"]
    if errors:
        raise InvalidInput(errors)
    return out


def clean_webhook_url(value: Any) -> str:
    """A webhook URL: http(s) with a host, at most MAX_URL characters; "" or null: no webhook. Where it may
    point (private addresses) is checked at delivery (jobs.alerts.webhook.resolve)."""
    if value is None or value == "":
        return ""
    if not isinstance(value, str) or len(value) > MAX_URL or any(c.isspace() or c == "\x00" for c in value):
        raise InvalidInput.one("url", f"must be an http or https URL of at most {MAX_URL} characters")
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        raise InvalidInput.one("url", "is not a valid URL") from None
    if parts.scheme not in ("http", "https"):
        raise InvalidInput.one("url", "must be an http or https URL")
    if not parts.hostname:
        raise InvalidInput.one("url", "must name a host")
    return value


def clean_experiment_webhook(data: Any) -> str:
    """An experiment's default webhook URL from a PUT body ``{"url": URL}`` ("" removes the default)."""
    if not isinstance(data, dict):
        raise InvalidInput.one("body", "must be a JSON object")
    extra = sorted(set(data) - {"url"})
    if extra:
        raise InvalidInput([{"field": key, "message": "is not a field of an experiment's webhook"} for key in extra])
    if "url" not in data:
        raise InvalidInput.one("url", 'is required ("" removes the default)')
    return clean_webhook_url(data["url"])


def clean_run_webhook(data: Any) -> tuple[str, bool]:
    """A run's webhook setting from a PUT body, as ``(url, off)``: ``{"url": URL}`` its own webhook;
    ``{"url": ""}`` none of its own (its experiment's default applies); ``{"off": true}`` none at all, not
    even the default. ``url`` is required unless ``off`` is true; each problem an error naming its field."""
    if not isinstance(data, dict):
        raise InvalidInput.one("body", "must be a JSON object")
    extra = sorted(set(data) - {"url", "off"})
    if extra:
        raise InvalidInput([{"field": key, "message": "is not a field of a run's webhook"} for key in extra])
    off = data.get("off", False)
    if not isinstance(off, bool):
        raise InvalidInput.one("off", "must be true or false")
    if "url" not in data and not off:
        raise InvalidInput.one("url", "is required (\"\" removes the run's own: the experiment's default applies)")
    url = clean_webhook_url(data.get("url"))
    if off and url:
        raise InvalidInput.one("off", 'a run that opts out of webhooks has no url of its own: give "" or none')
    return url, off


def rule_body(rule: AlertRule) -> dict[str, Any]:
    return {
        "id": rule.pk,
        "kind": rule.kind,
        "metric": rule.metric,
        "threshold": rule.threshold,
        "meaning": KINDS[rule.kind].meaning if rule.kind in KINDS else "",
        "enabled": rule.enabled,
        "firing": rule.firing,
        "value": rule.value,
        "changed_at": rule.changed_at,
    }


def webhook_body(run: Run) -> dict[str, Any]:
    """A run's webhook setting as the API gives it: ``url`` its own ("" none), ``off`` whether it opted out,
    ``experiment_url`` its experiment's default ("" none), ``effective`` where its transitions go ("" nowhere)."""
    own = AlertWebhook.objects.filter(run=run).values("url", "off").first() or {"url": "", "off": False}
    default = experiment_webhook_url(run.experiment_id)
    return {**own, "experiment_url": default, "effective": webhook.target(own["url"], own["off"], default)}


def experiment_webhook_url(experiment_id: int) -> str:
    """An experiment's default webhook URL ("" none)."""
    rows = ExperimentAlertWebhook.objects.filter(experiment_id=experiment_id).values_list("url", flat=True)
    return rows.first() or ""
