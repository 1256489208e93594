"""HttpReporter against a real local HTTP server that goes down and comes back."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from runtime.contract import SPOOL_FILE
from runtime.managed.reporter import HttpReporter
from runtime.metrics import ReporterError
from tests.http_stub import QuietHandler, StubServer, answer

TOKEN = "run-token-123"


class Platform:
    """A stand-in ingest endpoint that stores points by their idempotency key, like the platform.

    ``mode``: ``ok``; ``503`` (refuse); ``ack_lost`` (store, then answer 500, as if the reply got lost).
    """

    def __init__(self, port: int = 0):
        self.mode = "ok"
        self.ack_lost_left = 0
        self.requests: list[dict] = []  # every accepted-for-processing body, in arrival order
        self.stored: dict[tuple, float | None] = {}  # (run, attempt, step, metric) -> value
        self.first_seen: list[int] = []  # steps in order of first storage
        self.events: dict[tuple, dict] = {}  # (run, attempt, seq) -> event
        self.reply = {"commands": []}
        self.lock = threading.Lock()
        platform = self

        class Handler(QuietHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return answer(self, 401, {"error": "bad token"})
                with platform.lock:
                    if platform.mode == "503":
                        return answer(self, 503, {"error": "maintenance"})
                    platform.requests.append(body)
                    for p in body["points"]:
                        for name, value in p["metrics"].items():
                            key = (body["run"], body["attempt"], p["step"], name)
                            if key not in platform.stored and p["step"] not in platform.first_seen:
                                platform.first_seen.append(p["step"])
                            platform.stored.setdefault(key, value)
                    for e in body["events"]:
                        platform.events.setdefault((body["run"], body["attempt"], e["seq"]), e)
                    if platform.ack_lost_left > 0:
                        platform.ack_lost_left -= 1
                        return answer(self, 500, {"error": "reply lost"})
                answer(self, 200, platform.reply)

        self.stub = StubServer(Handler, port)
        self.port, self.url = self.stub.port, self.stub.url

    def stop(self):
        self.stub.stop()

    def received_steps(self) -> list[int]:
        return [p["step"] for body in self.requests for p in body["points"]]


@pytest.fixture
def platform():
    p = Platform()
    yield p
    p.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make(url: str, spool, **kw) -> HttpReporter:
    kw.setdefault("min_interval_s", 0.0)
    return HttpReporter(url, TOKEN, spool, run="r1", attempt=0, backoff_s=0.02, backoff_max_s=0.1, **kw)


def test_points_and_events_are_delivered_once_in_order(platform, tmp_path):
    replies = []
    rep = make(platform.url, tmp_path / "spool", on_reply=replies.append)
    for step in range(1, 6):
        rep.report(step, {"reward/mean": step / 10, "weights/version": step})
    rep.event("checkpoint", {"step": 5, "loss": float("nan")})
    assert rep.flush(timeout=30)
    rep.close()

    assert platform.first_seen == [1, 2, 3, 4, 5]
    assert sorted(platform.received_steps()) == [1, 2, 3, 4, 5]  # no resend
    assert platform.stored[("r1", 0, 3, "reward/mean")] == 0.3
    assert platform.stored[("r1", 0, 5, "weights/version")] == 5
    (event,) = platform.events.values()
    assert (event["kind"], event["payload"], event["seq"]) == ("checkpoint", {"step": 5, "loss": None}, 5)
    assert replies and replies[0] == {"commands": []}
    assert rep.pending() == 0
    assert (tmp_path / "spool" / SPOOL_FILE).stat().st_size == 0  # compacted once delivered


def test_outage_then_recovery_loses_and_duplicates_nothing(platform, tmp_path):
    rep = make(platform.url, tmp_path / "spool")
    for step in (1, 2, 3):
        rep.report(step, {"accuracy": 0.5})
    assert rep.flush(timeout=30)

    platform.mode = "503"
    for step in (4, 5, 6):
        rep.report(step, {"accuracy": 0.6})
    assert not rep.flush(timeout=0.5)
    assert rep.pending() == 3
    assert "HTTP 503" in rep.last_error
    spooled = [json.loads(line) for line in (tmp_path / "spool" / SPOOL_FILE).read_text().splitlines()]
    assert [r["step"] for r in spooled] == [4, 5, 6]

    platform.mode = "ok"
    assert rep.flush(timeout=30)
    rep.close()
    assert platform.first_seen == [1, 2, 3, 4, 5, 6]
    assert sorted(platform.received_steps()) == [1, 2, 3, 4, 5, 6]
    assert rep.last_error is None


def test_lost_acknowledgements_are_resent_with_the_same_keys(platform, tmp_path):
    platform.ack_lost_left = 2
    rep = make(platform.url, tmp_path / "spool")
    for step in range(1, 5):
        rep.report(step, {"accuracy": step / 4})
    assert rep.flush(timeout=30)
    rep.close()
    received = platform.received_steps()
    assert len(received) > 4  # the platform saw resends ...
    assert sorted(set(received)) == [1, 2, 3, 4]
    assert sorted(k[2] for k in platform.stored) == [1, 2, 3, 4]  # ... and stored each point once
    seqs = {}
    for body in platform.requests:
        for p in body["points"]:
            assert seqs.setdefault(p["step"], p["seq"]) == p["seq"]  # a resend carries the same record


def test_platform_down_at_start_then_spool_replayed_by_a_new_reporter(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    spool = tmp_path / "spool"
    first = make(url, spool)
    for step in (1, 2, 3):
        first.report(step, {"reward/mean": 0.1 * step})
    first.event("resume", {"step": 0})
    assert not first.flush(timeout=0.3)
    assert "unreachable" in first.last_error
    first.close(timeout=0.1)  # "crash": nothing delivered, all of it in the spool
    with open(spool / SPOOL_FILE, "ab") as fh:
        fh.write(b'{"seq": 4, "step": 4, "ti')  # a line torn by a crash mid-append

    platform = Platform(port)
    try:
        second = make(url, spool, batch_size=2)
        second.report(4, {"reward/mean": 0.4})
        assert second.flush(timeout=30)
        second.close()
        assert platform.first_seen == [1, 2, 3, 4]
        assert sorted(platform.received_steps()) == [1, 2, 3, 4]
        assert [len(b["points"]) + len(b["events"]) for b in platform.requests] == [2, 2, 1]
        seqs = [r["seq"] for b in platform.requests for r in b["points"] + b["events"]]
        assert sorted(seqs) == [0, 1, 2, 3, 4]  # the torn line's seq 4 went to the new step 4

        # A third reporter on the delivered spool sends nothing old, and numbering continues.
        n = len(platform.requests)
        third = make(url, spool)
        third.event("done", {})
        assert third.flush(timeout=30)
        third.close()
        assert len(platform.requests) == n + 1
        assert [e["seq"] for e in platform.requests[-1]["events"]] == [5]
    finally:
        platform.stop()


def test_a_refused_token_stops_the_sender_and_keeps_the_spool(platform, tmp_path):
    """401: the run ended and its token with it. No retry can succeed: the sender stops after one POST,
    flush and close return at once, and everything reported stays in the spool for the platform's replay."""
    rep = HttpReporter(platform.url, "wrong", tmp_path / "spool", run="r1", backoff_s=0.02, backoff_max_s=0.05)
    rep.report(1, {"accuracy": 1.0})
    assert not rep.flush(timeout=60)  # returns when the sender gives up, not after the 60 s
    assert rep.refused and rep.last_error.startswith("HTTP 401")
    rep.report(2, {"accuracy": 1.0})  # still spooled after the refusal
    rep.close(timeout=60)
    assert platform.stored == {}
    assert len((tmp_path / "spool" / SPOOL_FILE).read_text().splitlines()) == 2


