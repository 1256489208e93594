"""A host agent's shutdown ends within seconds, whatever its threads or the database are doing.

The agent's and the role supervisor's ``worker_shutdown`` hooks (rlplatform.agent, jobs.supervisor) stop
their threads with short joins and mark the host offline through ``bounded`` (a stalled database, or
SQLite's 20 s lock wait, cannot hold the worker). Once the hooks have run, Celery has stopped its pool and
only the interpreter's exit is left; ``arm_exit_guard`` then ends the process if that exit hangs, naming the
threads it found. A backstop, not the way a worker ends: the hang it was added for (a worker on the
filesystem broker, SIGTERM sent to its pool processes too) was billiard's pool finalizer waiting for a lock
that a killed pool process held; such a worker runs the threads pool now (rlplatform/settings.py), and
tests/platform/test_demo_shutdown.py checks that its exit is its own.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
THREAD_JOIN_S = 1.0  # a loop thread wakes at once on its stop event; only a pass in progress takes longer
MARK_OFFLINE_S = 3.0
EXIT_GRACE_S = 3.0

_guard: threading.Timer | None = None
_guard_lock = threading.Lock()


def bounded(fn: Callable[[], T], timeout_s: float, what: str) -> T | None:
    """``fn()`` in a daemon thread, waited for at most ``timeout_s``; None (logged) when it took longer."""
    result: list[T] = []
    failure: list[BaseException] = []

    def call() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # handed to the caller's thread below
            failure.append(exc)

    thread = threading.Thread(target=call, name=f"tandem-shutdown-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if failure:
        raise failure[0]
    if thread.is_alive():
        logger.warning("shutdown: %s did not finish within %g s; not waiting for it", what, timeout_s)
        return None
    return result[0]


def _force_exit() -> None:
    left = [t for t in threading.enumerate() if t is not threading.current_thread() and t.is_alive()]
    names = ", ".join(f"{t.name}{'' if t.daemon else ' (non-daemon)'}" for t in left)
    logger.warning(
        "shutdown: the process did not exit %g s after its shutdown hooks; threads left: %s", EXIT_GRACE_S, names
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(0)  # the hooks ran: this is a clean stop that only the interpreter's exit held up


def arm_exit_guard() -> None:
    """After the shutdown hooks: end the process if it has not exited ``EXIT_GRACE_S`` later. Idempotent."""
    global _guard
    with _guard_lock:
        if _guard is not None:
            return
        _guard = threading.Timer(EXIT_GRACE_S, _force_exit)
        _guard.name = "tandem-exit-guard"
        _guard.daemon = True  # never itself the thread that keeps the process alive
        _guard.start()
