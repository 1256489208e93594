"""The kinds of the run events alerts record: platform events (jobs.run_events records them, as it does the
lifecycle's), streamed live; the run page's Events table and its alert banner read them."""

from __future__ import annotations

FIRING = "alert_firing"
RESOLVED = "alert_resolved"
WEBHOOK_FAILED = "alert_webhook_failed"
KINDS = (FIRING, RESOLVED, WEBHOOK_FAILED)
