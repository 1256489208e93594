"""WebSocket consumers of the live UI: one run's stream (``ws/runs/<id>/``) and the runs list (``ws/runs/``).

Thin: authenticate from the session, check the team, join the channel groups,
relay. Close codes: 4401 without a signed-in user, 4404 for a run the user may
not see (another team's looks like a missing one).

Access is checked again while a socket is open (rlplatform.permissions.recheck_socket):
at once when the user's memberships change (rlplatform.memberships sends
``access.changed`` to the user's group) and every ``TANDEM_WS_ACCESS_RECHECK_S``
seconds for changes made elsewhere (a user deleted or deactivated, a row edited
in the database). A socket that lost its team closes with 4404, one whose user
is gone or deactivated with 4401, and sends nothing more.

Run protocol (docs/live-ui-backend.md): the client sends
``{"type": "subscribe", "after": n}``; the server sends every entry with
seq > n in order, then ``{"type": "live", "seq": m}``, then live entries. The
consumer is registered for live entries before reading the backlog, and
handles one thing at a time (the backlog read and each live message take
turns), so live entries that arrive meanwhile wait in its queue; each one is
dropped when seq <= the last sent, and when it skips ahead the missing
entries are read from the table first — so no gap and no duplicate, even
when sends race or a full channel or queue drops some.

Runs list (``ws/runs/``): a snapshot of the user's unfinished runs and their groups' device counts, then
changes. A page asks for more with ``?follow=alerts,devices``: ``alerts`` (the runs pages' alert banner) a
snapshot of the teams' runs with firing rules, then each run's rules when one changes (jobs.alerts);
``devices`` (the Cluster page) the groups' device rows (utilisation, memory, holder: jobs.device_usage), then
the rows that changed after a heartbeat or an allocation, read at most once every ``TANDEM_CLUSTER_LIVE_S``
per socket however many changes arrive (rlplatform.live). Holders are what the page shows: a run of another
team by number only.

Fan-out: one relay per process and run is the channel group's member and hands
each live message to the run's consumers in this process. A member per
consumer made the channel layer store, send and decode every message once per
viewer (50 times for 50 open tabs); through the relay it is once per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from typing import Any
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings

from jobs import device_usage, queue_order, stream
from jobs.alerts import evaluate as alerts
from jobs.models import Run, RunStreamEntry
from jobs.states import TERMINAL_STATES, RunState
from rlplatform import permissions as perms
from rlplatform.memberships import access_group

log = logging.getLogger(__name__)

CLOSE_UNAUTHENTICATED = 4401
CLOSE_NOT_FOUND = 4404
CLOSE_BAD_MESSAGE = 4400
BACKLOG_CHUNK = 500
# Live messages a consumer may have waiting (a client that reads slowly); beyond this they are dropped and
# later repaired from the table, as channels_redis does past a channel's capacity (also 100).
LIVE_QUEUE_CAPACITY = 100
# channels_redis forgets a group member after a day (group_expiry); a relay can outlive any one viewer, so it
# renews its membership this often.
RELAY_RENEW_S = 3600.0


def _user(scope):
    user = scope.get("user")
    return user if user is not None and user.is_authenticated and user.is_active else None


@database_sync_to_async
def _visible_run(user, run_id: int) -> Run | None:
    run = Run.objects.filter(pk=run_id).select_related("experiment").first()
    if run is None or not perms.can_view(user, run.experiment.team_id):
        return None
    return run


# What a failed re-check closes the socket with.
CLOSE_FOR = {perms.SocketAccess.SIGNED_OUT: CLOSE_UNAUTHENTICATED, perms.SocketAccess.LOST_TEAM: CLOSE_NOT_FOUND}
_recheck_socket = database_sync_to_async(perms.recheck_socket)


class _AccessWatch:
    """Mixin: re-check the socket's access when told (``access.changed``) and on a timer; close when lost.

    The consumer calls ``_watch_access`` once it knows its user (before its own check, so a change made
    meanwhile still reaches it), ``_set_teams`` once it knows what it shows, and ``_end_access_watch`` on
    disconnect; ``_stop_streaming`` is its hook to stop sending before the close.
    """

    _access_group: str | None = None
    _access_timer: asyncio.Task | None = None
    _user_id: int | None = None
    _teams: frozenset[int] = frozenset()
    denied = False  # set when access was lost: nothing is sent from then on

    async def _watch_access(self, user_id: int) -> None:
        self._user_id = user_id
        self._access_group = access_group(user_id)
        await self.channel_layer.group_add(self._access_group, self.channel_name)

    def _set_teams(self, team_ids) -> None:
        self._teams = frozenset(team_ids)
        self._access_timer = asyncio.create_task(self._recheck_periodically())

    async def _end_access_watch(self) -> None:
        if self._access_timer is not None and self._access_timer is not asyncio.current_task():
            self._access_timer.cancel()
        if self._access_group is not None:
            await self.channel_layer.group_discard(self._access_group, self.channel_name)
            self._access_group = None

    async def access_changed(self, message) -> None:
        if self._access_timer is not None:  # before the consumer's own check, that check decides
            await self._recheck()

    async def _recheck_periodically(self) -> None:
        while not self.denied:
            await asyncio.sleep(settings.TANDEM_WS_ACCESS_RECHECK_S)
            try:
                await self._recheck()
            except asyncio.CancelledError:
                raise
            except Exception:  # a database outage: keep the socket, try again next time
                log.warning("could not re-check the access of user %s's socket", self._user_id, exc_info=True)

    async def _recheck(self) -> None:
        if self.denied:
            return
        decision = await _recheck_socket(self._user_id, self._teams)
        if decision != perms.SocketAccess.KEEP and not self.denied:
            self.denied = True
            await self._stop_streaming()
            await self._end_access_watch()
            await self.close(code=CLOSE_FOR[decision])

    async def _stop_streaming(self) -> None:
        raise NotImplementedError


@database_sync_to_async
def _entries(run_id: int, after: int, upto: int | None = None) -> list[dict[str, Any]]:
    qs = RunStreamEntry.objects.filter(run_id=run_id, seq__gt=after)
    if upto is not None:
        qs = qs.filter(seq__lte=upto)
    rows = qs.order_by("seq").values_list("seq", "type", "data")[:BACKLOG_CHUNK]
    return [{"seq": seq, "type": type_, "data": data} for seq, type_, data in rows]


class _Relay:
    """This process's member of the channel group ``run.<id>``: passes each live message to the run's consumers."""

    def __init__(self, layer, run_id: int):
        self.layer, self.run_id = layer, run_id
        self.consumers: set[RunConsumer] = set()
        self.channel: str | None = None
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self.channel = await self.layer.new_channel()
        await self.layer.group_add(stream.run_group(self.run_id), self.channel)
        self.tasks = [asyncio.create_task(self._pump()), asyncio.create_task(self._renew())]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            # asyncio.wait, not a suppressed await of each task: a cancellation of stop() itself (an event
            # loop closing) must go through, or the loop's shutdown waits on it for ever
            await asyncio.wait(self.tasks)
        if self.channel is not None:
            await self.layer.group_discard(stream.run_group(self.run_id), self.channel)

    async def _pump(self) -> None:
        # (what an outage loses, consumers repair from the table: the next entry's gap check)
        async for message in stream.channel_messages(self.layer, self.channel, f"relay of run {self.run_id}"):
            if message.get("type") == "stream.entries":
                for consumer in list(self.consumers):
                    consumer.relay(message)

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(RELAY_RENEW_S)
            try:
                await self.layer.group_add(stream.run_group(self.run_id), self.channel)
            except Exception:  # tried again in an hour; meanwhile the membership (a day) still holds
                log.warning("relay of run %s could not renew its group membership", self.run_id, exc_info=True)


# Relays by event loop (one per process under uvicorn; tests run several loops), then by run.
_relays: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[asyncio.Lock, dict[int, _Relay]]] = (
    weakref.WeakKeyDictionary()
)


def _loop_relays() -> tuple[asyncio.Lock, dict[int, _Relay]]:
    loop = asyncio.get_running_loop()
    if loop not in _relays:
        _relays[loop] = (asyncio.Lock(), {})
    return _relays[loop]


async def _join_relay(layer, run_id: int, consumer: RunConsumer) -> None:
    lock, relays = _loop_relays()
    async with lock:  # one relay per run even when many consumers connect at once
        relay = relays.get(run_id)
        if relay is None:
            relay = _Relay(layer, run_id)
            await relay.start()
            relays[run_id] = relay
        relay.consumers.add(consumer)


async def _leave_relay(run_id: int, consumer: RunConsumer) -> None:
    lock, relays = _loop_relays()
    async with lock:
        relay = relays.get(run_id)
        if relay is None:
            return
        relay.consumers.discard(consumer)
        if not relay.consumers:
            del relays[run_id]
            await relay.stop()


class RunConsumer(_AccessWatch, AsyncJsonWebsocketConsumer):
    """One run's stream: backlog after a sequence number, then live entries."""

    async def connect(self):
        await self.accept()  # accept first so the browser sees our close code (a refused handshake is 1006)
        user = _user(self.scope)
        if user is None:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        await self._watch_access(user.pk)
        run = await _visible_run(user, int(self.scope["url_route"]["kwargs"]["run_id"]))
        if run is None:
            await self._end_access_watch()
            await self.close(code=CLOSE_NOT_FOUND)
            return
        self.run_id = run.pk
        self.last_sent: int | None = None  # None until subscribed: live entries before that are ignored
        # The backlog read and each live message take turns, so entries go out in order.
        self._turn = asyncio.Lock()
        self._live: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=LIVE_QUEUE_CAPACITY)
        self._sender = asyncio.create_task(self._send_live())
        await _join_relay(self.channel_layer, self.run_id, self)
        self._set_teams([run.experiment.team_id])

    async def disconnect(self, code):
        await self._end_access_watch()
        if getattr(self, "run_id", None) is not None:
            await _leave_relay(self.run_id, self)
            self._sender.cancel()

    async def _stop_streaming(self) -> None:
        await _leave_relay(self.run_id, self)
        async with self._turn:  # a send under way finishes; the next one sees ``denied`` and stops
            self._sender.cancel()

    def relay(self, message: dict[str, Any]) -> None:
        """A live message from this process's relay of the run (never blocks the relay)."""
        with contextlib.suppress(asyncio.QueueFull):  # dropped: the next message's gap check repairs it
            self._live.put_nowait(message)

    async def _send_live(self) -> None:
        while True:
            message = await self._live.get()
            try:
                async with self._turn:
                    await self.stream_entries(message)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("live send to a viewer of run %s failed; closing its socket", self.run_id)
                await self.close(code=1011)
                return

    async def receive_json(self, content, **kwargs):
        if getattr(self, "run_id", None) is None or self.denied:
            return
        after = content.get("after", 0) if isinstance(content, dict) else None
        if (
            not isinstance(content, dict)
            or content.get("type") != "subscribe"
            or isinstance(after, bool)
            or not isinstance(after, int)
            or after < 0
        ):
            await self.send_json(
                {"type": "error", "field": "after", "message": 'send {"type": "subscribe", "after": n}'}
            )
            return
        async with self._turn:
            self.last_sent = after
            await self._send_from_table(upto=None)
            await self.send_json({"type": "live", "seq": self.last_sent})

    async def _send_from_table(self, upto: int | None) -> None:
        """Send the stored entries after ``last_sent`` (up to ``upto``), in chunks."""
        while True:
            rows = await _entries(self.run_id, self.last_sent, upto)
            for row in rows:
                if self.denied:
                    return
                await self.send_json(row)
                self.last_sent = row["seq"]
            if len(rows) < BACKLOG_CHUNK:
                return

    async def stream_entries(self, message):
        if self.last_sent is None:
            return  # not subscribed yet: the backlog read will include these (they are committed)
        for entry in message["entries"]:
            if self.denied:
                return
            seq = entry["seq"]
            if seq <= self.last_sent:
                continue  # already sent (backlog, gap repair, or a race between senders)
            if seq > self.last_sent + 1:
                await self._send_from_table(upto=seq - 1)
            await self.send(text_data=entry["text"])  # already JSON (jobs.stream encodes once per entry)
            self.last_sent = seq


