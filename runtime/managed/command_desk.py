"""The command desk of a role: platform commands in, pipeline directives out, results acknowledged.

Commands ride on every ingest reply; :class:`CommandDesk` acts on each id once
(handled ids and results persist in :class:`CommandLog`, so a restarted
trainer re-acknowledges instead of acting again), hands them to the pipeline
as :class:`runtime.control.Directive` s through :class:`RoleControl`, and
queues each result on the :class:`Acknowledger`, which posts it to
``/api/ingest/command_result`` from its own thread, retrying with back-off.
Used by ``runtime.managed.entry``.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.contract import COMMAND_RESULT_PATH, RUNTIME_COMMANDS, end_of_last_line
from runtime.control import Control, Directive
from runtime.managed.reporter import JsonPoster, PostError

# The platform acts on what was reported when these are acknowledged (rewinds after the checkpoint's
# step; completes or requeues the run with its final checkpoint): flush the reporter first.
FLUSH_BEFORE_ACK = ("rollback", "stop", "preempt")
ENDING = ("stop", "preempt", "cancel")
# An acknowledgement the platform will never accept (404: not this run's command; 409: contradicts the
# recorded result; 400/403: malformed or another run's; 401: the token was revoked, e.g. the run was
# cancelled): give up instead of retrying until the exit deadline.
ACK_GIVE_UP = (400, 401, 403, 404, 409)


ROLLBACK_ACK_WAIT_S = 300.0  # the pipeline waits this long for a rollback's acknowledgement (see CommandDesk)


class RoleInputError(ValueError):
    """A missing or invalid environment variable, argument or role file (exit 2, before any work)."""


def role_log(message: str) -> None:
    """One line on stderr, prefixed ``role:`` (the role's log, which the platform shows)."""
    print(f"role: {message}", file=sys.stderr, flush=True)


_log = role_log


# ---------------------------------------------------------------------------------- commands


class CommandLog:
    """Handled command ids and their results, one JSON line each, fsynced: survives a trainer restart."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._results: dict[int, tuple[str, str]] = {}
        if path.exists():
            end = end_of_last_line(path)  # a line torn by a crash was never acknowledged: drop it
            with open(path, "r+b") as fh:
                fh.truncate(end)
                for number, line in enumerate(fh.read().splitlines(), 1):
                    try:
                        record = json.loads(line)
                        self._results[int(record["id"])] = (str(record["state"]), str(record.get("message", "")))
                    except (ValueError, KeyError, TypeError):
                        raise RoleInputError(f"{path}: line {number} is not a command record") from None
        self._fh = open(path, "ab")

    def get(self, command_id: int) -> tuple[str, str] | None:
        with self._lock:
            return self._results.get(command_id)

    def record(self, command_id: int, kind: str, state: str, message: str) -> None:
        line = {"id": command_id, "kind": kind, "state": state, "message": message, "time": time.time()}
        with self._lock:
            self._fh.write(json.dumps(line).encode() + b"\n")
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._results[command_id] = (state, message)

    def close(self) -> None:
        with self._lock:
            self._fh.close()


@dataclass
class Ack:
    command: int
    state: str  # done | failed
    message: str
    flush_first: bool = False


class Acknowledger:
    """Posts command results in order from its own thread, retrying with back-off until the platform takes them."""

    def __init__(
        self,
        poster: JsonPoster,
        on_reply: Callable[[dict[str, Any]], None],
        flush: Callable[[float], bool],
        backoff_s: float = 0.2,
        backoff_max_s: float = 10.0,
    ):
        self._poster = poster
        self._on_reply = on_reply
        self._flush = flush
        self._backoff_s, self._backoff_max_s = backoff_s, backoff_max_s
        self._cond = threading.Condition()
        self._queue: deque[Ack] = deque()
        self._deadline: float | None = None  # set by close(): give up on what is left after it
        self._jitter = random.Random()
        self.delivered: list[int] = []
        self._thread = threading.Thread(target=self._run, name="role-acks", daemon=True)
        self._thread.start()

    def put(self, ack: Ack) -> None:
        with self._cond:
            if any(a.command == ack.command for a in self._queue):
                return  # already owed: one acknowledgement is enough
            self._queue.append(ack)
            self._cond.notify_all()

    def close(self, timeout: float) -> list[int]:
        """Keep trying for up to ``timeout`` seconds, then stop; the ids still not acknowledged."""
        with self._cond:
            self._deadline = time.monotonic() + timeout
            self._cond.notify_all()
        self._thread.join(timeout + 15)  # one request may be in flight past the deadline
        with self._cond:
            return [a.command for a in self._queue]

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _run(self) -> None:
        failures = 0
        while True:
            with self._cond:
                while not self._queue and self._deadline is None:
                    self._cond.wait()
                if not self._queue or self._past_deadline():
                    return
                ack = self._queue[0]
            try:
                finished = self._attempt(ack)
            except Exception as exc:  # never let the thread die: results would stop reaching the platform
                _log(f"acknowledging command {ack.command}: {type(exc).__name__}: {exc}")
                finished = False
            if finished:
                failures = 0
                with self._cond:
                    self._queue.popleft()
                continue
            failures += 1
            pause = min(self._backoff_max_s, self._backoff_s * 2 ** (failures - 1))
            pause *= 0.8 + 0.4 * self._jitter.random()
            with self._cond:
                end = time.monotonic() + pause
                while (left := end - time.monotonic()) > 0 and not self._past_deadline():
                    self._cond.wait(left if self._deadline is None else min(left, self._deadline - time.monotonic()))

    def send_now(self, ack: Ack, timeout: float) -> bool:
        """Acknowledge from the calling thread, retrying for up to ``timeout`` s; then leave it to the thread."""
        deadline = time.monotonic() + timeout
        failures = 0
        while time.monotonic() < deadline:
            if self._attempt(ack):
                return True
            failures += 1
            time.sleep(min(self._backoff_max_s, self._backoff_s * 2 ** (failures - 1), deadline - time.monotonic()))
        self.put(ack)
        return False

    def _attempt(self, ack: Ack) -> bool:
        """One try; True when the acknowledgement is settled (taken, or refused for good)."""
        if ack.flush_first and not self._flush(5.0):
            return False
        body = {"command": ack.command, "state": ack.state, "message": ack.message}
        try:
            reply = self._poster.post(COMMAND_RESULT_PATH, body)
        except PostError as exc:
            if exc.status in ACK_GIVE_UP:
                _log(f"command {ack.command}: the platform refused its result ({exc}); giving up")
                return True
            return False
        self.delivered.append(ack.command)
        if isinstance(reply, dict):
            self._on_reply(reply)
        return True


class CommandDesk:
    """Commands from ingest replies -> directives (each id once); the pipeline's results -> log + acknowledgement."""

    def __init__(self, control: Control, log: CommandLog, acks: Acknowledger):
        self.control = control
        self.log = log
        self.acks = acks
        self._lock = threading.RLock()
        self._active: dict[int, Directive] = {}
        self._ended = False  # the pipeline has returned
        self._ended_why: str | None = None  # ... for good: what arrives now fails with this message
        self.stopping = False  # a stop, preempt or cancel is under way

    def receive(self, reply: dict[str, Any]) -> None:
        """Any ingest reply's ``commands``; called from the reporter, heartbeat and acknowledger threads."""
        commands = reply.get("commands")
        if not isinstance(commands, list):
            return
        with self._lock:  # one reply's commands go in together, in order
            for command in commands:
                if isinstance(command, dict):
                    self._take(command)

    def _take(self, command: dict[str, Any]) -> None:
        cid, kind, args = command.get("id"), command.get("kind"), command.get("args")
        if not isinstance(cid, int) or isinstance(cid, bool):
            return
        handled = self.log.get(cid)
        if handled is not None:  # redelivered (our acknowledgement was lost or is still owed)
            state, message = handled
            # Flushed first like the original (a rollback's may still be on its way, the pipeline waiting on it).
            self.acks.put(Ack(cid, state, message, flush_first=state == "done" and kind in FLUSH_BEFORE_ACK))
            return
        if cid in self._active or kind not in RUNTIME_COMMANDS:
            return  # in progress, or not the runtime's (e.g. fork, which the platform completes itself)
        directive = Directive(cid, str(kind), args if isinstance(args, dict) else {})
        if self._ended:
            if self._ended_why is not None:
                self.finished(directive, False, self._ended_why)
            return  # else left for the next attempt (see end())
        self._active[cid] = directive
        if directive.kind in ENDING:
            self.stopping = True
        self.control.submit(directive)

    def finished(self, directive: Directive, ok: bool, message: str) -> None:
        """The pipeline's result (through ``RoleControl.finished``): persist it, then acknowledge it."""
        state = "done" if ok else "failed"
        with self._lock:
            self._active.pop(directive.id, None)
            if directive.kind in ENDING and not ok:
                self.stopping = any(d.kind in ENDING for d in self._active.values())
            self.log.record(directive.id, directive.kind, state, message)
        ack = Ack(directive.id, state, message, flush_first=ok and directive.kind in FLUSH_BEFORE_ACK)
        if ok and directive.kind == "rollback":
            # The platform rewinds the points after the checkpoint's step when this arrives; the steps after
            # the rollback reuse those step numbers. So: every point from before the rollback delivered, then
            # the acknowledgement, then the first new step. The pipeline waits here (it called us) meanwhile.
            if not self.acks.send_now(ack, ROLLBACK_ACK_WAIT_S):
                _log(f"rollback {directive.id}: not acknowledged within {ROLLBACK_ACK_WAIT_S:g} s; continuing")
            return
        self.acks.put(ack)

    def end(self, why: str | None) -> None:
        """The pipeline has returned. With ``why``, the run is over for good: what it never applied, and whatever
        arrives from now on, fails with that message. Without (a failure, SIGTERM, a preemption: another attempt
        follows), nothing is acknowledged and nothing new accepted: the platform redelivers to the next attempt."""
        with self._lock:
            self._ended, self._ended_why = True, why
        if why is None:
            return
        for directive in self.control.take():
            self.control.finished(directive, False, why)
        with self._lock:
            left = list(self._active.values())
        for directive in left:  # taken by the pipeline but never finished
            self.control.finished(directive, False, why)


class RoleControl(Control):
    """A :class:`Control` whose results go on to ``on_finished`` (the role acknowledges them) and whose
    status changes go to ``on_status`` (the heartbeat reports each one, however brief)."""

    def __init__(self, on_finished: Callable[[Directive, bool, str], None], on_status: Callable[[str], None]):
        super().__init__()
        self._on_finished = on_finished
        self._on_status = on_status

    def finished(self, directive: Directive, ok: bool, message: str = "") -> None:
        super().finished(directive, ok, message)
        self._on_finished(directive, ok, message)

    def update(self, **status: Any) -> None:
        changed = "status" in status and status["status"] != self.status().get("status")
        super().update(**status)
        if changed:
            self._on_status(str(status["status"]))
