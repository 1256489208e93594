"""The per-run WebSocket: backlog + live, resume without gaps or duplicates, authorisation.

Through WebsocketCommunicator on rlplatform.asgi.application (Redis channel
layer when REDIS_URL is set). Test bodies are async functions run with
async_to_sync; database work inside them goes through sync_to_async threads.
"""

from __future__ import annotations

import threading
import time

import pytest
from asgiref.sync import async_to_sync, sync_to_async

from jobs import stream
from jobs.models import RunStreamCounter, RunStreamEntry
from tests.live.helpers import communicator, receive_until_live

pytestmark = pytest.mark.django_db(transaction=True)


def _seqs(run):
    return list(RunStreamEntry.objects.filter(run=run).order_by("seq").values_list("seq", flat=True))


def test_backlog_then_live_in_order(run, owner, cookie_for, flush_layer):
    # Given a run whose stream already holds its state entries and two metric batches
    stream.append(run.pk, "metrics", {"attempt": 0, "points": [{"step": 1, "time": 1.0, "values": {"r": 0.5}}]})
    stream.append(run.pk, "metrics", {"attempt": 0, "points": [{"step": 2, "time": 2.0, "values": {"r": 0.6}}]})
    stored = _seqs(run)
    cookie = cookie_for(owner)

    async def scenario():
        comm = communicator(f"/ws/runs/{run.pk}/", cookie)
        connected, _ = await comm.connect()
        assert connected
        await comm.send_json_to({"type": "subscribe", "after": 0})
        backlog, live = await receive_until_live(comm)
        # When a new entry is appended after the backlog
        seq = await sync_to_async(stream.append)(run.pk, "event", {"kind": "eval", "payload": {"acc": 0.9}})
        message = await comm.receive_json_from(timeout=5)
        assert await comm.receive_nothing(timeout=0.2)
        await comm.disconnect()
        return backlog, live, seq, message

    backlog, live, seq, message = async_to_sync(scenario)()
    # Then the backlog is every stored entry in order, the marker names the last, and the live entry follows
    assert [m["seq"] for m in backlog] == stored == list(range(1, len(stored) + 1))
    assert [m["type"] for m in backlog[:2]] == ["state", "state"]  # QUEUED->ADMITTED..., before the metrics
    assert backlog[-1] == {
        "seq": stored[-1],
        "type": "metrics",
        "data": {"attempt": 0, "points": [{"step": 2, "time": 2.0, "values": {"r": 0.6}}]},
    }
    assert live == {"type": "live", "seq": stored[-1]}
    assert seq == stored[-1] + 1
    assert message == {"seq": seq, "type": "event", "data": {"kind": "eval", "payload": {"acc": 0.9}}}


def test_resume_after_a_sequence_number_sends_only_what_was_missed(run, owner, cookie_for, flush_layer):
    for step in range(5):
        stream.append(run.pk, "metrics", {"attempt": 0, "points": [{"step": step, "time": 0.0, "values": {}}]})
    last = _seqs(run)[-1]
    cookie = cookie_for(owner)

    async def scenario():
        comm = communicator(f"/ws/runs/{run.pk}/", cookie)
        await comm.connect()
        await comm.send_json_to({"type": "subscribe", "after": last - 2})
        backlog, live = await receive_until_live(comm)
        await comm.disconnect()
        return backlog, live

    backlog, live = async_to_sync(scenario)()
    assert [m["seq"] for m in backlog] == [last - 1, last]
    assert live == {"type": "live", "seq": last}


