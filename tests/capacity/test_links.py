"""The shared link: concurrent transfers split its bandwidth equally."""

from __future__ import annotations

import pytest
import simpy

from capacity.links import SharedLink


def finish_times(starts: list[tuple[float, float]], bandwidth: float, clock: float = 0.0) -> list[float]:
    env = simpy.Environment(initial_time=clock)
    link = SharedLink(env, bandwidth)
    done: list[float] = [0.0] * len(starts)

    def transfer(i: int, at: float, nbytes: float):
        yield env.timeout(at)
        yield link.send(nbytes)
        done[i] = env.now

    for i, (at, nbytes) in enumerate(starts):
        env.process(transfer(i, at, nbytes))
    for _ in range(10_000):  # a bounded run: a transfer that never ends fails here instead of hanging
        if env.peek() == float("inf"):
            break
        env.step()
    assert env.peek() == float("inf"), "transfers still in progress after 10,000 events"
    return done


def test_a_transfer_alone_gets_the_whole_bandwidth():
    assert finish_times([(0.0, 100.0)], bandwidth=10.0) == [pytest.approx(10.0)]


def test_two_transfers_share_the_bandwidth_while_both_run():
    # B joins at 5 s with A half done: both at 5 B/s until A ends at 15 s, then B alone
    assert finish_times([(0.0, 100.0), (5.0, 100.0)], bandwidth=10.0) == [
        pytest.approx(15.0),
        pytest.approx(20.0),
    ]


def test_transfers_end_at_a_late_clock_whatever_the_rounding():
    # at t = 1e9 s the clock's resolution is ~1e-7 s, kilobytes of residue at 40 GB/s
    clock = 1e9
    done = finish_times([(0.0, 15.22e9 / 3), (0.1, 7.61e9), (0.2, 12345.678)], bandwidth=40e9, clock=clock)
    assert all(t > clock for t in done)
