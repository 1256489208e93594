"""The sample queue's server against queueing theory: M/D/1 (Poisson arrivals, fixed service time).

Mean wait in line ``W_q = rho / (2 mu (1 - rho))`` (Pollaczek-Khinchine with zero service variance).
A long seeded run; the tolerance is the run's own statistical error (batch means), not a guess.
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import simpy

from capacity.server import FifoServer


def md1_waits(rate: float, service_s: float, customers: int, seed: int) -> list[float]:
    env = simpy.Environment()
    server = FifoServer(env)
    waits: list[float] = []
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, customers)

    def customer():
        arrived = env.now
        yield from server.serve(service_s)
        waits.append(env.now - arrived - service_s)  # in line: the time in the system less the service

    def arrivals():
        for gap in gaps:
            yield env.timeout(gap)
            env.process(customer())

    env.process(arrivals())
    env.run()
    return waits


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_mean_wait_matches_the_md1_closed_form(rho):
    service_s = 0.01  # mu = 100 requests/s
    mu = 1.0 / service_s
    waits = md1_waits(rate=rho * mu, service_s=service_s, customers=60_000, seed=11)
    expected = rho / (2 * mu * (1 - rho))
    # batch means: waits of neighbouring customers are correlated, batches of 2,000 nearly are not
    batches = [statistics.fmean(waits[i : i + 2000]) for i in range(2000, len(waits), 2000)]  # first batch: warm-up
    mean = statistics.fmean(batches)
    standard_error = statistics.stdev(batches) / math.sqrt(len(batches))
    assert standard_error < 0.1 * expected  # the run is long enough for the check to mean something
    assert abs(mean - expected) < 4 * standard_error


def test_the_server_serves_in_arrival_order_one_at_a_time():
    env = simpy.Environment()
    server = FifoServer(env)
    done: list[tuple[str, float]] = []

    def request(name: str, at: float, service_s: float):
        yield env.timeout(at)
        yield from server.serve(service_s)
        done.append((name, env.now))

    env.process(request("a", 0.0, 2.0))
    env.process(request("b", 0.5, 1.0))
    env.process(request("c", 1.0, 1.0))
    env.run()
    assert done == [("a", 2.0), ("b", 3.0), ("c", 4.0)]
    assert server.total_wait_s == pytest.approx(1.5 + 2.0)  # b waits 1.5 s, c 2 s
    assert server.busy_s == 4.0