def test_entries_appended_while_the_backlog_is_read_arrive_once_and_in_order(run, owner, cookie_for, flush_layer):
    from django.db import connection

    if connection.vendor == "sqlite":
        pytest.skip("needs a database with concurrent writers (PostgreSQL); SQLite's test database locks the table")
    # Given a backlog longer than one read chunk
    stream.append_many(run.pk, [("event", {"kind": "k", "payload": {"i": i}}) for i in range(1200)])
    cookie = cookie_for(owner)
    extra = 60

    def writer(started: threading.Event):
        from django.db import connection

        started.wait(5)
        try:
            for i in range(extra):
                stream.append(run.pk, "event", {"kind": "late", "payload": {"i": i}})
        finally:
            connection.close()

    async def scenario():
        comm = communicator(f"/ws/runs/{run.pk}/", cookie)
        await comm.connect()
        started = threading.Event()
        thread = threading.Thread(target=writer, args=(started,))
        thread.start()
        # When entries are appended by another thread while the backlog streams out
        await comm.send_json_to({"type": "subscribe", "after": 0})
        started.set()
        received, total = [], None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            # receive_nothing waits without killing the app (a receive timeout cancels it)
            message = None if await comm.receive_nothing(timeout=0.2) else await comm.receive_json_from(timeout=5)
            if message is not None and message.get("type") != "live":
                received.append(message["seq"])
            if not thread.is_alive():  # every late entry is committed: the last seq is final
                total = await sync_to_async(lambda: _seqs(run)[-1])()
                if received and received[-1] >= total:
                    break
        thread.join()
        assert await comm.receive_nothing(timeout=0.3)
        await comm.disconnect()
        return received, total

    received, total = async_to_sync(scenario)()
    # Then every seq 1..total arrived exactly once, in order
    assert received == list(range(1, total + 1))
    assert RunStreamEntry.objects.filter(run=run, type="event", data__kind="late").count() == extra


def test_lost_live_messages_are_repaired_from_the_table(run, owner, cookie_for, flush_layer):
    cookie = cookie_for(owner)

    def commit_silently(n):
        # Entries committed but whose messages never reached the channel layer (e.g. a full channel).
        counter, _ = RunStreamCounter.objects.get_or_create(run=run)
        RunStreamEntry.objects.bulk_create(
            RunStreamEntry(run=run, seq=counter.last_seq + 1 + i, type="event", data={"kind": "silent"})
            for i in range(n)
        )
        RunStreamCounter.objects.filter(pk=run.pk).update(last_seq=counter.last_seq + n)
        return counter.last_seq

    async def scenario():
        comm = communicator(f"/ws/runs/{run.pk}/", cookie)
        await comm.connect()
        await comm.send_json_to({"type": "subscribe", "after": 0})
        _, live = await receive_until_live(comm)
        before = await sync_to_async(commit_silently)(3)
        seq = await sync_to_async(stream.append)(run.pk, "event", {"kind": "loud", "payload": {}})
        got = [await comm.receive_json_from(timeout=5) for _ in range(4)]
        assert await comm.receive_nothing(timeout=0.2)
        await comm.disconnect()
        return live, before, seq, got

    live, before, seq, got = async_to_sync(scenario)()
    assert live["seq"] == before
    assert [m["seq"] for m in got] == [before + 1, before + 2, before + 3, seq]
    assert [m["data"]["kind"] for m in got] == ["silent", "silent", "silent", "loud"]


def test_viewer_may_subscribe(run, viewer, cookie_for, flush_layer):
    cookie = cookie_for(viewer)

    async def scenario():
        comm = communicator(f"/ws/runs/{run.pk}/", cookie)
        connected, _ = await comm.connect()
        await comm.send_json_to({"type": "subscribe", "after": 0})
        backlog, live = await receive_until_live(comm)
        await comm.disconnect()
        return connected, backlog, live

    connected, backlog, live = async_to_sync(scenario)()
    assert connected
    assert [m["seq"] for m in backlog] == _seqs(run)
    assert live["seq"] == _seqs(run)[-1]


@pytest.mark.parametrize(
    "who, path, code",
    [
        (None, "/ws/runs/{run}/", 4401),
        ("outsider", "/ws/runs/{run}/", 4404),
        ("owner", "/ws/runs/999999/", 4404),
        (None, "/ws/runs/", 4401),
    ],
)
def test_refused_sockets_are_closed_with_a_code(run, outsider, owner, cookie_for, flush_layer, who, path, code):
    cookie = cookie_for({"outsider": outsider, "owner": owner}[who]) if who else None
    stream.append(run.pk, "event", {"kind": "secret", "payload": {}})

    async def scenario():
        comm = communicator(path.format(run=run.pk), cookie)
        await comm.connect()
        closed = await comm.receive_output(timeout=5)
        # A server answers the app's close with websocket.disconnect, and the consumer then ends by itself.
        # Left running, it was cancelled with the event loop, which now and then never finished (a hang).
        await comm.disconnect()
        return closed

    closed = async_to_sync(scenario)()
    assert closed == {"type": "websocket.close", "code": code}


