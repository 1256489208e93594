"""The run state machine: states, legal transitions, and the error for illegal ones.

    QUEUED -> ADMITTED -> STARTING -> RUNNING <-> PAUSED -> COMPLETED | FAILED | CANCELLED | PREEMPTED
    QUEUED / ADMITTED / STARTING -> CANCELLED | FAILED
    ADMITTED / STARTING -> PREEMPTED (a higher-priority run took the devices before start)
    PREEMPTED -> QUEUED (requeue)

Pure Python (no Django) so the CLI and the docs can share it. Transitions are
applied by ``jobs.handler.transition`` as a conditional UPDATE.
"""

from __future__ import annotations

from enum import StrEnum


class RunState(StrEnum):
    QUEUED = "QUEUED"
    ADMITTED = "ADMITTED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    PREEMPTED = "PREEMPTED"


S = RunState

TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    S.QUEUED: frozenset({S.ADMITTED, S.CANCELLED, S.FAILED}),
    S.ADMITTED: frozenset({S.STARTING, S.CANCELLED, S.FAILED, S.PREEMPTED}),
    S.STARTING: frozenset({S.RUNNING, S.CANCELLED, S.FAILED, S.PREEMPTED}),
    S.RUNNING: frozenset({S.PAUSED, S.COMPLETED, S.FAILED, S.CANCELLED, S.PREEMPTED}),
    S.PAUSED: frozenset({S.RUNNING, S.FAILED, S.CANCELLED, S.PREEMPTED}),
    S.COMPLETED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
    S.PREEMPTED: frozenset({S.QUEUED}),
}

# States that hold devices (Allocation rows) and count against quotas.
ACTIVE_STATES = frozenset({S.ADMITTED, S.STARTING, S.RUNNING, S.PAUSED})
# States a waiting client (`wait`, CLI --wait) stops at. PREEMPTED may be requeued later.
TERMINAL_STATES = frozenset({S.COMPLETED, S.FAILED, S.CANCELLED, S.PREEMPTED})
# States whose reason must be stored and shown.
REASON_REQUIRED = frozenset({S.QUEUED, S.FAILED, S.PREEMPTED})
# States a user may cancel from.
CANCELLABLE_STATES = frozenset(s for s, targets in TRANSITIONS.items() if S.CANCELLED in targets)


class IllegalTransition(Exception):
    """A run cannot move from its current state to the requested one (API: 409)."""

    def __init__(self, run_id: int | None, current: str, target: str):
        self.run_id = run_id
        self.current = str(current)
        self.target = str(target)
        super().__init__(f"run {run_id} cannot move from {self.current} to {self.target}")


def is_legal(current: str, target: str) -> bool:
    return RunState(target) in TRANSITIONS[RunState(current)]


def check_transition(run_id: int | None, current: str, target: str, reason: str = "") -> None:
    """Raise IllegalTransition unless current -> target is legal; ValueError if a required reason is missing."""
    if not is_legal(current, target):
        raise IllegalTransition(run_id, current, target)
    if RunState(target) in REASON_REQUIRED and not reason.strip():
        raise ValueError(f"moving run {run_id} to {target} needs a reason")
