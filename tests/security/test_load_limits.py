"""Load: long-polls that hold no database connection while they wait, cancels whose cost does not grow
with the queue.

Waiters (``GET /api/runs/{id}/wait/``) go through the real ASGI application, PostgreSQL's connection pool
and the Redis channel layer (jobs.longpoll). Runs that only move in their queue get no stream entry and no
write of their own (jobs.stream.tell_changes): positions are derived when read (jobs.queue_order), and the
runs lists hear "the queue moved" in one message per team and read them again. What these cost under load: bench/longpoll.py and
bench/cancel_queue.py.
"""

import asyncio
import json

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.conf import settings
from django.db import connection
from django.db.models import Max

from jobs import handler, longpoll, queue_order
from jobs.api import serializers as s
from jobs.models import Run, RunStreamEntry
from jobs.states import RunState
from tests.api.test_api_runs import asgi_get
from tests.live.helpers import communicator

QUEUED_BEHIND = 6


@pytest.fixture
def full_queue(make_group, make_experiment, team_a, submit):
    """A one-device group held by a running run, with a head run and QUEUED_BEHIND runs queued behind it."""
    group = make_group("g", hosts=[("h1", 1, None)], teams=[team_a])
    exp = make_experiment(team_a, group, "e", max_concurrent_runs=100)
    blocker = submit(exp)
    queued = [submit(exp) for _ in range(QUEUED_BEHIND + 1)]
    assert blocker.state == RunState.ADMITTED
    assert _positions(queued) == list(range(1, QUEUED_BEHIND + 2))
    return group, blocker, queued


def _last_entry() -> int:
    return RunStreamEntry.objects.aggregate(last=Max("pk"))["last"] or 0


def _entries_after(mark: int) -> list[tuple]:
    return list(RunStreamEntry.objects.filter(pk__gt=mark).order_by("pk").values_list("run_id", "type", "data"))


def _positions(runs):
    places = queue_order.positions(runs[0].experiment.group_id)
    return [places.get(r.pk) for r in runs]


@pytest.mark.django_db
def test_cancelling_the_head_of_a_queue_writes_one_stream_entry_and_positions_read_after_are_right(full_queue, owner):
    # Given a head run with QUEUED_BEHIND runs queued behind it
    _group, _blocker, queued = full_queue
    head, behind = queued[0], queued[1:]
    mark = _last_entry()
    # When its owner cancels it
    handler.cancel_run(owner, head)
    # Then exactly one entry is written: the cancelled run's own
    assert _entries_after(mark) == [
        (head.pk, "state", {"state": "CANCELLED", "reason": "cancelled by owner", "queue_position": None})
    ]
    # and the runs behind read their new places and reasons from the table (REST reply included)
    assert _positions(behind) == list(range(1, QUEUED_BEHIND + 1))
    new_head = Run.objects.get(pk=behind[0].pk)
    assert new_head.reason == "no free cpu devices in group g (need 1, free 0)"
    last = Run.objects.get(pk=behind[-1].pk)
    assert last.reason == "waiting behind an earlier run for free cpu devices"
    assert s.run_status_reply(last.pk, [last.experiment.team_id])["queue_position"] == QUEUED_BEHIND


def _cancel_the_head_and_count_queries(make_group, make_experiment, team, owner, submit, behind: int) -> tuple:
    """(writes, reads) of cancelling the head of a one-device group's queue with ``behind`` runs behind it."""
    from django.test.utils import CaptureQueriesContext

    group = make_group(f"g{behind}", hosts=[("h1", 1, None)], teams=[team])
    exp = make_experiment(team, group, f"e{behind}", max_concurrent_runs=1000)
    submit(exp)
    queued = [submit(exp) for _ in range(behind + 1)]
    with CaptureQueriesContext(connection) as queries:
        handler.cancel_run(owner, queued[0])
    statements = [q["sql"].split()[0].upper() for q in queries.captured_queries]
    writes = [s for s in statements if s in ("INSERT", "UPDATE", "DELETE")]
    return writes, len(statements) - len(writes)


