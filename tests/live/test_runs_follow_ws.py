"""The runs-list socket's followers: ``ws/runs/?follow=devices`` (the Cluster page's device rows, live after
heartbeats, throttled) and ``?follow=alerts`` (the runs pages' alert banner, live after transitions).

Given a signed-in user of a team, when a host agent heartbeats (rlplatform.hosts.heartbeat, what the agent
calls) or an ingest batch fires an alert rule, then the socket sends what changed, to that team only; a
socket without a session is refused. Through WebsocketCommunicator on the real ASGI application.
"""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import async_to_sync, sync_to_async

from rlplatform import hosts
from tests.alerts.helpers import add_rule, batch
from tests.live.helpers import communicator

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def fast_devices(settings):
    settings.TANDEM_CLUSTER_LIVE_S = 0.3
    return 0.3


async def _until(comm, kind: str, timeout: float = 5) -> dict:
    """The next message of type ``kind`` (others skipped)."""
    while True:
        message = await comm.receive_json_from(timeout=timeout)
        if message["type"] == kind:
            return message


async def _drain(comm, quiet: float = 0.5) -> list[dict]:
    out = []
    while not await comm.receive_nothing(timeout=quiet):
        out.append(await comm.receive_json_from(timeout=1))
    return out


def _held(run):
    allocation = run.allocations.active().select_related("device__host").get()
    return allocation.device.host.name, allocation.device.index


@pytest.mark.parametrize("path", ["/ws/runs/?follow=devices", "/ws/runs/?follow=alerts", "/ws/runs/?follow=x"])
def test_a_follow_socket_without_a_session_is_refused(run, flush_layer, path):
    async def scenario():
        comm = communicator(path)
        await comm.connect()
        closed = await comm.receive_output(timeout=5)
        await comm.disconnect()
        return closed

    assert async_to_sync(scenario)() == {"type": "websocket.close", "code": 4401}


def test_device_rows_follow_heartbeats_and_another_team_sees_a_holder_by_number_only(
    run, owner, outsider, make_group, team_a, cookie_for, flush_layer, fast_devices
):
    private = make_group("team-a-only", hosts=[("h1", 2, "sw1")], teams=[team_a])
    host, index = _held(run)
    cookies = cookie_for(owner), cookie_for(outsider)

    async def scenario():
        mine = communicator("/ws/runs/?follow=devices", cookies[0])
        theirs = communicator("/ws/runs/?follow=devices", cookies[1])
        for comm in (mine, theirs):
            assert (await comm.connect())[0]
        snapshot_mine, snapshot_theirs = await _drain(mine), await _drain(theirs)
        # When the run's host reports its devices' use, and so does a host of team A's own group
        await sync_to_async(hosts.heartbeat)(host, None, {index: {"util_pct": 87.4, "mem_used_mb": 512}})
        await sync_to_async(hosts.heartbeat)("team-a-only-h1", None, {0: {"util_pct": 5, "mem_used_mb": 1}})
        live_mine = await _drain(mine, quiet=1.0)
        live_theirs = await _drain(theirs, quiet=1.0)
        for comm in (mine, theirs):
            await comm.disconnect()
        return snapshot_mine, snapshot_theirs, live_mine, live_theirs

    snapshot_mine, snapshot_theirs, live_mine, live_theirs = async_to_sync(scenario)()

    def devices(messages):
        return [(m["data"]["group"], d) for m in messages if m["type"] == "devices" for d in m["data"]["devices"]]

    # The snapshot: every device of the groups each team may see
    assert {g for g, _ in devices(snapshot_mine)} == {run.experiment.group_id, private.pk}
    assert {g for g, _ in devices(snapshot_theirs)} == {run.experiment.group_id}
    assert len(devices(snapshot_theirs)) == 8
    # Then only what changed: the reported device, with its holder (a link for the team, a number for the other)
    key = f"{host}:{index}"
    mine = [d for _g, d in devices(live_mine) if d["key"] == key]
    theirs = [d for _g, d in devices(live_theirs)]
    assert len(mine) == 1 and [d["key"] for d in theirs] == [key]
    assert (mine[0]["util_pct"], mine[0]["mem_used_mb"], mine[0]["memory_mb"]) == (87.4, 512, 1024)
    assert mine[0]["holder"] == run.pk and mine[0]["holder_visible"] is True
    assert theirs[0]["holder"] == run.pk and theirs[0]["holder_visible"] is False
    assert mine[0]["at"] and theirs[0]["at"] == mine[0]["at"]
    assert {g for g, _ in devices(live_mine)} == {run.experiment.group_id, private.pk}
    assert private.pk not in {g for g, _ in devices(live_theirs)}  # team B never hears of team A's group


def test_a_heartbeat_storm_reaches_the_page_at_most_once_per_period_with_the_newest_values(
    run, owner, cookie_for, flush_layer, fast_devices
):
    host, index = _held(run)
    cookie = cookie_for(owner)

    async def scenario():
        comm = communicator("/ws/runs/?follow=devices", cookie)
        await comm.connect()
        await _drain(comm)
        loop = asyncio.get_running_loop()
        began = loop.time()
        for i in range(30):
            await sync_to_async(hosts.heartbeat)(host, None, {index: {"util_pct": float(i), "mem_used_mb": i}})
        elapsed = loop.time() - began
        messages = [m for m in await _drain(comm, quiet=1.0) if m["type"] == "devices"]
        await comm.disconnect()
        return elapsed, messages

    elapsed, messages = async_to_sync(scenario)()
    assert 1 <= len(messages) <= elapsed / fast_devices + 2  # 30 heartbeats, a message per period at most
    newest = [d for m in messages for d in m["data"]["devices"] if d["key"] == f"{host}:{index}"][-1]
    assert (newest["util_pct"], newest["mem_used_mb"]) == (29.0, 29)  # the last heartbeat is never lost


