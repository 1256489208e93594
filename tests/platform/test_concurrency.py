"""Concurrent submits, finishes and cancels never over-allocate a device or exceed a quota.

Real threads, each with its own PostgreSQL connection, hammer one small group
and quota. Afterwards the allocation history is replayed: at no instant did a
device have two holders, or the quota more devices / runs than allowed.
"""

import random
import threading
import time
from collections import defaultdict

import pytest
from django.db import connection, connections

from jobs import handler
from jobs.models import Allocation, Run
from jobs.states import RunState

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="row locks need PostgreSQL (set DATABASE_URL)"),
]

MAX_DEVICES = 4
MAX_RUNS = 3


def _in_threads(n, work):
    errors = []
    barrier = threading.Barrier(n)

    def wrapper(i):
        try:
            barrier.wait()
            work(i)
        except Exception as exc:  # noqa: BLE001 - reported to the main thread
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=wrapper, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    return errors


def _max_overlap(intervals):
    """Largest number of [start, end) intervals open at once (ends before starts at equal times)."""
    events = []
    for start, end in intervals:
        events.append((start, 1))
        if end is not None:
            events.append((end, -1))
    events.sort(key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def test_many_threads_submit_and_finish_against_a_small_quota(make_group, make_experiment, team_a, owner, spec):
    group = make_group("g", hosts=[("h1", 3, "sw1"), ("h2", 3, "sw1")], teams=[team_a])
    exp = make_experiment(team_a, group, "e", max_devices=MAX_DEVICES, max_concurrent_runs=MAX_RUNS)

    def work(i):
        rng = random.Random(i)
        mine = []
        for step in range(6):
            run, _ = handler.submit_run(owner, exp, spec(rng.choice([1, 2])), submission_id=f"t{i}-{step}")
            mine.append(run)
            for other in list(mine):
                other.refresh_from_db()
                action = rng.random()
                try:
                    if other.state == RunState.ADMITTED and action < 0.6:
                        for state in (RunState.STARTING, RunState.RUNNING, RunState.COMPLETED):
                            handler.transition(other, state)
                        mine.remove(other)
                    elif other.state in (RunState.QUEUED, RunState.ADMITTED) and action > 0.85:
                        handler.cancel_run(owner, other)
                        mine.remove(other)
                except handler.IllegalTransition:
                    pass  # another thread's release admitted or moved it first: fine
        # Drain: finish what gets admitted (other threads' releases admit our queued runs).
        for _ in range(3000):
            if not mine:
                return
            for other in list(mine):
                other.refresh_from_db()
                if other.state == RunState.ADMITTED:
                    for state in (RunState.STARTING, RunState.RUNNING, RunState.COMPLETED):
                        handler.transition(other, state)
                    mine.remove(other)
            time.sleep(0.01)
        raise AssertionError(f"runs never admitted: {[r.pk for r in mine]}")

    errors = _in_threads(8, work)
    assert errors == []

    assert Run.objects.filter(experiment=exp).count() == 48
    allocations = list(Allocation.objects.values_list("run_id", "device_id", "created_at", "released_at"))
    by_device = defaultdict(list)
    by_run = defaultdict(list)
    for run_id, device_id, created, released in allocations:
        by_device[device_id].append((created, released))
        by_run[run_id].append((created, released))
    assert all(_max_overlap(intervals) <= 1 for intervals in by_device.values())
    assert _max_overlap([iv for ivs in by_run.values() for iv in ivs]) <= MAX_DEVICES
    run_spans = [(min(c for c, _ in ivs), ivs[0][1]) for ivs in by_run.values()]
    assert _max_overlap(run_spans) <= MAX_RUNS
    # Every admitted run got exactly the devices it asked for (gang), never a part.
    requested = dict(Run.objects.values_list("pk", "devices_requested"))
    assert all(len(ivs) == requested[run_id] for run_id, ivs in by_run.items())
    # The end state is consistent: active runs hold their devices, nothing else does.
    active = set(Run.objects.active().values_list("pk", flat=True))
    assert set(Allocation.objects.active().values_list("run_id", flat=True)) == active
    # Every run ended, and every one not cancelled while queued held its devices at some point.
    assert not Run.objects.exclude(state__in=[RunState.COMPLETED, RunState.CANCELLED]).exists()
    never_admitted = set(
        Run.objects.filter(state=RunState.CANCELLED, admitted_at__isnull=True).values_list("pk", flat=True)
    )
    assert set(by_run) == set(requested) - never_admitted
    assert Allocation.objects.active().count() == 0


def test_concurrent_submits_with_one_submission_id_make_one_run(experiment, owner, spec):
    results = []

    def work(i):
        run, created = handler.submit_run(owner, experiment, spec(1), submission_id="retry-me")
        results.append((run.pk, created))

    assert _in_threads(6, work) == []
    assert Run.objects.count() == 1
    assert sorted(created for _, created in results) == [False] * 5 + [True]
    assert {pk for pk, _ in results} == {Run.objects.get().pk}