@pytest.mark.django_db
def test_cancelling_the_head_costs_the_same_statements_whatever_the_queue_behind_it(
    make_group, make_experiment, team_a, owner, submit
):
    # Given queues of 3 and 40 runs behind their heads; when each head is cancelled
    short = _cancel_the_head_and_count_queries(make_group, make_experiment, team_a, owner, submit, 3)
    long = _cancel_the_head_and_count_queries(make_group, make_experiment, team_a, owner, submit, 40)
    # Then both cancels run the same statements: none writes a row per run behind
    assert long == short
    assert short[0].count("UPDATE") <= 4, short  # the run, its counter, the new head's reason, a token revoke


@pytest.mark.django_db
def test_cancelling_a_run_in_the_middle_moves_only_those_behind_it(full_queue, owner):
    _group, _blocker, queued = full_queue
    middle = queued[3]
    mark = _last_entry()
    handler.cancel_run(owner, middle)
    assert [(run_id, data["state"]) for run_id, _type, data in _entries_after(mark)] == [(middle.pk, "CANCELLED")]
    rest = [r for r in queued if r.pk != middle.pk]
    assert _positions(rest) == list(range(1, QUEUED_BEHIND + 1))


@pytest.mark.django_db
def test_a_run_admitted_by_a_release_still_gets_its_entry(full_queue, complete):
    # Ending the blocker admits the head: a real change of state, so a stream entry for it (and the
    # blocker's own), none for the runs that only moved up.
    _group, blocker, queued = full_queue
    mark = _last_entry()
    complete(blocker)  # STARTING, RUNNING: one entry each; COMPLETED: the blocker's and the admitted head's
    assert [(run_id, data["state"]) for run_id, _type, data in _entries_after(mark)] == [
        (blocker.pk, "STARTING"),
        (blocker.pk, "RUNNING"),
        (blocker.pk, "COMPLETED"),
        (queued[0].pk, "ADMITTED"),
    ]
    assert _positions(queued[1:]) == list(range(1, QUEUED_BEHIND + 1))


@pytest.mark.django_db(transaction=True)
def test_the_runs_list_reads_the_new_places_of_its_queued_runs_when_the_queue_moves(
    full_queue, owner, cookie_for, flush_layer
):
    # Given the owner's runs list open on the queue
    _group, _blocker, queued = full_queue
    head, behind = queued[0], queued[1:]
    cookie = cookie_for(owner)

    async def scenario():
        comm = communicator("/ws/runs/", cookie)
        connected, _ = await comm.connect()
        assert connected
        snapshot = {}
        while len(snapshot) < len(queued) + 2:  # the blocker, the queued runs, then the group's usage
            message = await comm.receive_json_from(timeout=5)
            snapshot[message["data"]["id"] if message["type"] == "run" else "cluster"] = message
        # When the head is cancelled
        await sync_to_async(handler.cancel_run)(owner, head)
        # Then the list hears of the cancelled run and of every run that moved, with its new place
        seen = {}
        while len(seen) < len(queued):
            message = await comm.receive_json_from(timeout=5)
            if message["type"] == "run":
                seen[message["data"]["id"]] = (message["data"]["state"], message["data"]["queue_position"])
        await comm.disconnect()
        return seen

    seen = async_to_sync(scenario)()
    assert seen == {
        head.pk: ("CANCELLED", None),
        **{run.pk: ("QUEUED", place) for place, run in enumerate(behind, start=1)},
    }


# --- long-polls ---------------------------------------------------------------------------------------------


async def _asgi_get(path: str, query: bytes, token: str) -> tuple[int, dict]:
    """(status, JSON body) of one GET through the real ASGI application (rlplatform.asgi)."""
    from rlplatform.asgi import application

    headers = [(b"host", b"testserver"), (b"authorization", f"Bearer {token}".encode())]
    status, _headers, body = await asgi_get(application, path, headers, query)
    return status, json.loads(body)


