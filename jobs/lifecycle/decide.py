"""What the end of a role's attempt means for its run: one pure function, :func:`decide`.

Its inputs are plain values gathered by jobs.lifecycle.apply (which also applies the answer); it reads no
database and changes nothing, so every rule is a row in tests/lifecycle/test_decide.py. In order:

* the run is no longer active: nothing to do (its supervisors stop what is left);
* the attempt is left from an earlier admission: superseded (the last one out launches the new admission);
* the role's host was lost: the run goes back to the queue, unless the role's restarts are spent;
* a rollout or evaluator role (it serves trainer-0): done when released (exit 0), else the run fails on bad
  input or spent restarts (``rollout_restarts``), else the role restarts alone;
* a trainer role asked to stop because another one failed: the last one out restarts the trainer roles;
* exit 0: a further trainer role is done; trainer-0's final line says whether the run completed, was
  cancelled or was preempted (requeued);
* otherwise the trainer group failed: bad input fails the run; so does a spent budget (``max_restarts``,
  shared by the trainer roles); a role failing ``host_failure_limit`` times on one host sends the run back
  to the queue without that host; else the trainer roles restart together, once the others have stopped.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from jobs.lifecycle.names import connects_to_trainer, is_trainer
from jobs.states import ACTIVE_STATES, RunState
from runtime.contract import EXIT_BAD_INPUT, OUTCOME_CANCELLED, OUTCOME_COMPLETED, OUTCOME_PREEMPTED, TRAINER_ROLE

DEFAULT_RESTARTS = 3  # resources.max_restarts and resources.rollout_restarts when the spec names none


class Decision(Enum):
    """What happens after a role's attempt ended. The value is the word jobs.lifecycle.apply reports."""

    ENDED = "ended"  # the run is no longer active
    SUPERSEDED = "superseded"  # left from an earlier admission
    RELEASED = "done"  # trainer-0 ended the run and released this role
    COMPLETE = OUTCOME_COMPLETED
    CANCEL = OUTCOME_CANCELLED
    REQUEUE_PREEMPTED = OUTCOME_PREEMPTED  # trainer-0 checkpointed and exited for a higher-priority run
    REQUEUE_HOST_LOST = "requeued"  # its host is gone: resume from the last checkpoint elsewhere
    REQUEUE_ELSEWHERE = "requeued, without the host"  # it kept failing on its host
    FAIL_BAD_INPUT = "failed"  # exit 2: a restart cannot help
    FAIL_RESTARTS_SPENT = "failed, restarts spent"
    RESTART_ROLE = "restarting"  # a rollout or evaluator role, alone, while the run goes on
    RESTART_TRAINERS = "restarting the trainer roles"  # all of them together, from the newest checkpoint
    STOP_TRAINERS = "stopping"  # ask the other trainer roles to stop; the last one's end restarts them
    WAIT_FOR_TRAINERS = "stopped"  # a stopped trainer role, while others still live

    @property
    def outcome(self) -> str:
        """The one word reported for it (logs, tests): ``failed``, ``requeued``, ``restarting``..."""
        return OUTCOMES.get(self, self.value)


OUTCOMES = {
    Decision.REQUEUE_ELSEWHERE: "requeued",
    Decision.FAIL_RESTARTS_SPENT: "failed",
    Decision.RESTART_TRAINERS: "restarting",
}


@dataclass(frozen=True)
class RoleFacts:
    """The role whose attempt ended, as it was before the end."""

    name: str
    restarts: int = 0
    stop_requested: bool = False  # asked to stop because another trainer role failed
    superseded: bool = False  # its attempt is left from an earlier admission of the run
    failures_on_host: int = 0  # its earlier failures on the host it ran on


@dataclass(frozen=True)
class RunFacts:
    """The run, and its other trainer roles (they live and restart together)."""

    state: RunState
    max_restarts: int = DEFAULT_RESTARTS
    rollout_restarts: int = DEFAULT_RESTARTS
    host_failure_limit: int = 2  # failures of a role on one host before the run leaves that host
    trainer_restarts: int = 0  # the most restarts among the other trainer roles
    live_trainers: int = 0  # the other trainer roles whose attempts have not ended


