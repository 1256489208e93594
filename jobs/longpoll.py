"""Waiting for a run to end without holding a database connection (``GET /api/runs/{id}/wait/``).

The view answers at once through DRF when it can (bad input, no such run,
already ended) and hands its connection back. Otherwise ``wait_until_ended``
registers with this process's listener, the member of the channel-layer group
``run.<id>.end`` (jobs.stream sends to it once a run's terminal state has
committed; one member per process and run however many wait, as the live UI's
relays), re-reads the state once (the run may have ended before the join), and
sleeps until the listener wakes it or the time is up. The state is read in one
short query whose connection goes back to the pool at once, after a wake-up and
every ``RECHECK_S`` besides: a channel-layer message can be lost, a committed
state cannot. So hundreds of waiting CI jobs hold no PostgreSQL connection, no
pool slot and no Redis connection of their own while they wait.

Without a working channel layer a waiter polls the state instead: every
``POLL_FIRST_S`` at first, backing off to every ``POLL_MAX_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import weakref
from collections import Counter

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.db import connection

from jobs import stream
from jobs.models import Run
from jobs.states import TERMINAL_STATES, RunState

__all__ = ["POLL_FIRST_S", "POLL_MAX_S", "RECHECK_S", "parked", "wait_until_ended"]

log = logging.getLogger(__name__)

# With the channel layer: the longest a lost message can delay an answer (500 waiters: about 17 reads/s).
RECHECK_S = 30.0
# Without it: a CI job needs no finer resolution than this.
POLL_FIRST_S = 0.25
POLL_MAX_S = 2.0

# Requests of this process now parked in wait_until_ended, by run (what the tests and bench/longpoll.py watch).
_parked: Counter[int] = Counter()


def parked(run_id: int) -> int:
    """How many requests of this process are waiting for ``run_id`` to end, past their first state read."""
    return _parked[run_id]


def _ended(run_id: int) -> bool:
    """True when the run is in a terminal state, or gone (the answer that follows is then a 404)."""
    try:
        state = Run.objects.filter(pk=run_id).values_list("state", flat=True).first()
    finally:
        if not connection.in_atomic_block:  # (inside a test's transaction there is nothing to hand back)
            connection.close()  # back to the pool now, not at the end of the request
    return state is None or RunState(state) in TERMINAL_STATES


_ended_async = sync_to_async(_ended)


class _Listener:
    """This event loop's member of the ``run.<id>.end`` groups: one channel, the waiting requests per run."""

    def __init__(self, layer):
        self.layer = layer
        self.channel: str | None = None
        self.pump: asyncio.Task | None = None
        self.waiting: dict[int, set[asyncio.Event]] = {}
        self.lock = asyncio.Lock()  # joins and leaves of groups take turns

    async def add(self, run_id: int) -> asyncio.Event:
        async with self.lock:
            if self.channel is None:
                self.channel = await self.layer.new_channel()
                self.pump = asyncio.create_task(self._pump())
            if run_id not in self.waiting:
                await self.layer.group_add(stream.run_end_group(run_id), self.channel)
                self.waiting[run_id] = set()
            event = asyncio.Event()
            self.waiting[run_id].add(event)
            return event

    async def remove(self, run_id: int, event: asyncio.Event) -> None:
        async with self.lock:
            events = self.waiting.get(run_id)
            if events is None:
                return
            events.discard(event)
            if not events:
                del self.waiting[run_id]
                await self.layer.group_discard(stream.run_end_group(run_id), self.channel)

    async def _pump(self) -> None:
        # (during an outage, waiters find the end at their next re-check)
        async for message in stream.channel_messages(self.layer, self.channel, "long-poll listener"):
            for event in self.waiting.get(message.get("run"), ()):
                event.set()


_listeners: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Listener] = weakref.WeakKeyDictionary()


def _listener(layer) -> _Listener:
    loop = asyncio.get_running_loop()  # one per process under uvicorn; tests run several loops
    if loop not in _listeners:
        _listeners[loop] = _Listener(layer)
    return _listeners[loop]


async def wait_until_ended(run_id: int, timeout: float) -> None:
    """Return once the run has ended, or after ``timeout`` seconds; holds no database connection meanwhile."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    layer = get_channel_layer()
    listener = _listener(layer) if layer is not None else None
    event: asyncio.Event | None = None
    counted = False
    try:
        if listener is not None:
            try:
                event = await listener.add(run_id)
            except Exception:  # a channel-layer outage: poll instead
                log.warning("long-poll of run %s cannot listen on the channel layer; polling", run_id, exc_info=True)
        pause = POLL_FIRST_S
        # Waiters that came together must not re-check together: the first re-check is spread out.
        recheck = RECHECK_S * random.uniform(0.5, 1.0)
        while not await _ended_async(run_id):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            if not counted:
                _parked[run_id] += 1
                counted = True
            if event is None:
                await asyncio.sleep(min(pause, remaining))
                pause = min(pause * 2, POLL_MAX_S)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout=min(recheck, remaining))
            event.clear()
            recheck = RECHECK_S
    finally:
        if counted:
            _parked[run_id] -= 1
            if not _parked[run_id]:
                del _parked[run_id]
        if event is not None:
            try:
                await listener.remove(run_id, event)
            except Exception:  # the membership expires with channels_redis's group_expiry
                log.warning("long-poll of run %s could not leave its channel group", run_id, exc_info=True)