async def _until(condition, what: str, timeout_s: float = 60.0) -> None:
    """Wait for a state (checked every 10 ms), failing with ``what`` if it never comes."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _checked_out(pool) -> int:
    """Connections of this process's pool now lent out (to the test's own thread, or to requests)."""
    stats = pool.get_stats()
    return stats["pool_size"] - stats["pool_available"]


@pytest.fixture
def pool(transactional_db):
    if connection.vendor != "postgresql" or connection.pool is None:
        pytest.skip("needs PostgreSQL with DATABASE_POOL on (its default there)")
    return connection.pool


@pytest.mark.django_db(transaction=True)
def test_waiters_hold_no_database_connection_and_all_answer_when_the_run_ends(
    pool, run, owner, team_a, mint_token, flush_layer, monkeypatch
):
    # Given more waiters on a running run than the pool has connections (the re-check is pushed past the
    # test's end: only the channel-layer signal can wake them)
    monkeypatch.setattr(longpoll, "RECHECK_S", 600.0)
    token = mint_token(owner, team_a)
    waiters = settings.DATABASE_POOL_MAX + 8
    connection.close()  # the test's own connection back to the pool: what remains lent out is the requests'
    lent_before = _checked_out(pool)

    async def scenario():
        path = f"/api/runs/{run.pk}/wait/"
        tasks = [asyncio.create_task(_asgi_get(path, b"timeout=120", token)) for _ in range(waiters)]
        await _until(lambda: longpoll.parked(run.pk) == waiters, f"{waiters} waiters parked")
        # When they all wait, they hold no connection: an ordinary read gets one at once
        lent_while_waiting = _checked_out(pool)
        read = await _asgi_get(f"/api/runs/{run.pk}/", b"format=json", token)
        assert not any(task.done() for task in tasks)
        # and when the run ends, every one of them answers with its end
        await sync_to_async(handler.finish_run)(run, RunState.COMPLETED)
        replies = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        return lent_while_waiting, read, replies

    lent_while_waiting, read, replies = async_to_sync(scenario)()
    assert lent_while_waiting == lent_before
    assert (read[0], read[1]["state"]) == (200, "RUNNING")
    assert [(status, body["state"], body["terminal"]) for status, body in replies] == [
        (200, "COMPLETED", True)
    ] * waiters
    assert longpoll.parked(run.pk) == 0
    assert _checked_out(pool) == lent_before


@pytest.mark.django_db(transaction=True)
def test_a_waiter_that_missed_the_signal_finds_the_end_at_its_next_check(
    run, owner, team_a, mint_token, flush_layer, monkeypatch
):
    # Given a waiter, and a run that ends without any message on the channel layer (as when one is lost)
    monkeypatch.setattr(longpoll, "RECHECK_S", 0.2)
    token = mint_token(owner, team_a)

    async def scenario():
        waiter = asyncio.create_task(_asgi_get(f"/api/runs/{run.pk}/wait/", b"timeout=120", token))
        await _until(lambda: longpoll.parked(run.pk) == 1, "the waiter parked")
        await sync_to_async(Run.objects.filter(pk=run.pk).update)(state=RunState.FAILED, reason="lost signal")
        return await asyncio.wait_for(waiter, timeout=60)

    status, body = async_to_sync(scenario)()
    assert (status, body["state"], body["reason"], body["terminal"]) == (200, "FAILED", "lost signal", True)


@pytest.mark.django_db(transaction=True)
def test_a_waiter_whose_time_runs_out_answers_with_the_run_as_it_is(run, owner, team_a, mint_token, flush_layer):
    token = mint_token(owner, team_a)

    async def scenario():
        return await _asgi_get(f"/api/runs/{run.pk}/wait/", b"timeout=0.3", token)

    status, body = async_to_sync(scenario)()
    assert (status, body["id"], body["state"], body["terminal"]) == (200, run.pk, "RUNNING", False)
    assert longpoll.parked(run.pk) == 0


@pytest.mark.django_db(transaction=True)
def test_a_waiter_of_another_team_is_refused_before_it_waits(run, outsider, team_b, mint_token, flush_layer):
    token = mint_token(outsider, team_b)

    async def scenario():
        return await _asgi_get(f"/api/runs/{run.pk}/wait/", b"timeout=120", token)

    status, _body = async_to_sync(scenario)()
    assert status == 404
    assert longpoll.parked(run.pk) == 0