def test_a_plain_runs_socket_gets_no_device_rows_nor_alerts(run, owner, cookie_for, flush_layer, fast_devices):
    host, index = _held(run)
    cookie = cookie_for(owner)

    async def scenario():
        comm = communicator("/ws/runs/", cookie)
        await comm.connect()
        first = await _drain(comm)
        await sync_to_async(hosts.heartbeat)(host, None, {index: {"util_pct": 50, "mem_used_mb": 5}})
        later = await _drain(comm, quiet=1.0)
        await comm.disconnect()
        return first + later

    assert {m["type"] for m in async_to_sync(scenario)()} <= {"run", "cluster"}


def test_alerts_follow_transitions_for_the_runs_team_only(run, owner, outsider, cookie_for, flush_layer):
    from jobs.ingest import handler as ingest
    from jobs.ingest.tokens import authenticate_run_token, mint_run_token

    rule = add_rule(run, "bubble", 0.5)
    token = authenticate_run_token(mint_run_token(run, 0))
    cookies = cookie_for(owner), cookie_for(outsider)

    async def scenario():
        mine = communicator("/ws/runs/?follow=alerts", cookies[0])
        theirs = communicator("/ws/runs/?follow=alerts", cookies[1])
        for comm in (mine, theirs):
            await comm.connect()
        snapshot = await _until(mine, "alerts")
        assert (await _until(theirs, "alerts"))["data"] == {"snapshot": True, "runs": []}
        # When a batch puts the trainer's bubble above the rule's threshold, then below it again
        await sync_to_async(ingest.ingest_batch)(token, batch([1, 2], lambda s: {"bubble/trainer": 0.9}))
        fired = await _until(mine, "alerts")
        await sync_to_async(ingest.ingest_batch)(token, batch([3], lambda s: {"bubble/trainer": 0.1}))
        resolved = await _until(mine, "alerts")
        other = await _drain(theirs)
        for comm in (mine, theirs):
            await comm.disconnect()
        return snapshot, fired, resolved, other

    snapshot, fired, resolved, other = async_to_sync(scenario)()
    assert snapshot["data"] == {"snapshot": True, "runs": []}
    [entry] = fired["data"]["runs"]
    assert fired["data"]["snapshot"] is False
    assert (entry["id"], entry["name"], entry["experiment"]) == (run.pk, run.name, run.experiment_id)
    assert [(r["id"], r["kind"], r["metric"], r["value"]) for r in entry["rules"]] == [
        (rule.pk, "bubble", "bubble/trainer", 0.9)
    ]
    assert resolved["data"]["runs"] == [{**entry, "rules": []}]
    assert [m for m in other if m["type"] == "alerts"] == []  # team B hears nothing of team A's run


def test_the_alerts_snapshot_lists_the_teams_firing_runs(run, owner, outsider, cookie_for, flush_layer):
    from jobs.models import AlertRule

    add_rule(run, "bubble", 0.5)
    AlertRule.objects.filter(run=run, kind="bubble").update(firing=True, value=0.75)
    cookies = cookie_for(owner), cookie_for(outsider)

    async def scenario():
        out = []
        for cookie in cookies:
            comm = communicator("/ws/runs/?follow=alerts", cookie)
            await comm.connect()
            out.append((await _until(comm, "alerts"))["data"])
            await comm.disconnect()
        return out

    mine, theirs = async_to_sync(scenario)()
    assert mine["snapshot"] is True
    assert [(r["id"], [x["kind"] for x in r["rules"]]) for r in mine["runs"]] == [(run.pk, ["bubble"])]
    assert theirs == {"snapshot": True, "runs": []}


def test_the_pages_ask_for_what_they_show_live(run, owner, client):
    from jobs.models import AlertRule

    client.force_login(owner)
    runs_page = client.get(f"/experiments/{run.experiment_id}/").content.decode()
    assert 'data-follow="alerts"' in runs_page
    # The banner is there (hidden) for the script to fill, naming the experiment whose runs it lists
    assert f'id="alert-banner" role="alert" data-experiment-id="{run.experiment_id}" hidden' in runs_page
    assert 'class="alert-marker" title="an alert is firing" hidden' in runs_page
    add_rule(run, "bubble", 0.5)
    AlertRule.objects.filter(run=run, kind="bubble").update(firing=True, value=0.75)
    runs_page = client.get(f"/experiments/{run.experiment_id}/").content.decode()
    assert 'class="alert-marker" title="an alert is firing">' in runs_page
    assert f'data-experiment-id="{run.experiment_id}">' in runs_page  # shown
    cluster = client.get("/cluster/").content.decode()
    assert 'data-follow="devices"' in cluster and 'class="device-at"' in cluster and 'class="device-name"' in cluster