def test_bad_arguments(tmp_path):
    with pytest.raises(ReporterError, match="base_url must start with http"):
        HttpReporter("localhost:8000", TOKEN, tmp_path)
    with pytest.raises(ReporterError, match="batch_size must be >= 1"):
        HttpReporter("http://x", TOKEN, tmp_path, batch_size=0)
    (tmp_path / "cursor.json").write_text("{}")
    with pytest.raises(ReporterError, match="cursor.json: unreadable spool cursor"):
        HttpReporter("http://x", TOKEN, tmp_path)


def test_reporting_after_close_is_an_error(platform, tmp_path):
    rep = make(platform.url, tmp_path / "spool")
    rep.close()
    with pytest.raises(ReporterError, match="closed"):
        rep.report(1, {"accuracy": 1.0})


def test_a_flush_with_nothing_left_does_not_send_the_next_record_early(platform, tmp_path):
    rep = make(platform.url, tmp_path / "spool", min_interval_s=30.0)
    try:
        rep.report(1, {"reward/mean": 0.1})
        assert rep.flush(timeout=30)
        assert rep.flush(timeout=30)  # nothing left to deliver
        rep.report(2, {"reward/mean": 0.2})
        time.sleep(0.5)  # a stale wake-up would have sent it within milliseconds
        assert (rep.pending(), platform.received_steps()) == (1, [1])  # it waits out min_interval_s
        assert rep.flush(timeout=30)  # until the next flush
        assert platform.received_steps() == [1, 2]
    finally:
        rep.close()
