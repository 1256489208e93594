"""The run state machine: every legal move works, every illegal one is refused and changes nothing."""

import pytest

from jobs import handler
from jobs.models import Allocation, Run
from jobs.states import ACTIVE_STATES, TRANSITIONS, IllegalTransition, RunState, check_transition, is_legal

S = RunState

LEGAL = {
    (S.QUEUED, S.ADMITTED),
    (S.QUEUED, S.CANCELLED),
    (S.QUEUED, S.FAILED),
    (S.ADMITTED, S.STARTING),
    (S.ADMITTED, S.CANCELLED),
    (S.ADMITTED, S.FAILED),
    (S.ADMITTED, S.PREEMPTED),
    (S.STARTING, S.RUNNING),
    (S.STARTING, S.CANCELLED),
    (S.STARTING, S.FAILED),
    (S.STARTING, S.PREEMPTED),
    (S.RUNNING, S.PAUSED),
    (S.RUNNING, S.COMPLETED),
    (S.RUNNING, S.FAILED),
    (S.RUNNING, S.CANCELLED),
    (S.RUNNING, S.PREEMPTED),
    (S.PAUSED, S.RUNNING),
    (S.PAUSED, S.FAILED),
    (S.PAUSED, S.CANCELLED),
    (S.PAUSED, S.PREEMPTED),
    (S.PREEMPTED, S.QUEUED),
}


def test_transition_table_is_exactly_the_documented_one():
    table = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
    assert table == LEGAL
    for a in S:
        for b in S:
            assert is_legal(a, b) == ((a, b) in LEGAL)


def test_reason_is_required_for_queued_failed_preempted():
    with pytest.raises(ValueError, match="needs a reason"):
        check_transition(1, S.RUNNING, S.FAILED, "")
    with pytest.raises(ValueError, match="needs a reason"):
        check_transition(1, S.RUNNING, S.PREEMPTED, "  ")
    with pytest.raises(ValueError, match="needs a reason"):
        check_transition(1, S.PREEMPTED, S.QUEUED, "")
    check_transition(1, S.RUNNING, S.COMPLETED, "")


# Paths from QUEUED (via admission) to each state, as handler transitions.
PATHS = {
    S.ADMITTED: [],
    S.STARTING: [S.STARTING],
    S.RUNNING: [S.STARTING, S.RUNNING],
    S.PAUSED: [S.STARTING, S.RUNNING, S.PAUSED],
    S.COMPLETED: [S.STARTING, S.RUNNING, S.COMPLETED],
    S.FAILED: [S.FAILED],
    S.CANCELLED: [S.CANCELLED],
    S.PREEMPTED: [S.PREEMPTED],
}


def _run_in(state, experiment, submit):
    run = submit(experiment, 1)
    assert run.state == S.ADMITTED
    for step in PATHS[state]:
        handler.transition(run, step, reason="test reason")
    assert run.state == state
    return run


@pytest.mark.django_db
@pytest.mark.parametrize("current,target", sorted(LEGAL - {(S.QUEUED, S.ADMITTED)}))
def test_every_legal_move_is_applied(current, target, experiment, submit, make_experiment, team_a, cpu_group):
    if current == S.QUEUED:
        blocked = make_experiment(team_a, cpu_group, "blocked", max_devices=0)
        run = Run.objects.create(
            experiment=blocked,
            name="q",
            spec="{}",
            resolved_spec={},
            devices_requested=1,
            rollout_workers=1,
            reason="waiting",
        )
    else:
        run = _run_in(current, experiment, submit)
    handler.transition(run, target, reason="because")
    run.refresh_from_db()
    # A requeued run finds free devices and is admitted again in the same step.
    expected = S.ADMITTED if target == S.QUEUED else target
    assert run.state == expected
    holds = Allocation.objects.active().filter(run=run).count()
    assert holds == (1 if expected in ACTIVE_STATES else 0)
    if target in (S.FAILED, S.PREEMPTED, S.CANCELLED):
        assert run.reason == "because"
    if target in (S.COMPLETED, S.FAILED, S.CANCELLED, S.PREEMPTED):
        assert run.finished_at is not None


@pytest.mark.django_db
@pytest.mark.parametrize(
    "current,target",
    [
        (S.ADMITTED, S.RUNNING),
        (S.ADMITTED, S.COMPLETED),
        (S.STARTING, S.PAUSED),
        (S.RUNNING, S.QUEUED),
        (S.PAUSED, S.COMPLETED),
        (S.COMPLETED, S.RUNNING),
        (S.COMPLETED, S.CANCELLED),
        (S.CANCELLED, S.QUEUED),
        (S.FAILED, S.RUNNING),
        (S.PREEMPTED, S.RUNNING),
    ],
)
def test_illegal_moves_are_refused_and_change_nothing(current, target, experiment, submit):
    run = _run_in(current, experiment, submit)
    before = Run.objects.values().get(pk=run.pk)
    allocations_before = list(Allocation.objects.filter(run=run).values())
    with pytest.raises(IllegalTransition) as info:
        handler.transition(run, target, reason="try")
    assert (info.value.current, info.value.target) == (current, target)
    assert Run.objects.values().get(pk=run.pk) == before
    assert list(Allocation.objects.filter(run=run).values()) == allocations_before


@pytest.mark.django_db
def test_stale_in_memory_state_is_rechecked_under_the_lock(experiment, submit):
    run = submit(experiment, 1)
    stale = Run.objects.get(pk=run.pk)
    handler.cancel_run(None, run)
    # The stale copy still says ADMITTED; the database says CANCELLED, so STARTING is refused.
    with pytest.raises(IllegalTransition) as info:
        handler.transition(stale, S.STARTING)
    assert info.value.current == S.CANCELLED
    assert Run.objects.get(pk=run.pk).state == S.CANCELLED


@pytest.mark.django_db
def test_querysets(experiment, submit, make_experiment, team_a, cpu_group):
    admitted = submit(experiment, 1)
    blocked_exp = make_experiment(team_a, cpu_group, "blocked", max_devices=0)
    queued = Run.objects.create(
        experiment=blocked_exp,
        name="q",
        spec="{}",
        resolved_spec={},
        devices_requested=1,
        rollout_workers=1,
        reason="w",
    )
    done = submit(experiment, 1)
    handler.cancel_run(None, done)
    assert set(Run.objects.active()) == {admitted}
    assert set(Run.objects.queued()) == {queued}
    assert set(Run.objects.terminal()) == {done}


@pytest.mark.django_db
def test_finish_run_refuses_non_terminal_states(experiment, submit):
    run = submit(experiment, 1)
    with pytest.raises(ValueError, match="terminal"):
        handler.finish_run(run, S.RUNNING)
    assert Run.objects.get(pk=run.pk).state == S.ADMITTED


@pytest.mark.django_db
def test_failed_without_reason_is_refused(experiment, submit):
    run = submit(experiment, 1)
    with pytest.raises(ValueError, match="needs a reason"):
        handler.finish_run(run, S.FAILED, "")
    assert Run.objects.get(pk=run.pk).state == S.ADMITTED