def test_foreign_origin_is_refused(run, owner, cookie_for, flush_layer):
    cookie = cookie_for(owner)

    async def scenario():
        comm = communicator(f"/ws/runs/{run.pk}/", cookie, origin=b"http://evil.example")
        return await comm.connect()

    connected, _code = async_to_sync(scenario)()
    assert connected is False


def test_allowed_origins_are_the_hosts_allowed_now_not_at_import(run, owner, cookie_for, flush_layer, settings):
    """The process's ALLOWED_HOSTS are read at each handshake (a validator built at import kept a stale list:
    the WebSocket tests failed whenever another test module imported the ASGI app before the test setup)."""
    import rlplatform.asgi  # noqa: F401  (built now, before the change below)

    settings.ALLOWED_HOSTS = ["ui.example.org"]
    cookie = cookie_for(owner)

    async def scenario():
        results = []
        for origin in (b"http://ui.example.org", b"http://testserver"):
            comm = communicator(f"/ws/runs/{run.pk}/", cookie, origin=origin)
            results.append((await comm.connect())[0])
            await comm.disconnect()
        return results

    assert async_to_sync(scenario)() == [True, False]


def test_bad_subscribe_gets_an_error_naming_the_field(run, owner, cookie_for, flush_layer):
    cookie = cookie_for(owner)

    async def scenario():
        comm = communicator(f"/ws/runs/{run.pk}/", cookie)
        await comm.connect()
        await comm.send_json_to({"type": "subscribe", "after": "x"})
        message = await comm.receive_json_from(timeout=5)
        await comm.disconnect()
        return message

    assert async_to_sync(scenario)() == {
        "type": "error",
        "field": "after",
        "message": 'send {"type": "subscribe", "after": n}',
    }


def test_runs_list_socket_sends_own_teams_runs_then_changes(
    run, experiment_b, owner, outsider, submit, cookie_for, flush_layer
):
    from jobs import handler

    foreign = submit(experiment_b, actor=outsider)
    cookie = cookie_for(owner)

    async def scenario():
        comm = communicator("/ws/runs/", cookie)
        connected, _ = await comm.connect()
        first = [await comm.receive_json_from(timeout=5) for _ in range(2)]
        assert await comm.receive_nothing(timeout=0.2)
        # When the run is paused
        await sync_to_async(handler.transition)(run, "PAUSED")
        changes = []
        while True:
            message = await comm.receive_json_from(timeout=5)
            changes.append(message)
            if message["type"] == "cluster":
                break
        await comm.disconnect()
        return connected, first, changes

    connected, first, changes = async_to_sync(scenario)()
    assert connected
    assert first[0] == {
        "type": "run",
        "data": {
            "id": run.pk,
            "state": "RUNNING",
            "reason": "",
            "queue_position": None,
            "experiment": {"id": run.experiment_id, "name": "exp-a"},
        },
    }
    assert first[1]["type"] == "cluster"
    assert first[1]["data"]["name"] == "cpu-local"
    assert first[1]["data"]["devices_total"] == 8
    assert first[1]["data"]["devices_used"] == 2  # this run and team B's
    run_messages = [m for m in changes if m["type"] == "run"]
    assert [m["data"]["id"] for m in run_messages] == [run.pk]  # team B's run never shows up
    assert run_messages[0]["data"]["state"] == "PAUSED"
    assert foreign.pk not in [m["data"]["id"] for m in first + changes if m["type"] == "run"]


def test_idle_socket_still_receives_after_the_layers_blocking_pop_times_out(run, owner, cookie_for, flush_layer):
    # channels_redis blocks 5 s per pop; with redis-py's 5 s default read timeout an idle consumer used to die
    # ("Timeout reading"), so settings give the Redis connections a longer socket_timeout.
    import asyncio

    cookie = cookie_for(owner)

    async def scenario():
        comm = communicator(f"/ws/runs/{run.pk}/", cookie)
        await comm.connect()
        await comm.send_json_to({"type": "subscribe", "after": 0})
        await receive_until_live(comm)
        await asyncio.sleep(6.5)
        seq = await sync_to_async(stream.append)(run.pk, "event", {"kind": "later", "payload": {}})
        message = await comm.receive_json_from(timeout=5)
        await comm.disconnect()
        return seq, message

    seq, message = async_to_sync(scenario)()
    assert message == {"seq": seq, "type": "event", "data": {"kind": "later", "payload": {}}}


