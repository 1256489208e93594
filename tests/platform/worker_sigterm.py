"""A Celery worker started as a deployment starts it, then sent SIGTERM once or twice: the shutdown tests of the
host agent (tests/platform/test_agent_shutdown.py) and of `make demo`'s worker (test_demo_shutdown.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 60.0  # ceiling for a state to be reached on a loaded 2-core machine


def _wait_for(condition: Callable[[], object], what: str, log: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    pytest.fail(f"the worker did not {what} within {WAIT_S:g} s; its log:\n{log.read_text()[-4000:]}")


def sigterm_worker(
    command: list[str],
    env: dict[str, str],
    log: Path,
    registered: Callable[[], bool],
    *,
    to_group: bool,
    sigterms: int,
    exit_s: float,
) -> subprocess.Popen:
    """Start ``command`` in a session of its own (a group kill reaches the worker's processes only), wait until
    ``registered()`` and the worker is ready, send SIGTERM — to its whole process group with ``to_group`` — and
    with ``sigterms`` 2 a second one during the warm shutdown. Returns the exited process; fails the test when
    it is not gone within ``exit_s`` of the first signal (then kills its group)."""
    with log.open("w") as out:
        worker = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )

    def sigterm() -> None:
        if to_group:
            os.killpg(worker.pid, signal.SIGTERM)
        else:
            worker.send_signal(signal.SIGTERM)

    try:
        _wait_for(registered, "register its host", log)
        _wait_for(lambda: "ready." in log.read_text(), "get ready", log)
        sigterm()
        if sigterms == 2:  # the second arrives while the first's warm shutdown is under way
            _wait_for(lambda: "Warm shutdown" in log.read_text(), "start its warm shutdown", log)
            sigterm()
        try:
            worker.wait(timeout=exit_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the worker did not exit within {exit_s:g} s of SIGTERM; its log:\n{log.read_text()[-4000:]}")
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
    return worker
