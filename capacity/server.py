"""A single first-come-first-served server: the sample queue's request handling (the DistQueue).

Each request holds the server for its service time; requests arriving meanwhile wait in order. With
Poisson arrivals and a fixed service time it is the M/D/1 queue, whose mean wait in line is
``rho / (2 mu (1 - rho))`` (Pollaczek-Khinchine with zero service variance; Kleinrock, Queueing
Systems vol. 1, 1975, section 5.6) — the test that checks the simulation's queueing against a
closed form.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import simpy


class FifoServer:
    """One server, requests served in arrival order; counts the waits and the busy time."""

    def __init__(self, env: simpy.Environment):
        self.env = env
        self._slot = simpy.Resource(env, capacity=1)
        self.served = 0
        self.total_wait_s = 0.0
        self.busy_s = 0.0

    def serve(self, service_s: float) -> Generator[Any, Any, None]:
        """A request: wait for the server, hold it ``service_s`` (use with ``yield from``)."""
        arrived = self.env.now
        with self._slot.request() as turn:
            yield turn
            self.total_wait_s += self.env.now - arrived
            self.served += 1
            yield self.env.timeout(service_s)
            self.busy_s += service_s

    @property
    def mean_wait_s(self) -> float:
        return self.total_wait_s / self.served if self.served else 0.0