@dataclass(frozen=True)
class Exit:
    """How the attempt ended."""

    code: int | None  # None: no exit code (the process vanished, could not start, hung)
    outcome: str = OUTCOME_COMPLETED  # trainer-0's final ``{"outcome": ...}`` line, read on exit 0
    host_lost: bool = False  # its host stopped supervising it (the role watchdog)


def restart_budget(role: RoleFacts, run: RunFacts) -> int:
    return run.rollout_restarts if connects_to_trainer(role.name) else run.max_restarts


def restarts_spent(role: RoleFacts, run: RunFacts, exit: Exit) -> int:
    """The restarts counted against the budget: a failed trainer role's are its group's (they restart
    together); a lost host counts the role's own."""
    if is_trainer(role.name) and not exit.host_lost:
        return max(role.restarts, run.trainer_restarts)
    return role.restarts


def decide(role: RoleFacts, run: RunFacts, exit: Exit) -> Decision:
    """What the end of ``role``'s attempt means (see the module docstring for the rules, in order)."""
    if run.state not in ACTIVE_STATES:
        return Decision.ENDED
    if role.superseded:
        return Decision.SUPERSEDED
    spent = restarts_spent(role, run, exit) >= restart_budget(role, run)
    if exit.host_lost:
        return Decision.FAIL_RESTARTS_SPENT if spent else Decision.REQUEUE_HOST_LOST
    if connects_to_trainer(role.name):
        if exit.code == 0:
            return Decision.RELEASED
        if exit.code == EXIT_BAD_INPUT:
            return Decision.FAIL_BAD_INPUT
        return Decision.FAIL_RESTARTS_SPENT if spent else Decision.RESTART_ROLE
    if role.stop_requested:
        return Decision.WAIT_FOR_TRAINERS if run.live_trainers else Decision.RESTART_TRAINERS
    if exit.code == 0:
        if role.name != TRAINER_ROLE:
            return Decision.RELEASED
        if exit.outcome == OUTCOME_PREEMPTED:
            return Decision.REQUEUE_PREEMPTED
        if exit.outcome == OUTCOME_CANCELLED:
            return Decision.CANCEL
        return Decision.COMPLETE
    if exit.code == EXIT_BAD_INPUT:
        return Decision.FAIL_BAD_INPUT
    if spent:
        return Decision.FAIL_RESTARTS_SPENT
    if role.failures_on_host + 1 >= run.host_failure_limit:
        return Decision.REQUEUE_ELSEWHERE
    if run.live_trainers:
        return Decision.STOP_TRAINERS
    return Decision.RESTART_TRAINERS


# The decisions that follow a failed attempt (the trainer group's restart also follows a stopped one's).
AFTER_FAILURE = frozenset(
    {
        Decision.FAIL_BAD_INPUT,
        Decision.FAIL_RESTARTS_SPENT,
        Decision.REQUEUE_HOST_LOST,
        Decision.REQUEUE_ELSEWHERE,
        Decision.RESTART_ROLE,
        Decision.RESTART_TRAINERS,
        Decision.STOP_TRAINERS,
    }
)
# Why an attempt failed: the ``cause`` of a ``role_failed`` event (and of /metrics' role failures).
CAUSE_HOST_LOST = "host_lost"  # its host stopped supervising it
CAUSE_BAD_INPUT = "bad_input"  # exit 2: the runtime refused its input
CAUSE_VANISHED = "vanished"  # no exit code: it could not start, hung and was killed, or its wrapper died
CAUSE_EXIT_CODE = "exit_code"  # any other non-zero exit
FAILURE_CAUSES = (CAUSE_HOST_LOST, CAUSE_BAD_INPUT, CAUSE_VANISHED, CAUSE_EXIT_CODE)


def failure_cause(role: RoleFacts, exit: Exit, decision: Decision) -> str | None:
    """Why the attempt failed, or None when its end was no failure: a success, or an end the platform asked
    for (the run ended, the attempt was superseded, or it was stopped because another trainer role failed)."""
    if decision not in AFTER_FAILURE or role.stop_requested:
        return None
    if exit.host_lost:
        return CAUSE_HOST_LOST
    if exit.code is None:
        return CAUSE_VANISHED
    return CAUSE_BAD_INPUT if exit.code == EXIT_BAD_INPUT else CAUSE_EXIT_CODE
