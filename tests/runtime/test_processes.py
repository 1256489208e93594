"""runtime.processes: children come from the fork server with the heavy modules already imported, learn
which trainer they serve even though their parent is the fork server, and TANDEM_START_METHOD is honoured."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from runtime import processes
from runtime.rollout import wire
from tests.runtime.helpers import ROOT


def _report(conn, trainer: int | None) -> None:
    if trainer is not None:
        wire.set_trainer_pid(trainer)
    preloaded = [name for name in processes.PRELOAD if name in sys.modules]
    conn.send((preloaded, os.getppid(), wire.trainer_pid()))
    conn.close()


def _child(trainer: int | None) -> tuple[list[str], int, int]:
    ctx = processes.context()
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_report, args=(send, trainer), daemon=True)
    proc.start()
    send.close()
    report = recv.recv()
    proc.join(timeout=60)
    assert proc.exitcode == 0
    return report


@pytest.mark.skipif(processes.START_METHOD != "forkserver", reason="no fork server on this platform")
def test_a_child_starts_with_the_preloaded_modules_and_knows_its_trainer():
    processes.warm_up()
    preloaded, parent, trainer = _child(os.getpid())
    assert preloaded == processes.PRELOAD  # imported once by the fork server, not again by the child
    assert parent != os.getpid()  # the fork server is its parent ...
    assert trainer == os.getpid()  # ... yet it names this process as its trainer (shared-memory names, cleanup)


@pytest.mark.parametrize(("value", "expected"), [("spawn", "spawn"), ("", "forkserver"), ("thread", None)])
def test_the_start_method_follows_tandem_start_method(value, expected):
    code = "from runtime import processes; print(processes.START_METHOD)"
    env = {**os.environ, "TANDEM_START_METHOD": value}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    if expected is None:
        assert proc.returncode != 0 and "TANDEM_START_METHOD: 'thread' is not spawn or forkserver" in proc.stderr
    else:
        assert proc.returncode == 0 and proc.stdout.strip() == expected
