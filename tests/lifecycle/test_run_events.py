"""jobs.run_events.record: the platform events of a run numbered 1, 2, 3... even when writers collide on a
number, without spoiling the caller's transaction; and the lifecycle's and the alerts' events share it."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import IntegrityError, connection, connections, transaction

from jobs import run_events
from jobs.models import RunEvent


def _seqs(run) -> list[int]:
    return list(
        RunEvent.objects.filter(run=run, role=run_events.PLATFORM_ROLE).order_by("seq").values_list("seq", flat=True)
    )


def test_a_collision_on_seq_takes_the_next_number_and_the_transaction_goes_on(run, monkeypatch):
    run_events.record(run.pk, "role_queued", {"role": "trainer-0"})
    real = run_events._next_seq
    stale = iter([1])  # the number another writer has just taken, as a writer that read before it sees it

    monkeypatch.setattr(run_events, "_next_seq", lambda run_id: next(stale, None) or real(run_id))
    event = run_events.record(run.pk, "role_started", {"role": "trainer-0"})

    assert event.seq == 2
    assert _seqs(run) == [1, 2]  # the test's own transaction was not aborted by the failed insert


def test_another_integrity_error_is_not_retried(run, monkeypatch):
    calls = []
    real = run_events._next_seq
    monkeypatch.setattr(run_events, "_next_seq", lambda run_id: calls.append(run_id) or real(run_id))

    with pytest.raises(IntegrityError), transaction.atomic():
        run_events.record(run.pk, "role_started", None)  # payload is NOT NULL
    assert len(calls) == 1
    assert _seqs(run) == []


def test_the_lifecycle_and_the_alerts_number_one_sequence(run):
    from jobs.alerts import events as alert_events
    from jobs.lifecycle.events import record_event

    record_event(run.pk, "role_started", {"role": "trainer-0"})
    run_events.record(run.pk, alert_events.FIRING, {"rule": 1})
    record_event(run.pk, "role_done", {"role": "trainer-0"})
    kinds = list(RunEvent.objects.filter(run=run).order_by("seq").values_list("seq", "kind"))
    assert kinds == [(1, "role_started"), (2, alert_events.FIRING), (3, "role_done")]


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "postgresql", reason="concurrent writers need PostgreSQL (DATABASE_URL)")
def test_concurrent_writers_lose_no_event(run):
    writers, each = 3, 10
    barrier = threading.Barrier(writers)

    def write(i: int) -> None:
        barrier.wait()  # all start together: they read the same last seq and collide
        try:
            for n in range(each):
                run_events.record(run.pk, "role_started", {"writer": i, "n": n})
        finally:
            connections.close_all()

    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(write, range(writers), timeout=60))  # a writer's error is raised here
    assert _seqs(run) == list(range(1, writers * each + 1))