def test_viewers_in_one_process_share_one_group_member_and_each_gets_every_entry(
    run, owner, viewer, cookie_for, flush_layer
):
    joined, left = [], []
    group_add, group_discard = flush_layer.group_add, flush_layer.group_discard

    async def counting_add(group, channel):
        joined.append(group)
        await group_add(group, channel)

    async def counting_discard(group, channel):
        left.append(group)
        await group_discard(group, channel)

    flush_layer.group_add, flush_layer.group_discard = counting_add, counting_discard
    cookies = [cookie_for(owner), cookie_for(viewer), cookie_for(owner)]

    async def scenario():
        comms = [communicator(f"/ws/runs/{run.pk}/", cookie) for cookie in cookies]
        for comm in comms:
            await comm.connect()
            await comm.send_json_to({"type": "subscribe", "after": 0})
            await receive_until_live(comm)
        seqs = [
            await sync_to_async(stream.append)(run.pk, "event", {"kind": "k", "payload": {"i": i}}) for i in range(3)
        ]
        got = [[(await comm.receive_json_from(timeout=5))["seq"] for _ in seqs] for comm in comms]
        await comms[0].disconnect()
        later = await sync_to_async(stream.append)(run.pk, "event", {"kind": "later", "payload": {}})
        rest = [(await comm.receive_json_from(timeout=5))["seq"] for comm in comms[1:]]
        for comm in comms[1:]:
            await comm.disconnect()
        return seqs, got, later, rest

    try:
        seqs, got, later, rest = async_to_sync(scenario)()
    finally:
        flush_layer.group_add, flush_layer.group_discard = group_add, group_discard
    assert got == [seqs, seqs, seqs]
    assert rest == [later, later]
    assert joined.count(stream.run_group(run.pk)) == 1  # one relay per process and run, not one per viewer
    assert left.count(stream.run_group(run.pk)) == 1


def test_runs_list_socket_gets_each_batchs_newest_key_metrics_for_its_teams_only(
    run, owner, outsider, cookie_for, flush_layer
):
    from jobs.ingest import handler as ingest
    from jobs.ingest.tokens import authenticate_run_token, mint_run_token

    token = authenticate_run_token(mint_run_token(run, 0))
    points = [
        {"step": 1, "metrics": {"reward/mean": 0.25, "loss/policy": 1.0}},
        {"step": 2, "metrics": {"reward/mean": 0.5, "accuracy": 0.75, "loss/policy": 0.9}},
    ]

    cookies = cookie_for(owner), cookie_for(outsider)

    async def scenario():
        mine, theirs = communicator("/ws/runs/", cookies[0]), communicator("/ws/runs/", cookies[1])
        for comm in (mine, theirs):
            await comm.connect()
        while (await mine.receive_json_from(timeout=5))["type"] != "cluster":
            pass  # the snapshot: the run, then the group's usage
        await sync_to_async(ingest.ingest_batch)(token, {"points": points})
        message = await mine.receive_json_from(timeout=5)
        other = [m["type"] for m in await _drain(theirs)]
        await sync_to_async(ingest.ingest_batch)(token, {"points": points})  # a pure replay: nothing new
        quiet = await mine.receive_nothing(timeout=0.3)
        for comm in (mine, theirs):
            await comm.disconnect()
        return message, other, quiet

    message, other, quiet = async_to_sync(scenario)()
    assert message == {
        "type": "metrics",
        "data": {"id": run.pk, "step": 2, "metrics": {"reward/mean": 0.5, "accuracy": 0.75}},
    }
    assert "metrics" not in other  # another team's socket hears nothing of this run
    assert quiet


async def _drain(comm) -> list[dict]:
    out = []
    while not await comm.receive_nothing(timeout=0.3):
        out.append(await comm.receive_json_from(timeout=1))
    return out