_SUMMARY_FIELDS = ("pk", "state", "reason", "experiment_id", "experiment__name", "experiment__group_id")


def _summaries(runs) -> list[dict[str, Any]]:
    """Runs-list summaries of ``runs`` (a queryset), queued ones with their positions (jobs.queue_order)."""
    rows = list(runs.values(*_SUMMARY_FIELDS).order_by("pk"))
    places = queue_order.positions_of((r["pk"], r["state"], r["experiment__group_id"]) for r in rows)
    return [stream.run_summary({**row, "queue_position": places.get(row["pk"])}) for row in rows]


@database_sync_to_async
def _visible(user) -> tuple[list[int], list[int]]:
    """The user's teams and the resource groups they may see."""
    return list(perms.teams_for(user).values_list("pk", flat=True)), list(
        perms.groups_for(user).values_list("pk", flat=True)
    )


@database_sync_to_async
def _runs_view(teams: list[int], groups: list[int]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The teams' unfinished runs as summaries, and the groups' device use."""
    runs = Run.objects.filter(experiment__team_id__in=teams).exclude(state__in=[s.value for s in TERMINAL_STATES])
    return _summaries(runs), [stream.group_usage(g) for g in groups]


@database_sync_to_async
def _queued_in_group(teams: list[int], group_id: int) -> list[dict[str, Any]]:
    """The teams' queued runs in the group, as summaries with their current positions and reasons."""
    return _summaries(Run.objects.queued().filter(experiment__team_id__in=teams, experiment__group_id=group_id))


@database_sync_to_async
def _firing(teams: list[int]) -> list[dict[str, Any]]:
    """The banner rows of the teams' runs with a firing rule (jobs.alerts.evaluate.firing_runs)."""
    return alerts.firing_runs(Run.objects.filter(experiment__team_id__in=teams))


@database_sync_to_async
def _device_rows(teams: list[int], group_id: int) -> list[dict[str, Any]]:
    """The group's device rows; a holder the teams may not see is marked so (number only)."""
    return device_usage.live_rows(group_id, Run.objects.filter(experiment__team_id__in=teams))


FOLLOW = frozenset({"alerts", "devices"})  # what a runs-list socket may follow besides runs (?follow=...)


def _follow(scope) -> frozenset[str]:
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("follow", [])
    return frozenset(part for value in values for part in value.split(",")) & FOLLOW


class RunsConsumer(_AccessWatch, AsyncJsonWebsocketConsumer):
    """The runs list and cluster view: a snapshot of the user's unfinished runs and group usage, then changes;
    with ``?follow=``, the runs' firing alerts and the groups' device rows too (see the module docstring)."""

    async def connect(self):
        await self.accept()
        user = _user(self.scope)
        if user is None:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        await self._watch_access(user.pk)
        self.groups_joined: list[str] = []
        teams, groups = await _visible(user)
        # Join before reading the snapshot: a change after the read then arrives as a message.
        for name in [stream.team_group(t) for t in teams] + [stream.cluster_group(g) for g in groups]:
            await self.channel_layer.group_add(name, self.channel_name)
            self.groups_joined.append(name)
        runs, usage = await _runs_view(teams, groups)
        self.sent_queued: dict[int, tuple] = {}  # run id -> (reason, position) last sent for a queued run
        self.queue_refresh: dict[int, asyncio.Task] = {}  # group id -> the read of its queue under way
        self.queue_dirty: set[int] = set()  # groups whose queue moved again while being read
        self.follow = _follow(self.scope)
        self.device_groups = frozenset(groups)
        self.sent_devices: dict[str, dict[str, Any]] = {}  # device key -> the row last sent
        self.devices_dirty: set[int] = set()  # groups whose devices changed since their last read
        self.devices_task: asyncio.Task | None = None
        self.devices_read_at = -float("inf")  # the event loop's time of the last read
        for run in runs:
            await self._send_run(run)
        for group in usage:
            await self.send_json({"type": "cluster", "data": group})
        if "alerts" in self.follow:
            await self.send_json({"type": "alerts", "data": {"snapshot": True, "runs": await _firing(teams)}})
        if "devices" in self.follow:
            self.devices_read_at = asyncio.get_running_loop().time()
            for group_id in sorted(groups):
                await self._send_devices(group_id, await _device_rows(teams, group_id))
        self._set_teams(teams)

    async def disconnect(self, code):
        await self._end_access_watch()
        await self._leave_groups()
        for task in list(getattr(self, "queue_refresh", {}).values()):
            task.cancel()
        if getattr(self, "devices_task", None) is not None:
            self.devices_task.cancel()

    async def _leave_groups(self) -> None:
        for name in getattr(self, "groups_joined", []):
            await self.channel_layer.group_discard(name, self.channel_name)
        self.groups_joined = []

    async def _stop_streaming(self) -> None:
        await self._leave_groups()  # messages already queued are dropped below (``denied``)

    async def _send_run(self, run: dict[str, Any]) -> None:
        if run["state"] == RunState.QUEUED.value:
            self.sent_queued[run["id"]] = (run["reason"], run["queue_position"])
        else:
            self.sent_queued.pop(run["id"], None)
        await self.send_json({"type": "run", "data": run})

    async def runs_run(self, message):
        if not self.denied:
            await self._send_run(message["data"])

    async def runs_metrics(self, message):
        if not self.denied:
            await self.send_json({"type": "metrics", "data": message["data"]})

    async def runs_cluster(self, message):
        if not self.denied:
            await self.send_json({"type": "cluster", "data": message["data"]})
            self._devices_changed(message["data"]["id"])  # runs admitted or released: holders changed

    async def runs_alerts(self, message):
        """A run's firing rules changed (jobs.alerts.evaluate.tell_runs_lists; sent to its team's group)."""
        if not self.denied and "alerts" in self.follow:
            await self.send_json({"type": "alerts", "data": {"snapshot": False, "runs": [message["data"]]}})

    async def runs_devices(self, message):
        """A heartbeat changed the group's devices (rlplatform.live): read them again, throttled."""
        self._devices_changed(message["group"])

    def _devices_changed(self, group_id: int) -> None:
        if self.denied or "devices" not in self.follow or group_id not in self.device_groups:
            return
        self.devices_dirty.add(group_id)
        if self.devices_task is None:
            self.devices_task = asyncio.create_task(self._refresh_devices())

    async def _refresh_devices(self) -> None:
        """Read the changed groups' devices at most once every TANDEM_CLUSTER_LIVE_S; changes that arrive
        meanwhile wait for the next read (each read starts after the changes it covers were told)."""
        loop = asyncio.get_running_loop()
        try:
            while self.devices_dirty and not self.denied:
                wait = self.devices_read_at + settings.TANDEM_CLUSTER_LIVE_S - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                groups, self.devices_dirty = sorted(self.devices_dirty), set()
                self.devices_read_at = loop.time()
                for group_id in groups:
                    try:
                        rows = await _device_rows(sorted(self._teams), group_id)
                    except Exception:  # a database outage: the next change reads again
                        log.warning("could not read group %s's devices for a cluster page", group_id, exc_info=True)
                        continue
                    if self.denied:
                        return
                    await self._send_devices(group_id, rows)
        finally:
            self.devices_task = None

    async def _send_devices(self, group_id: int, rows: list[dict[str, Any]]) -> None:
        """The rows that differ from what this socket last sent (all of them, the first time)."""
        changed = [row for row in rows if self.sent_devices.get(row["key"]) != row]
        if changed:
            self.sent_devices.update((row["key"], row) for row in changed)
            await self.send_json({"type": "devices", "data": {"group": group_id, "devices": changed}})

    async def runs_queue(self, message):
        """A group's queue moved (jobs.stream.tell_changes): read this user's queued runs there again and send
        those whose place or reason changed. One read at a time per group; moves during it cause one more."""
        group_id = message["group"]
        if self.denied:
            return
        if group_id in self.queue_refresh:
            self.queue_dirty.add(group_id)
            return
        self.queue_refresh[group_id] = asyncio.create_task(self._refresh_queue(group_id))

    async def _refresh_queue(self, group_id: int) -> None:
        try:
            while not self.denied:
                self.queue_dirty.discard(group_id)
                for run in await _queued_in_group(sorted(self._teams), group_id):
                    if self.denied:
                        return
                    if self.sent_queued.get(run["id"]) != (run["reason"], run["queue_position"]):
                        await self._send_run(run)
                if group_id not in self.queue_dirty:
                    return
        finally:
            self.queue_refresh.pop(group_id, None)
