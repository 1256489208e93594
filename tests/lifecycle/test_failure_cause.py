"""jobs.lifecycle.decide.failure_cause as a table: which ends of an attempt are failures, and their cause."""

from __future__ import annotations

import pytest

from jobs.lifecycle.decide import Decision, Exit, RoleFacts, failure_cause

TRAINER = RoleFacts(name="trainer-0")
STOPPED = RoleFacts(name="trainer-1", stop_requested=True)
ROLLOUT = RoleFacts(name="rollout-0")


@pytest.mark.parametrize(
    ("role", "exit", "decision", "cause"),
    [
        (TRAINER, Exit(137), Decision.RESTART_TRAINERS, "exit_code"),
        (TRAINER, Exit(1), Decision.STOP_TRAINERS, "exit_code"),
        (TRAINER, Exit(1), Decision.FAIL_RESTARTS_SPENT, "exit_code"),
        (TRAINER, Exit(1), Decision.REQUEUE_ELSEWHERE, "exit_code"),
        (TRAINER, Exit(2), Decision.FAIL_BAD_INPUT, "bad_input"),
        (TRAINER, Exit(None), Decision.RESTART_TRAINERS, "vanished"),
        (TRAINER, Exit(None, host_lost=True), Decision.REQUEUE_HOST_LOST, "host_lost"),
        (ROLLOUT, Exit(3), Decision.RESTART_ROLE, "exit_code"),
        # Ends that are no failure: success, or asked for by the platform.
        (TRAINER, Exit(0), Decision.COMPLETE, None),
        (TRAINER, Exit(0, outcome="preempted"), Decision.REQUEUE_PREEMPTED, None),
        (ROLLOUT, Exit(0), Decision.RELEASED, None),
        (TRAINER, Exit(-15), Decision.ENDED, None),
        (TRAINER, Exit(-15), Decision.SUPERSEDED, None),
        (STOPPED, Exit(-15), Decision.RESTART_TRAINERS, None),
        (STOPPED, Exit(-15), Decision.WAIT_FOR_TRAINERS, None),
    ],
)
def test_failure_cause(role, exit, decision, cause):
    assert failure_cause(role, exit, decision) == cause
