"""The runtime's real HttpReporter against the real ingest API (pytest-django's live_server).

A small forwarding proxy sits between them so the test can take the platform
"down" (503, nothing forwarded) and lose replies (forwarded and stored, but the
reporter sees a 502 and resends): every point must still arrive exactly once.
"""

from __future__ import annotations

import threading

import pytest

from jobs import commands
from jobs.ingest.tokens import mint_run_token
from jobs.models import MetricPoint, RunEvent
from runtime.managed.reporter import HttpReporter
from tests.ingest.helpers import Proxy


@pytest.fixture
def proxy(live_server):
    p = Proxy(live_server.url)
    yield p
    p.stop()


def _reporter(url, token, spool, run, **kw):
    return HttpReporter(
        url,
        token,
        spool,
        run=str(run.pk),
        attempt=0,
        role="trainer-0",
        batch_size=7,
        min_interval_s=0.0,
        backoff_s=0.02,
        backoff_max_s=0.1,
        **kw,
    )


def _wait(predicate, what, timeout=30.0):
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_every_point_arrives_exactly_once_across_an_outage_and_lost_replies(run, owner, proxy, tmp_path):
    token = mint_run_token(run, 0)
    command = commands.create(owner, run, "pause")
    replies: list[dict] = []
    reporter = _reporter(proxy.url, token, tmp_path / "spool", run, on_reply=replies.append)

    for step in range(0, 20):
        reporter.report(step, {"reward/mean": step / 100, "loss": 1.0 - step / 100})
    reporter.event("checkpoint", {"step": 19, "path": f"run-{run.pk}/checkpoints/step-19"})
    assert reporter.flush(timeout=60)

    proxy.mode = "down"
    for step in range(20, 40):
        reporter.report(step, {"reward/mean": step / 100, "loss": 1.0 - step / 100})
    _wait(lambda: proxy.refused >= 3, "the reporter to hit the outage")
    assert reporter.pending() == 20

    proxy.mode = "lose_replies"
    _wait(lambda: proxy.forwarded >= 10, "batches stored with lost replies")
    assert reporter.pending() > 0  # no reply seen: the reporter still holds them

    proxy.mode = "ok"
    for step in range(40, 50):
        reporter.report(step, {"reward/mean": step / 100, "loss": 1.0 - step / 100})
    assert reporter.flush(timeout=60)
    reporter.close()

    rows = MetricPoint.objects.filter(run=run).order_by("step")
    assert [r.step for r in rows] == list(range(50))
    assert all(r.metrics == {"reward/mean": r.step / 100, "loss": 1.0 - r.step / 100} for r in rows)
    assert all(r.attempt == 0 and not r.rewound for r in rows)
    (event,) = RunEvent.objects.filter(run=run)
    assert (event.kind, event.role, event.payload) == (
        "checkpoint",
        "trainer-0",
        {"step": 19, "path": f"run-{run.pk}/checkpoints/step-19"},
    )
    assert run.checkpoints.get().path == f"run-{run.pk}/checkpoints/step-19"
    # The pending command rode back on the first acknowledged reply.
    delivered = [c for reply in replies for c in reply["commands"]]
    assert delivered[0] == {"id": command.pk, "kind": "pause", "args": {}}


def test_a_wrong_token_keeps_the_spool_and_stores_nothing(run, live_server, tmp_path):
    reporter = _reporter(live_server.url, "tdr_00000000_not-a-token", tmp_path / "spool", run)
    reporter.report(1, {"reward/mean": 0.5})

    assert not reporter.flush(timeout=0.5)
    assert reporter.last_error.startswith("HTTP 401")
    reporter.close(timeout=0.1)

    assert reporter.pending() == 1
    assert MetricPoint.objects.count() == 0


def test_two_roles_reporting_the_same_steps_at_once_share_one_row_per_step(run, live_server, tmp_path):
    token = mint_run_token(run, 0)
    trainer = _reporter(live_server.url, token, tmp_path / "trainer", run)
    rollout = HttpReporter(
        live_server.url,
        token,
        tmp_path / "rollout",
        run=str(run.pk),
        role="rollout-0",
        batch_size=5,
        min_interval_s=0.0,
    )

    def report(reporter, name):
        for step in range(60):
            reporter.report(step, {name: float(step)})

    threads = [threading.Thread(target=report, args=a) for a in ((trainer, "loss"), (rollout, "reward/mean"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert trainer.flush(timeout=60) and rollout.flush(timeout=60)
    trainer.close()
    rollout.close()

    rows = list(MetricPoint.objects.filter(run=run).order_by("step").values_list("step", "metrics"))
    assert rows == [(s, {"loss": float(s), "reward/mean": float(s)}) for s in range(60)]
