"""A link whose bandwidth concurrent transfers share equally (processor sharing).

Used for the inter-node bandwidth term of communications (:class:`capacity.comm.CommPlan`'s
``inter_bytes``): with a shared comm domain the trainer's all-reduce and the sampling side's weight
publication and sample transfer are flows on one such link and slow each other; with separate
domains each traffic class has a link of its own. Max-min fair sharing of one bottleneck reduces to
equal shares (Bertsekas and Gallager, Data Networks, 2nd ed., 1992, section 6.5.2).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import simpy

_DONE_BYTES = 1e-3  # a flow with this little left is finished (floating-point residue of large transfers)


class SharedLink:
    """Transfers in progress each get ``bandwidth / n`` while ``n`` are in progress."""

    def __init__(self, env: simpy.Environment, bandwidth_bytes_per_s: float):
        self.env = env
        self.bandwidth = bandwidth_bytes_per_s
        self._flows: list[list[Any]] = []  # [bytes left, event to trigger when done]
        self._updated = env.now
        self._changed = env.event()
        self.bytes_sent = 0.0
        env.process(self._run())

    def send(self, nbytes: float) -> simpy.Event:
        """An event that triggers when ``nbytes`` have crossed the link."""
        done = self.env.event()
        if nbytes <= 0:
            done.succeed()
            return done
        self._advance()
        self._flows.append([float(nbytes), done])
        self.bytes_sent += nbytes
        if not self._changed.triggered:
            self._changed.succeed()
        return done

    def _advance(self) -> None:
        """Take the bytes sent since the last update off every flow."""
        now = self.env.now
        if self._flows and now > self._updated:
            sent = (now - self._updated) * self.bandwidth / len(self._flows)
            for flow in self._flows:
                flow[0] -= sent
        self._updated = now

    def _run(self) -> Generator[Any, Any, None]:
        while True:
            first: list[Any] | None = None
            if not self._flows:
                yield self._changed
            else:
                first = min(self._flows, key=lambda flow: flow[0])
                ends_at = self.env.now + max(first[0], 0.0) * len(self._flows) / self.bandwidth
                yield self._changed | self.env.timeout(ends_at - self.env.now)
            if self._changed.triggered:
                self._changed = self.env.event()
            self._advance()
            if first is not None and self.env.now >= ends_at:
                # done by construction, whatever the floating-point residue (at a late clock a residue
                # can be too small to move the clock, and would otherwise be waited for for ever)
                first[0] = 0.0
            finished = [flow for flow in self._flows if flow[0] <= _DONE_BYTES]
            self._flows = [flow for flow in self._flows if flow[0] > _DONE_BYTES]
            for flow in finished:
                flow[1].succeed()
