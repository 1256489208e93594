"""Run control: directives to a running pipeline, applied at step boundaries.

The platform's commands (pause, resume, stop, cancel, rollback, live parameter
changes, preemption) reach a role process on its ingest replies; the role
(``runtime.managed.entry``) turns each into a :class:`Directive` and submits it here.
The pipeline (``runtime.pipeline.run(..., control=...)``) takes the pending
directives at every step boundary, applies them in order and reports each
result through :meth:`Control.finished`, which the role overrides to
acknowledge the command to the platform.

The pipeline also publishes what it is doing (step, paused, weight version,
rollout processes) with :meth:`Control.update`; the role's heartbeat reads it
with :meth:`Control.status`. Everything here is thread-safe and torch-free.

Directive kinds and their ``args``:

    pause       --                 stop issuing generation work; the trainer waits at the boundary
    resume      --                 continue after a pause
    stop        --                 final evaluation and checkpoint at this step, then the run ends
    preempt     --                 as stop (the platform then requeues the run instead of completing it)
    cancel      --                 the run ends at once, no checkpoint
    rollback    {path, step, ...}  restore the full state of one of the run's own checkpoints
    set_params  {params: {...}}    change live parameters (``runtime.contract.LIVE_PARAMS``)
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from runtime.contract import RUNTIME_COMMANDS


@dataclass
class Directive:
    id: int
    kind: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class Result:
    directive: Directive
    ok: bool
    message: str


class Control:
    """A directive inbox plus a status board, shared by the pipeline and whoever controls it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: deque[Directive] = deque()
        self._status: dict[str, Any] = {"status": "starting"}
        self.results: list[Result] = []

    # ---- the controller's side ----------------------------------------------------------
    def submit(self, directive: Directive) -> None:
        if directive.kind not in RUNTIME_COMMANDS:
            raise ValueError(f"kind: {directive.kind!r} is not one of {', '.join(RUNTIME_COMMANDS)}")
        with self._cond:
            self._pending.append(directive)
            self._cond.notify_all()

    def status(self) -> dict[str, Any]:
        with self._cond:
            return dict(self._status)

    # ---- the pipeline's side ------------------------------------------------------------
    def take(self) -> list[Directive]:
        """The pending directives, oldest first (each handed out once)."""
        with self._cond:
            out = list(self._pending)
            self._pending.clear()
            return out

    def wait(self, timeout: float) -> bool:
        """Block until a directive is pending or ``timeout`` seconds pass; whether one is pending."""
        with self._cond:
            if not self._pending:
                self._cond.wait(timeout)
            return bool(self._pending)

    def update(self, **status: Any) -> None:
        with self._cond:
            self._status.update(status)

    def finished(self, directive: Directive, ok: bool, message: str = "") -> None:
        """The pipeline's result for ``directive``; subclasses forward it (the base records it)."""
        with self._cond:
            self.results.append(Result(directive, ok, message))
