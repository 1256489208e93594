"""Webhook deliveries through a real Celery worker (Redis broker, in this process's thread) to a real local
HTTP receiver: a run without a webhook of its own delivers to its experiment's default, retried with backoff
after a 500, a delivery that keeps failing recorded, a private address refused unless allowed, and ingest
never held up by the webhook."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

from jobs.alerts import evaluate
from jobs.models import AlertDelivery, AlertWebhook, ExperimentAlertWebhook, RunEvent
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
def test_a_run_without_a_webhook_of_its_own_delivers_to_its_experiments_default(run, ingest, worker, receiver):
    hook = receiver(200)
    ExperimentAlertWebhook.objects.create(experiment=run.experiment, url=hook.url)
    assert not AlertWebhook.objects.filter(run=run).exists()
    ingest(batch([1], lambda s: {M.REWARD_MEAN: None}))
    delivery = _settled(run)
    assert (delivery.state, delivery.attempts, delivery.url) == ("delivered", 1, hook.url)
    assert [(b["run"]["id"], b["rule"]["kind"], b["state"]) for b in hook.bodies] == [(run.pk, "non_finite", "firing")]


def test_the_runs_own_webhook_wins_over_the_default_and_an_opted_out_run_delivers_nothing(
    run, ingest, monkeypatch, django_capture_on_commit_callbacks
):
    sent = []
    monkeypatch.setattr(evaluate, "send_delivery", sent.append)
    ExperimentAlertWebhook.objects.create(experiment=run.experiment, url="https://hooks.example.com/exp")
    own = AlertWebhook.objects.create(run=run, url="https://hooks.example.com/run")
    with django_capture_on_commit_callbacks(execute=True):
        ingest(batch([1], lambda s: {M.REWARD_MEAN: None}))  # fires
    assert list(AlertDelivery.objects.filter(run=run).values_list("url", flat=True)) == [own.url]
    AlertWebhook.objects.filter(run=run).update(url="", off=True)
    with django_capture_on_commit_callbacks(execute=True):
        ingest(batch([2], lambda s: {M.REWARD_MEAN: 0.5}))  # resolves: the run opted out, no delivery
    assert [p["state"] for _k, p in alert_events(run)] == ["firing", "resolved"]
    assert AlertDelivery.objects.filter(run=run).count() == 1 and len(sent) == 1


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


@pytest.mark.django_db(transaction=True)
def test_a_name_rebound_to_a_private_address_after_the_check_is_not_followed(
    run, ingest, worker, receiver, settings, monkeypatch
):
    """DNS rebinding: the name resolves to a public address when checked and to the receiver on 127.0.0.1 when
    a client would resolve it again to connect; the request goes to the checked address, never the receiver."""
    import socket

    settings.TANDEM_ALERT_WEBHOOK_ALLOW_PRIVATE = False
    settings.TANDEM_ALERT_WEBHOOK_TIMEOUT_S = 1.0
    settings.TANDEM_ALERT_WEBHOOK_RETRIES = 0
    hook = receiver(200)
    port = hook.stub.port
    real = socket.getaddrinfo
    answers = iter(["93.184.215.14"])  # public (is_global): passes the check once

    def rebinding(host, *args, **kwargs):
        if host != "hooks.rebind.test":
            return real(host, *args, **kwargs)
        address = next(answers, "127.0.0.1")
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, port))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    AlertWebhook.objects.create(run=run, url=f"http://hooks.rebind.test:{port}/hooks/tandem")
    ingest(batch([1], lambda s: {M.REWARD_MEAN: None}))
    delivery = _settled(run)
    assert delivery.state == "failed" and "non-public" not in delivery.error  # checked, then unreachable
    assert hook.bodies == []  # the rebound address was never called


def test_the_checked_address_is_the_one_connected_to():
    """With the pin the connection goes to the address given (the URL's host stays the Host header) and the
    name is never resolved again; without it the name must resolve."""
    from jobs.alerts import webhook

    seen = {}

    class Handler(QuietHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            seen["host"] = self.headers["Host"]
            self.rfile.read(int(self.headers["Content-Length"]))
            answer(self, 200, {"ok": True})

    stub = StubServer(Handler)
    try:
        port = stub.port
        assert webhook.post(f"http://unresolvable.invalid:{port}/x", {"a": 1}, address="127.0.0.1") is None
        assert seen["host"] == f"unresolvable.invalid:{port}"
        assert webhook.post(f"http://unresolvable.invalid:{port}/x", {"a": 1}) is not None  # no pin: no name
    finally:
        stub.stop()


def test_a_broker_outage_never_fails_ingest(run, ingest, monkeypatch, django_capture_on_commit_callbacks):
    def down(*args, **kwargs):
        raise ConnectionError("broker down")

    monkeypatch.setattr(evaluate.app, "signature", down)
    AlertWebhook.objects.create(run=run, url="https://hooks.example.com/x")
    with django_capture_on_commit_callbacks(execute=True):
        reply = ingest(batch([1], lambda s: {M.REWARD_MEAN: None}))
    assert reply["points"]["inserted"] == 1
    assert AlertDelivery.objects.get(run=run).state == AlertDelivery.PENDING
