"""jobs.preemption: a waiting higher-priority run takes the devices of a preemptible lower-priority one."""

from __future__ import annotations

import pytest
from django.utils import timezone

from jobs import commands, handler, launch, preemption
from jobs.lifecycle import apply
from jobs.models import Command, RunRole
from jobs.models import RoleState as R
from jobs.states import RunState


def _spec(devices: int, preemptible: bool) -> str:
    return f"name: p\nresources:\n  trainer_devices: {devices}\n  preemptible: {'true' if preemptible else 'false'}\n"


@pytest.fixture
def one_host(make_group, make_experiment, team_a):
    group = make_group("solo", "cpu", hosts=[("h1", 4, "sw1")], teams=[team_a])
    low = make_experiment(team_a, group, "low", priority=0)
    high = make_experiment(team_a, group, "high", priority=10)
    return group, low, high


def _running(owner, experiment, devices, preemptible, django_capture_on_commit_callbacks):
    run, _ = handler.submit_run(owner, experiment, _spec(devices, preemptible))
    with django_capture_on_commit_callbacks(execute=False):
        role = launch.launch_run(run.pk)
    RunRole.objects.filter(pk=role.pk).update(state=R.RUNNING, pid=999999, launched_at=timezone.now())
    handler.transition(run, RunState.STARTING)
    handler.transition(run, RunState.RUNNING)
    return run


def test_a_waiting_high_priority_run_preempts_and_then_gets_the_devices(
    one_host, owner, django_capture_on_commit_callbacks
):
    group, low, high = one_host
    victim = _running(owner, low, 3, True, django_capture_on_commit_callbacks)
    waiting, _ = handler.submit_run(owner, high, _spec(4, False))
    assert waiting.state == RunState.QUEUED and waiting.reason.startswith(preemption.NO_FREE_DEVICES)

    assert preemption.preempt_for_waiting(group.pk) == [victim.pk]
    assert list(Command.objects.filter(run=victim).values_list("kind", "state", "created_by")) == [
        ("preempt", "pending", None)
    ]
    assert preemption.preempt_for_waiting(group.pk) == []  # asked once, not again while it checkpoints
    command = Command.objects.get(run=victim)
    commands.complete(victim.pk, command.pk, "done", "checkpoint at step 7")
    assert preemption.preempt_for_waiting(group.pk) == []  # nor while its process exits after the ack

    role = RunRole.objects.get(run=victim)
    decision = apply.role_exited(role.pk, role.attempt, 0, '{"outcome": "preempted", "steps": 7}\n')
    assert decision == "preempted"
    victim.refresh_from_db()
    waiting.refresh_from_db()
    assert waiting.state == RunState.ADMITTED  # the devices went to the higher-priority run
    assert victim.state == RunState.QUEUED  # and the victim waits to resume from its checkpoint


def test_runs_not_marked_preemptible_or_of_equal_priority_are_left_alone(
    one_host, owner, django_capture_on_commit_callbacks
):
    group, low, high = one_host
    _running(owner, low, 4, False, django_capture_on_commit_callbacks)
    handler.submit_run(owner, high, _spec(4, False))
    assert preemption.preempt_for_waiting(group.pk) == []
    assert not Command.objects.exists()


def test_no_preemption_when_even_every_candidate_would_not_make_room(
    make_group, make_experiment, team_a, owner, django_capture_on_commit_callbacks
):
    group = make_group("pair", "cpu", hosts=[("h1", 2, "sw1"), ("h2", 2, "sw1")], teams=[team_a])
    low = make_experiment(team_a, group, "low", priority=0)
    high = make_experiment(team_a, group, "high", priority=10)
    _running(owner, low, 2, True, django_capture_on_commit_callbacks)
    # rank 0 with its 2 rollout devices: 3 on one host, which no 2-device host ever holds
    spec = "pipeline:\n  mode: async\n" + _spec(1, False) + "  rollout_devices: 2\n"
    waiting, _ = handler.submit_run(owner, high, spec)
    assert waiting.state == RunState.QUEUED and waiting.reason.startswith("no free cpu devices")
    assert preemption.preempt_for_waiting(group.pk) == []
    assert not Command.objects.exists()
