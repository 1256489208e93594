"""Webhook deliveries through a real Celery worker (Redis broker, in this process's thread) to a real local
HTTP receiver: retried with backoff after a 500, a delivery that keeps failing recorded, a private address
refused unless allowed, and ingest never held up by the webhook."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

from jobs.alerts import evaluate
from jobs.models import AlertDelivery, AlertWebhook, RunEvent
from runtime import contract as M
from tests.alerts.helpers import alert_events, batch
from tests.http_stub import QuietHandler, StubServer, answer

WAIT_S = 30.0  # ceiling for a delivery to settle on a loaded 2-core machine


class Receiver:
    """A webhook receiver on a free local port: answers ``codes`` in turn (then the last one for ever)."""

    def __init__(self, codes):
        self.codes = list(codes)
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(QuietHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with receiver.lock:
                    receiver.bodies.append(body)
                    code = receiver.codes[min(len(receiver.bodies), len(receiver.codes)) - 1]
                answer(self, code, {"ok": code < 300})

        self.stub = StubServer(Handler)
        self.url = f"{self.stub.url}/hooks/tandem"


@pytest.fixture
def receiver():
    made = []

    def make(*codes):
        made.append(Receiver(codes))
        return made[-1]

    yield make
    for r in made:
        r.stub.stop()


@pytest.fixture
def worker(settings):
    """A real Celery worker (the platform's app and broker) consuming a queue of this test's own."""
    import os

    from celery.contrib.testing.worker import start_worker

    import jobs.tasks  # noqa: F401 (registers the alerts' tasks)
    from rlplatform.celery import app

    if not os.environ.get("REDIS_URL"):
        pytest.skip("needs the Redis broker: set REDIS_URL")
    settings.TANDEM_ALERT_QUEUE = f"alerts-test-{uuid.uuid4().hex[:8]}"
    settings.TANDEM_ALERT_WEBHOOK_BACKOFF_S = 0.05
    settings.TANDEM_ALERT_WEBHOOK_ALLOW_PRIVATE = True  # the receiver is on 127.0.0.1
    with start_worker(app, pool="solo", perform_ping_check=False, queues=[settings.TANDEM_ALERT_QUEUE]):
        yield app


def _settled(run) -> AlertDelivery:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        delivery = AlertDelivery.objects.filter(run=run).order_by("pk").last()
        if delivery is not None and delivery.state != AlertDelivery.PENDING:
            return delivery
        time.sleep(0.05)
    pytest.fail(f"the delivery did not settle within {WAIT_S:g} s: {AlertDelivery.objects.filter(run=run).values()}")


@pytest.mark.django_db(transaction=True)
def test_a_transition_is_delivered_after_a_500_with_retries(run, ingest, worker, receiver):
    hook = receiver(500, 500, 200)
    AlertWebhook.objects.create(run=run, url=hook.url)
    ingest(batch([1, 2], lambda s: {M.LOSS_POLICY: None if s == 2 else 0.3}))
    delivery = _settled(run)
    assert (delivery.state, delivery.attempts, delivery.error) == ("delivered", 3, "")
    assert len(hook.bodies) == 3 and hook.bodies[0] == hook.bodies[2]
    body = hook.bodies[-1]
    assert body["rule"]["kind"] == "non_finite" and body["state"] == "firing"
    assert body["run"] == {"id": run.pk, "name": run.name}
    assert body["team"] == {"id": run.experiment.team_id, "name": run.experiment.team.name}
    assert (body["value"], body["threshold"], body["step"]) == (None, 0.0, 2)
    assert body["time"]
    assert not RunEvent.objects.filter(run=run, kind="alert_webhook_failed").exists()


@pytest.mark.django_db(transaction=True)
def test_a_delivery_that_keeps_failing_is_recorded(run, ingest, worker, receiver, settings):
    settings.TANDEM_ALERT_WEBHOOK_RETRIES = 2
    hook = receiver(500)
    AlertWebhook.objects.create(run=run, url=hook.url)
    ingest(batch([1], lambda s: {M.REWARD_MEAN: None}))
    delivery = _settled(run)
    assert (delivery.state, delivery.attempts, delivery.error) == ("failed", 3, "HTTP 500")
    assert len(hook.bodies) == 3
    failed = alert_events(run)[-1]
    assert failed[0] == "alert_webhook_failed"
    assert (failed[1]["delivery"], failed[1]["attempts"], failed[1]["error"]) == (delivery.pk, 3, "HTTP 500")


@pytest.mark.django_db(transaction=True)
def test_a_private_address_is_refused_unless_allowed(run, ingest, worker, receiver, settings):
    settings.TANDEM_ALERT_WEBHOOK_ALLOW_PRIVATE = False
    hook = receiver(200)
    AlertWebhook.objects.create(run=run, url=hook.url)
    ingest(batch([1], lambda s: {M.REWARD_MEAN: None}))
    delivery = _settled(run)
    assert (delivery.state, delivery.attempts) == ("failed", 1)  # refused: not retried
    assert "non-public address" in delivery.error
    assert hook.bodies == []


def test_a_broker_outage_never_fails_ingest(run, ingest, monkeypatch, django_capture_on_commit_callbacks):
    def down(*args, **kwargs):
        raise ConnectionError("broker down")

    monkeypatch.setattr(evaluate.app, "signature", down)
    AlertWebhook.objects.create(run=run, url="https://hooks.example.com/x")
    with django_capture_on_commit_callbacks(execute=True):
        reply = ingest(batch([1], lambda s: {M.REWARD_MEAN: None}))
    assert reply["points"]["inserted"] == 1
    assert AlertDelivery.objects.get(run=run).state == AlertDelivery.PENDING
