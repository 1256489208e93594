"""A pass that admits many runs at once writes them in bulk and places every gang exactly as one by one would."""

import datetime

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs import admission, queue_order, sql
from jobs.models import Allocation, Run
from jobs.states import RunState

pytestmark = pytest.mark.django_db


def _queue(exp, sizes):
    """Queued runs needing ``sizes`` devices, in this FIFO order, created without an admission pass."""
    t0 = timezone.now()
    return Run.objects.bulk_create(
        Run(
            experiment=exp,
            name=f"r{i}",
            spec="{}",
            resolved_spec={},
            devices_requested=need,
            rollout_workers=1,
            reason=admission.WAITING_FOR_ADMISSION,
            submitted_at=t0 + datetime.timedelta(microseconds=i),
        )
        for i, need in enumerate(sizes)
    )


def _held(run_ids):
    rows = Allocation.objects.active().filter(run_id__in=run_ids).order_by("device__host__name", "device__index")
    held: dict[int, list[tuple[str, int]]] = {}
    for run_id, host, index in rows.values_list("run_id", "device__host__name", "device__index"):
        held.setdefault(run_id, []).append((host, index))
    return held


def test_one_pass_admits_a_hundred_runs_with_exact_placement(make_group, make_experiment, team_a):
    # Given 4 hosts of 32 devices (128) and 110 queued one-device runs
    group = make_group("g", hosts=[(f"h{i}", 32, f"sw{i}") for i in (1, 2, 3, 4)], teams=[team_a])
    exp = make_experiment(team_a, group, "e", max_devices=1000, max_concurrent_runs=1000, max_rollout_workers=1000)
    runs = _queue(exp, [1] * 110)
    ids = [r.pk for r in runs]

    # When one pass runs
    with CaptureQueriesContext(connection) as pass_queries:
        admitted = admission.admit_group(group.pk).admitted

    # Then all 110 are admitted in FIFO order, best fit filling h1, then h2, ... device by device
    assert admitted == ids
    expected = {run_id: [(f"g-h{i // 32 + 1}", i % 32)] for i, run_id in enumerate(ids)}
    assert _held(ids) == expected
    assert Allocation.objects.count() == 110
    rows = Run.objects.filter(pk__in=ids).values_list("state", "reason", "admitted_at")
    assert {(state, reason) for state, reason, _at in rows} == {(RunState.ADMITTED, "")}
    assert len({at for *_rest, at in rows}) == 1  # one pass, one instant
    # and the writes are one UPDATE of the runs and one INSERT of the allocations, not one per run
    writes = [q["sql"].split()[0] for q in pass_queries.captured_queries if q["sql"].startswith(("UPDATE", "INSERT"))]
    assert writes == ["UPDATE", "INSERT"]


def test_a_mixed_pass_admits_gangs_whole_and_queues_the_rest_with_reasons(make_group, make_experiment, team_a):
    # Given 3 hosts of 4 devices on two switches and gangs of 3, 3, 2, 5, 1, 2 devices
    group = make_group("g", hosts=[("h1", 4, "sw1"), ("h2", 4, "sw1"), ("h3", 4, "sw2")], teams=[team_a])
    exp = make_experiment(team_a, group, "e", max_devices=100, max_concurrent_runs=100, max_rollout_workers=100)
    a, b, c, d, e, f = (r.pk for r in _queue(exp, [3, 3, 2, 5, 1, 2]))

    admitted = admission.admit_group(group.pk).admitted

    # Then a, b, c fit (3 on h1, 3 on h2, 2 on h3); d (5) finds 4 free and holds back e and f.
    assert admitted == [a, b, c]
    assert _held([a, b, c, d, e, f]) == {
        a: [("g-h1", 0), ("g-h1", 1), ("g-h1", 2)],
        b: [("g-h2", 0), ("g-h2", 1), ("g-h2", 2)],
        c: [("g-h3", 0), ("g-h3", 1)],
    }
    assert queue_order.positions(group.pk) == {d: 1, e: 2, f: 3}
    reasons = dict(Run.objects.filter(pk__in=[d, e, f]).values_list("pk", "reason"))
    assert reasons == {
        d: "no free cpu devices in group g (need 5, free 4)",
        e: "waiting behind an earlier run for free cpu devices",
        f: "waiting behind an earlier run for free cpu devices",
    }


def test_the_batch_update_skips_a_run_no_longer_queued(make_group, make_experiment, team_a):
    # The one UPDATE is conditional on QUEUED, like the per-run updates it replaces: a run moved
    # meanwhile by a writer not holding the group lock keeps its state and is not reported admitted.
    group = make_group("g", hosts=[("h1", 4, None)], teams=[team_a])
    exp = make_experiment(team_a, group, "e")
    first, moved, last = (r.pk for r in _queue(exp, [1, 1, 1]))
    Run.objects.filter(pk=moved).update(state=RunState.CANCELLED)

    assert sql.mark_admitted([first, moved, last], timezone.now()) == [first, last]

    states = dict(Run.objects.values_list("pk", "state"))
    assert states == {first: RunState.ADMITTED, moved: RunState.CANCELLED, last: RunState.ADMITTED}
