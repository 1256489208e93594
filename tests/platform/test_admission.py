"""Gang admission: order, all-or-nothing, packing, quota and budget reasons, queue positions."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from jobs import admission, handler, queue_order
from jobs.models import Allocation, Run
from jobs.states import RunState
from rlplatform.models import Device, HostStatus

pytestmark = pytest.mark.django_db


def _devices_of(run):
    return sorted(Allocation.objects.active().filter(run=run).values_list("device__host__name", "device__index"))


def _state(run):
    run.refresh_from_db()
    return run.state, queue_order.position_of(run.pk, run.experiment.group_id), run.reason


def test_priority_then_fifo(make_group, make_experiment, team_a, submit, complete):
    group = make_group("g", hosts=[("h1", 2, "sw1")], teams=[team_a])
    exp = make_experiment(team_a, group, "e", priority=5)
    first = submit(exp, 2, priority=0)
    low_early = submit(exp, 2, priority=0)
    high = submit(exp, 2)  # the quota's priority, 5
    low_late = submit(exp, 2, priority=0)
    assert first.state == RunState.ADMITTED
    assert _state(high) == (RunState.QUEUED, 1, "no free cpu devices in group g (need 2, free 0)")
    assert _state(low_early) == (RunState.QUEUED, 2, "waiting behind an earlier run for free cpu devices")
    assert _state(low_late) == (RunState.QUEUED, 3, "waiting behind an earlier run for free cpu devices")

    complete(first)  # frees 2 devices: the high-priority run goes next, then FIFO among equals
    assert _state(high) == (RunState.ADMITTED, None, "")
    assert _state(low_early)[:2] == (RunState.QUEUED, 1)
    assert _state(low_late)[:2] == (RunState.QUEUED, 2)

    handler.cancel_run(None, high)
    assert _state(low_early) == (RunState.ADMITTED, None, "")
    assert _state(low_late)[:2] == (RunState.QUEUED, 1)


def test_run_priority_may_lower_but_never_lift_above_its_quotas(make_group, make_experiment, team_a, submit):
    group = make_group("g", hosts=[("h1", 1, None)], teams=[team_a])
    low = make_experiment(team_a, group, "low", priority=0)
    high = make_experiment(team_a, group, "high", priority=10)
    blocker = submit(low, 1)
    from_low = submit(low, 1)
    from_high = submit(high, 1)
    lifted = submit(low, 1, priority=20)  # capped at its quota's 0: no jumping ahead of other quotas
    lowered = submit(high, 1, priority=-5)
    assert blocker.state == RunState.ADMITTED
    assert [_state(r)[1] for r in (from_high, from_low, lifted, lowered)] == [1, 2, 3, 4]


def test_gang_is_all_or_nothing(make_group, make_experiment, team_a, submit):
    group = make_group("g", hosts=[("h1", 4, "sw1")], teams=[team_a])
    exp = make_experiment(team_a, group, "e")
    big = submit(exp, 3)
    waiting = submit(exp, 2)
    assert big.state == RunState.ADMITTED
    assert len(_devices_of(big)) == 3
    assert _state(waiting) == (RunState.QUEUED, 1, "no free cpu devices in group g (need 2, free 1)")
    assert Allocation.objects.filter(run=waiting).count() == 0
    assert Allocation.objects.active().count() == 3


def test_packs_onto_one_host_then_one_switch(make_group, make_experiment, team_a, submit):
    group = make_group("g", hosts=[("h1", 3, "sw1"), ("h2", 3, "sw2"), ("h3", 2, "sw2")], teams=[team_a])
    exp = make_experiment(team_a, group, "e", max_devices=8)
    pair = submit(exp, 2)
    assert _devices_of(pair) == [("g-h3", 0), ("g-h3", 1)]  # tightest host that fits
    five_group = make_group("g5", hosts=[("h1", 3, "sw1"), ("h2", 3, "sw2"), ("h3", 2, "sw2")], teams=[team_a])
    exp5 = make_experiment(team_a, five_group, "e5", max_devices=8)
    five = submit(exp5, 5)
    # No host has 5; switch sw2 has exactly 5, so the gang stays on one switch.
    assert _devices_of(five) == [("g5-h2", 0), ("g5-h2", 1), ("g5-h2", 2), ("g5-h3", 0), ("g5-h3", 1)]


def test_unhealthy_devices_and_lost_hosts_are_not_used(make_group, make_experiment, team_a, submit):
    group = make_group("g", hosts=[("h1", 2, "sw1"), ("h2", 2, "sw1")], teams=[team_a])
    exp = make_experiment(team_a, group, "e")
    Device.objects.filter(host__name="g-h1", index=0).update(healthy=False)
    group.hosts.filter(name="g-h2").update(status=HostStatus.LOST)
    one = submit(exp, 1)
    assert _devices_of(one) == [("g-h1", 1)]
    two = submit(exp, 2)
    # Only one healthy device on an online host exists: the run waits, and says why, without blocking others.
    assert _state(two) == (
        RunState.QUEUED,
        1,
        "needs 2 devices; group g has 1 healthy devices on online hosts",
    )


def test_device_quota_reason_and_lowering_below_use(make_group, make_experiment, team_a, submit, owner):
    group = make_group("g", hosts=[("h1", 8, "sw1")], teams=[team_a])
    exp = make_experiment(team_a, group, "e", max_devices=4)
    a = submit(exp, 2)
    b = submit(exp, 2)
    c = submit(exp, 1)
    assert (a.state, b.state) == (RunState.ADMITTED, RunState.ADMITTED)
    assert _state(c) == (RunState.QUEUED, 1, "quota: 4/4 devices in use, run needs 1")

    handler.update_quota(owner, exp.quota, max_devices=1)
    # Nothing that holds devices is stopped; the new limit only holds back admissions.
    assert _state(a)[0] == _state(b)[0] == RunState.ADMITTED
    assert Allocation.objects.active().count() == 4
    assert _state(c) == (RunState.QUEUED, 1, "quota: 4/1 devices in use, run needs 1")

    handler.update_quota(owner, exp.quota, max_devices=5)
    assert _state(c) == (RunState.ADMITTED, None, "")


def test_concurrent_runs_and_rollout_worker_reasons(make_group, make_experiment, team_a, submit):
    group = make_group("g", hosts=[("h1", 8, "sw1")], teams=[team_a])
    runs_exp = make_experiment(team_a, group, "runs", max_concurrent_runs=2)
    workers_exp = make_experiment(team_a, group, "workers", max_rollout_workers=6)
    submit(runs_exp, 1)
    submit(runs_exp, 1)
    third = submit(runs_exp, 1)
    assert _state(third) == (RunState.QUEUED, 1, "quota: 2/2 concurrent runs")
    submit(workers_exp, 1, rollout_workers=4)
    over = submit(workers_exp, 1, rollout_workers=3)
    assert _state(over) == (RunState.QUEUED, 2, "quota: 4/6 rollout workers in use, run needs 3")


def test_budget_exhausted_keeps_runs_queued(make_group, make_experiment, team_a, submit, owner):
    group = make_group("g", hosts=[("h1", 4, "sw1")], teams=[team_a])
    exp = make_experiment(team_a, group, "e", device_hour_budget=10.0)
    type(exp.quota).objects.filter(pk=exp.quota.pk).update(device_seconds_used=10 * 3600.0)
    run = submit(exp, 1)
    assert _state(run) == (RunState.QUEUED, 1, "device-hour budget exhausted (10.0/10.0 h)")
    assert Allocation.objects.count() == 0
    handler.update_quota(owner, exp.quota, device_hour_budget=12.5)
    assert _state(run)[0] == RunState.ADMITTED


def test_quota_blocked_run_does_not_hold_back_other_experiments(make_group, make_experiment, team_a, submit):
    group = make_group("g", hosts=[("h1", 4, "sw1")], teams=[team_a])
    full = make_experiment(team_a, group, "full", max_devices=1, priority=10)
    other = make_experiment(team_a, group, "other")
    submit(full, 1)
    blocked = submit(full, 1)
    free_rider = submit(other, 2)
    assert _state(blocked)[:2] == (RunState.QUEUED, 1)
    assert free_rider.state == RunState.ADMITTED


def test_waiting_gang_holds_back_smaller_runs_unless_backfill(make_group, make_experiment, team_a, submit, settings):
    group = make_group("g", hosts=[("h1", 4, "sw1")], teams=[team_a])
    exp = make_experiment(team_a, group, "e")
    submit(exp, 3)
    big = submit(exp, 4)
    small = submit(exp, 1)
    assert _state(small) == (RunState.QUEUED, 2, "waiting behind an earlier run for free cpu devices")

    settings.TANDEM_ADMISSION_BACKFILL = True
    assert admission.admit_group(group.pk).admitted == [small.pk]
    assert _state(big) == (RunState.QUEUED, 1, "no free cpu devices in group g (need 4, free 1)")


def test_positions_are_per_group(make_group, make_experiment, team_a, submit):
    g1 = make_group("g1", hosts=[("h1", 1, None)], teams=[team_a])
    g2 = make_group("g2", hosts=[("h1", 1, None)], teams=[team_a])
    e1 = make_experiment(team_a, g1, "e1")
    e2 = make_experiment(team_a, g2, "e2")
    submit(e1, 1)
    submit(e2, 1)
    q1 = [submit(e1, 1) for _ in range(2)]
    q2 = [submit(e2, 1) for _ in range(3)]
    assert [_state(r)[1] for r in q1] == [1, 2]
    assert [_state(r)[1] for r in q2] == [1, 2, 3]
    assert handler.queue_info(q2[2]) == {
        "state": RunState.QUEUED,
        "reason": "waiting behind an earlier run for free cpu devices",
        "queue_position": 3,
    }


def test_requeued_preempted_run_waits_for_devices(make_group, make_experiment, team_a, submit):
    group = make_group("g", hosts=[("h1", 1, None)], teams=[team_a])
    exp = make_experiment(team_a, group, "e")
    victim = submit(exp, 1)
    winner = submit(exp, 1, priority=100)
    handler.finish_run(victim, RunState.PREEMPTED, "preempted by a higher-priority run")
    assert _state(winner)[0] == RunState.ADMITTED
    victim.refresh_from_db()
    assert victim.reason == "preempted by a higher-priority run"
    handler.requeue_run(victim)
    assert _state(victim) == (RunState.QUEUED, 1, "no free cpu devices in group g (need 1, free 0)")


def test_set_priority_reorders_the_queue(make_group, make_experiment, team_a, submit, owner):
    group = make_group("g", hosts=[("h1", 1, None)], teams=[team_a])
    exp = make_experiment(team_a, group, "e")
    submit(exp, 1)
    first, second = submit(exp, 1), submit(exp, 1)
    assert (_state(first)[1], _state(second)[1]) == (1, 2)
    handler.set_priority(owner, first, -1)
    assert (_state(second)[1], _state(first)[1]) == (1, 2)


def test_a_pass_over_a_thousand_queued_runs_is_a_few_queries(
    make_group, make_experiment, team_a, submit, django_assert_max_num_queries
):
    group = make_group("g", hosts=[("h1", 2, None)], teams=[team_a])
    exp = make_experiment(team_a, group, "e", max_concurrent_runs=1)
    submit(exp, 1)
    Run.objects.bulk_create(
        Run(
            experiment=exp,
            name=f"r{i}",
            spec="{}",
            resolved_spec={},
            devices_requested=1,
            rollout_workers=1,
            reason="new",
        )
        for i in range(1000)
    )
    with django_assert_max_num_queries(20):  # not one per run
        assert admission.admit_group(group.pk).admitted == []
    queued = list(Run.objects.queued().order_by("submitted_at", "pk").values_list("pk", "reason"))
    places = queue_order.positions(group.pk)
    assert [(places[pk], reason) for pk, reason in queued] == [
        (i, "quota: 1/1 concurrent runs") for i in range(1, 1001)
    ]
    with CaptureQueriesContext(connection) as second_pass:
        admission.admit_group(group.pk)
    # Nothing changed since the first pass, so nothing is written.
    assert [q["sql"] for q in second_pass.captured_queries if q["sql"].startswith(("UPDATE", "INSERT"))] == []


def test_cancelling_a_queued_run_moves_the_others_up(make_group, make_experiment, team_a, submit, owner):
    group = make_group("g", hosts=[("h1", 1, None)], teams=[team_a])
    exp = make_experiment(team_a, group, "e")
    holder = submit(exp, 1)
    first, second, third = submit(exp, 1), submit(exp, 1), submit(exp, 1)
    handler.cancel_run(owner, first)
    assert _state(first)[:2] == (RunState.CANCELLED, None)
    assert [_state(r)[1] for r in (second, third)] == [1, 2]
    assert _state(second)[2] == "no free cpu devices in group g (need 1, free 0)"
    assert _devices_of(holder) == [("g-h1", 0)]


def _remote_spec(trainer_devices: int, remote: int, local: int = 1) -> str:
    return (
        "name: remote\npipeline:\n  mode: async\nresources:\n"
        f"  trainer_devices: {trainer_devices}\n  rollout_workers: {local}\n  remote_rollout_workers: {remote}\n"
    )


def test_a_runs_trainer_ranks_go_on_one_host_then_one_switch_and_its_rollout_roles_anywhere(
    make_group, make_experiment, team_a, owner
):
    layout = [("h1", 2, "sw1"), ("h2", 2, "sw1"), ("h3", 1, "sw1")]
    groups = [make_group(name, hosts=layout, teams=[team_a]) for name in ("g", "k", "m")]
    exp, other, third = (
        make_experiment(team_a, g, f"e-{g.name}", max_devices=10, max_rollout_workers=10) for g in groups
    )
    # 3 trainer devices + 2 remote roles: no host holds the trainer's 3, so its ranks span the switch
    # (fullest hosts first: the leader's h1, then h2); the roles take what is left
    spanning, _ = handler.submit_run(owner, exp, _remote_spec(3, 2))
    assert _state(spanning) == (RunState.ADMITTED, None, "")
    assert sorted(h for h, _ in _devices_of(spanning)) == ["g-h1", "g-h1", "g-h2", "g-h2", "g-h3"]
    # 2 trainer devices + 3 remote roles: the trainer's two together on one host, the roles on the rest
    fits, _ = handler.submit_run(owner, other, _remote_spec(2, 3))
    assert _state(fits) == (RunState.ADMITTED, None, "")
    assert sorted(h for h, _ in _devices_of(fits)) == ["k-h1", "k-h1", "k-h2", "k-h2", "k-h3"]
    # rank 0 shares its host with its 2 rollout devices: 3 on one host, which no host has: it waits
    spec = _remote_spec(2, 0).replace("remote_rollout_workers: 0", "remote_rollout_workers: 0\n  rollout_devices: 2")
    waiting, _ = handler.submit_run(owner, third, spec)
    assert _state(waiting) == (RunState.QUEUED, 1, "no free cpu devices in group m (need 4, free 5)")


def test_remote_rollout_roles_count_against_the_rollout_worker_quota(make_group, make_experiment, team_a, owner):
    group = make_group("g", hosts=[("h1", 8, "sw1")], teams=[team_a])
    exp = make_experiment(team_a, group, "e", max_devices=8, max_rollout_workers=2)
    with pytest.raises(handler.InvalidInput) as err:
        handler.submit_run(owner, exp, _remote_spec(1, 2))
    assert err.value.errors == [
        {
            "field": "resources.remote_rollout_workers",
            "message": "3 exceeds the quota's 2 rollout workers (1 on the trainer's host + 2 remote)",
        }
    ]
    assert Run.objects.count() == 0
    run, _ = handler.submit_run(owner, exp, _remote_spec(1, 1))
    assert run.rollout_workers == 2 and run.devices_requested == 2
