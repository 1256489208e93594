"""The remote reward client against a real local HTTP server that is slow, fails, or hangs on purpose."""

from __future__ import annotations

import pytest

from runtime.samples import Sample
from runtime.spec import RewardSpec
from runtime.tasks.reward_service import RewardClient, apply_rewards
from tests.runtime.reward_server import RewardServer


@pytest.fixture()
def server():
    s = RewardServer()
    yield s
    s.close()


def client(server, **kw):
    args = {"timeout_s": 2.0, "max_retries": 2, "backoff_s": 0.01, "breaker_failures": 100, "breaker_cooldown_s": 60}
    return RewardClient(server.url, **{**args, **kw})


def test_scores_and_sends_prompt_response_answer(server):
    c = client(server)
    r = c.score("reverse:ab=", "ba", "ba")
    assert (r.reward, r.attempts, r.dropped) == (2.0, 1, False)
    assert server.bodies == [{"prompt": "reverse:ab=", "response": "ba", "answer": "ba"}]
    assert c.metrics()["reward/scored"] == 1 and c.metrics()["reward/dropped"] == 0


def test_failures_are_retried_with_backoff_until_success(server):
    server.mode, server.flaky_failures = "flaky", 2
    c = client(server)
    r = c.score("p", "abc", "")
    assert (r.reward, r.attempts) == (3.0, 3)
    assert server.hits == 3
    m = c.metrics()
    assert (m["reward/retries"], m["reward/failures"], m["reward/dropped"]) == (2, 2, 0)


def test_a_failing_server_gets_bounded_retries_then_the_sample_is_dropped(server):
    server.mode = "fail"
    c = client(server, max_retries=2)
    r = c.score("p", "abc", "")
    assert r.dropped and r.attempts == 3 and r.error == "HTTP 500"
    assert server.hits == 3
    assert c.metrics()["reward/dropped"] == 1


def test_a_hanging_server_times_out_and_the_sample_is_dropped(server):
    server.mode = "hang"
    c = client(server, timeout_s=0.2, max_retries=1)
    r = c.score("p", "abc", "")
    assert r.dropped and r.attempts == 2 and "timed out" in r.error
    assert server.hits == 2


def test_a_slow_server_within_the_timeout_still_scores(server):
    server.mode = "slow"
    r = client(server, timeout_s=5.0).score("p", "abcd", "")
    assert (r.reward, r.attempts) == (4.0, 1)


def test_bad_replies_are_retried_and_client_errors_are_not(server):
    server.mode = "bad"
    c = client(server, max_retries=1)
    r = c.score("p", "x", "")
    assert r.dropped and "bad reply" in r.error and server.hits == 2
    server.mode, server.hits = "reject", 0
    r = c.score("p", "x", "")
    assert r.dropped and r.error == "HTTP 400" and server.hits == 1  # a 4xx is the request's fault


def test_unreachable_server_is_dropped_not_raised():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = RewardClient(f"http://127.0.0.1:{port}/", timeout_s=1.0, max_retries=1, backoff_s=0.0)
    r = c.score("p", "x", "")
    assert r.dropped and r.attempts == 2 and "refused" in r.error.lower()


def test_circuit_breaker_opens_fails_fast_and_recovers_through_a_probe(server):
    server.mode = "fail"
    c = client(server, max_retries=0, breaker_failures=3, breaker_cooldown_s=0.3)
    now = [1000.0]  # the breaker's own clock, moved by hand: a stalled busy machine cannot end a cool-down early
    c.breaker.clock = lambda: now[0]
    for _ in range(3):
        assert c.score("p", "x", "").error == "HTTP 500"
    assert c.breaker.state == "open" and server.hits == 3
    r = c.score("p", "x", "")  # open: no network at all
    assert r.dropped and r.attempts == 0 and r.error == "circuit breaker open" and server.hits == 3
    assert c.metrics()["reward/circuit_open"] == 1 and c.metrics()["reward/rejected"] == 1

    now[0] += 0.35  # cool-down over: one half-open probe goes out; it fails and re-opens the breaker
    assert c.score("p", "x", "").error == "HTTP 500" and server.hits == 4
    assert c.breaker.state == "open"
    assert c.score("p", "x", "").attempts == 0 and server.hits == 4

    server.mode = "ok"
    now[0] += 0.35  # the next probe succeeds and closes it
    assert c.score("p", "xy", "").reward == 2.0
    assert c.breaker.state == "closed" and server.hits == 5
    assert c.metrics()["reward/circuit_opened"] == 2


def test_concurrency_limit_bounds_requests_in_flight(server):
    server.mode = "slow"
    c = client(server, concurrency=2, timeout_s=5.0)
    results = c.score_many([("p", "x" * i, "") for i in range(6)])
    assert [r.reward for r in results] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # input order kept
    assert server.max_in_flight == 2


def test_dropped_samples_are_left_out_and_counted(server):
    samples = [Sample(i, i, i, [1], [5], [0.0], [0], "stop") for i in range(3)]
    server.mode, server.flaky_failures = "flaky", 1
    c = client(server, max_retries=0)
    results = [c.score("p", "abc", ""), c.score("p", "ab", ""), c.score("p", "a", "")]
    kept, dropped = apply_rewards(samples, results)
    assert [s.sample_id for s in kept] == [1, 2] and dropped == 1
    assert [s.reward for s in samples] == [0.0, 2.0, 1.0]  # the dropped sample is untouched
    assert c.metrics()["reward/dropped"] == 1


def test_spec_and_bad_urls():
    spec = RewardSpec(url="http://127.0.0.1:9/score", max_retries=4, concurrency=3)
    c = RewardClient.from_spec(spec)
    assert (c.url, c.max_retries, c.concurrency, c.timeout_s) == ("http://127.0.0.1:9/score", 4, 3, 10.0)
    with pytest.raises(ValueError, match="reward.url: 'ftp://x' does not parse"):
        RewardClient("ftp://x")
    with pytest.raises(ValueError, match="reward.url: 'http://h:70000/' does not parse"):
        RewardClient("http://h:70000/")
    with pytest.raises(ValueError, match="no reward service configured"):
        RewardClient.from_spec(RewardSpec())
