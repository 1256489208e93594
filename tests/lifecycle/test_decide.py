"""jobs.lifecycle.decide: what the end of a role's attempt means, one row per rule.

No database here: pytest-django refuses queries in a test without the django_db mark, so a decide() that
read the database would fail every row.
"""

from __future__ import annotations

import pytest

from jobs.lifecycle.decide import Decision, Exit, RoleFacts, RunFacts, decide
from jobs.states import RunState

RUNNING = RunFacts(state=RunState.RUNNING, max_restarts=3, rollout_restarts=2, host_failure_limit=2)
D = Decision

# (what happened, the role, its run, how it ended, the decision)
ROWS = [
    # The run is over, or the attempt is not this admission's.
    ("run completed meanwhile", RoleFacts("trainer-0"), RunFacts(RunState.COMPLETED), Exit(137), D.ENDED),
    ("run cancelled, rollout exits", RoleFacts("rollout-0"), RunFacts(RunState.CANCELLED), Exit(0), D.ENDED),
    ("run failed, host lost", RoleFacts("trainer-1"), RunFacts(RunState.FAILED), Exit(None, host_lost=True), D.ENDED),
    ("requeued run, old attempt ends", RoleFacts("trainer-0"), RunFacts(RunState.QUEUED), Exit(143), D.ENDED),
    (
        "superseded attempt of an ended run",
        RoleFacts("rollout-1", superseded=True),
        RunFacts(RunState.CANCELLED),
        Exit(143),
        D.ENDED,
    ),
    (
        "superseded attempt",
        RoleFacts("rollout-1", superseded=True),
        RunFacts(RunState.ADMITTED),
        Exit(143),
        D.SUPERSEDED,
    ),
    (
        "superseded trainer exits 0",
        RoleFacts("trainer-0", superseded=True),
        RunFacts(RunState.ADMITTED),
        Exit(0),
        D.SUPERSEDED,
    ),
    # Its host was lost.
    ("host lost", RoleFacts("trainer-0", restarts=2), RUNNING, Exit(None, host_lost=True), D.REQUEUE_HOST_LOST),
    (
        "host lost, restarts spent",
        RoleFacts("trainer-0", restarts=3),
        RUNNING,
        Exit(None, host_lost=True),
        D.FAIL_RESTARTS_SPENT,
    ),
    (
        "host lost counts the role's own restarts, not its group's",
        RoleFacts("trainer-1", restarts=0),
        RunFacts(RunState.RUNNING, max_restarts=3, trainer_restarts=3),
        Exit(None, host_lost=True),
        D.REQUEUE_HOST_LOST,
    ),
    (
        "rollout's host lost, its budget spent",
        RoleFacts("rollout-0", restarts=2),
        RUNNING,
        Exit(None, host_lost=True),
        D.FAIL_RESTARTS_SPENT,
    ),
    (
        "host lost while starting",
        RoleFacts("rollout-0"),
        RunFacts(RunState.ADMITTED),
        Exit(None, host_lost=True),
        D.REQUEUE_HOST_LOST,
    ),
    # A rollout or evaluator role: it serves trainer-0 while the run goes on.
    ("rollout released", RoleFacts("rollout-0"), RUNNING, Exit(0), D.RELEASED),
    ("evaluator released", RoleFacts("evaluator"), RUNNING, Exit(0), D.RELEASED),
    ("rollout bad input", RoleFacts("rollout-1"), RUNNING, Exit(2), D.FAIL_BAD_INPUT),
    ("rollout killed", RoleFacts("rollout-0", restarts=1), RUNNING, Exit(137), D.RESTART_ROLE),
    ("rollout vanished", RoleFacts("rollout-0"), RUNNING, Exit(None), D.RESTART_ROLE),
    ("evaluator crashed", RoleFacts("evaluator"), RunFacts(RunState.PAUSED), Exit(1), D.RESTART_ROLE),
    ("rollout restarts spent", RoleFacts("rollout-0", restarts=2), RUNNING, Exit(1), D.FAIL_RESTARTS_SPENT),
    (
        "rollout's budget is rollout_restarts, not max_restarts",
        RoleFacts("evaluator", restarts=1),
        RunFacts(RunState.RUNNING, max_restarts=5, rollout_restarts=1),
        Exit(1),
        D.FAIL_RESTARTS_SPENT,
    ),
    (
        "rollout ignores its host's failures and the trainer group",
        RoleFacts("rollout-0", failures_on_host=5),
        RunFacts(RunState.RUNNING, live_trainers=1, trainer_restarts=9),
        Exit(1),
        D.RESTART_ROLE,
    ),
    # A trainer role asked to stop because another one failed.
    (
        "stopped trainer, others still live",
        RoleFacts("trainer-1", stop_requested=True),
        RunFacts(RunState.RUNNING, live_trainers=1),
        Exit(143),
        D.WAIT_FOR_TRAINERS,
    ),
    (
        "last stopped trainer",
        RoleFacts("trainer-0", stop_requested=True),
        RunFacts(RunState.RUNNING, live_trainers=0),
        Exit(143),
        D.RESTART_TRAINERS,
    ),
    (
        "last stopped trainer, even when it exited 0",
        RoleFacts("trainer-1", stop_requested=True),
        RunFacts(RunState.RUNNING),
        Exit(0),
        D.RESTART_TRAINERS,
    ),
    # Exit 0 of a trainer role.
    ("further trainer released", RoleFacts("trainer-1"), RUNNING, Exit(0), D.RELEASED),
    ("trainer-0 completed", RoleFacts("trainer-0"), RUNNING, Exit(0), D.COMPLETE),
    ("trainer-0 stopped by a command", RoleFacts("trainer-0"), RUNNING, Exit(0, outcome="stopped"), D.COMPLETE),
    (
        "trainer-0 completed before its first heartbeat",
        RoleFacts("trainer-0"),
        RunFacts(RunState.ADMITTED),
        Exit(0),
        D.COMPLETE,
    ),
    ("trainer-0 preempted", RoleFacts("trainer-0"), RUNNING, Exit(0, outcome="preempted"), D.REQUEUE_PREEMPTED),
    ("trainer-0 cancelled", RoleFacts("trainer-0"), RunFacts(RunState.PAUSED), Exit(0, outcome="cancelled"), D.CANCEL),
    # A trainer role failed.
    ("trainer-0 bad input", RoleFacts("trainer-0"), RUNNING, Exit(2), D.FAIL_BAD_INPUT),
    ("bad input even with restarts spent", RoleFacts("trainer-1", restarts=3), RUNNING, Exit(2), D.FAIL_BAD_INPUT),
    ("trainer-0 restarts spent", RoleFacts("trainer-0", restarts=3), RUNNING, Exit(1), D.FAIL_RESTARTS_SPENT),
    (
        "restarts spent by the group",
        RoleFacts("trainer-1", restarts=0),
        RunFacts(RunState.RUNNING, max_restarts=2, trainer_restarts=2, live_trainers=1),
        Exit(1),
        D.FAIL_RESTARTS_SPENT,
    ),
    (
        "spent restarts before the host's failures",
        RoleFacts("trainer-0", restarts=3, failures_on_host=1),
        RUNNING,
        Exit(1),
        D.FAIL_RESTARTS_SPENT,
    ),
    ("kept failing on its host", RoleFacts("trainer-0", failures_on_host=1), RUNNING, Exit(1), D.REQUEUE_ELSEWHERE),
    (
        "kept failing on its host while others live",
        RoleFacts("trainer-1", failures_on_host=1),
        RunFacts(RunState.RUNNING, live_trainers=1),
        Exit(None),
        D.REQUEUE_ELSEWHERE,
    ),
    ("trainer-0 crashed alone", RoleFacts("trainer-0", restarts=2), RUNNING, Exit(1), D.RESTART_TRAINERS),
    (
        "trainer-0 vanished, starting",
        RoleFacts("trainer-0"),
        RunFacts(RunState.STARTING),
        Exit(None),
        D.RESTART_TRAINERS,
    ),
    (
        "trainer-1 failed while trainer-0 lives",
        RoleFacts("trainer-1"),
        RunFacts(RunState.RUNNING, live_trainers=1),
        Exit(1),
        D.STOP_TRAINERS,
    ),
    (
        "trainer-0 hung while trainer-1 lives",
        RoleFacts("trainer-0", failures_on_host=0),
        RunFacts(RunState.RUNNING, live_trainers=2, host_failure_limit=3),
        Exit(None),
        D.STOP_TRAINERS,
    ),
]


@pytest.mark.parametrize(("role", "run", "end", "expected"), [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_decide(role, run, end, expected):
    assert decide(role, run, end) is expected


def test_every_decision_has_a_row():
    assert {row[-1] for row in ROWS} == set(Decision)


def test_each_decision_reports_its_outcome_word():
    # The words jobs.lifecycle.apply.role_exited returns (logs and the launch tests read them).
    assert {decision: decision.outcome for decision in Decision} == {
        D.ENDED: "ended",
        D.SUPERSEDED: "superseded",
        D.RELEASED: "done",
        D.COMPLETE: "completed",
        D.CANCEL: "cancelled",
        D.REQUEUE_PREEMPTED: "preempted",
        D.REQUEUE_HOST_LOST: "requeued",
        D.REQUEUE_ELSEWHERE: "requeued",
        D.FAIL_BAD_INPUT: "failed",
        D.FAIL_RESTARTS_SPENT: "failed",
        D.RESTART_ROLE: "restarting",
        D.RESTART_TRAINERS: "restarting",
        D.STOP_TRAINERS: "stopping",
        D.WAIT_FOR_TRAINERS: "stopped",
    }
