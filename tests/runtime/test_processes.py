"""runtime.processes: children come from the fork server with the heavy modules already imported, learn
which trainer they serve even though their parent is the fork server, and TANDEM_START_METHOD is honoured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

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


def _describe_lineage(conn) -> None:
    """A child's report: whether it holds the module its trainer made in memory only, and its fork server's
    parent pid and command line."""
    server = os.getppid()
    with open(f"/proc/{server}/stat") as stat:
        server_parent = int(stat.read().rsplit(")", 1)[1].split()[1])
    with open(f"/proc/{server}/cmdline", "rb") as cmdline:
        server_cmdline = cmdline.read()
    conn.send(("tandem_memory_only" in sys.modules, server_parent, server_cmdline))
    conn.close()


FORK_HERE = """
import json, os, sys, threading, types
from runtime import processes
from runtime.spec import load_spec

spec = load_spec("examples/grpo-{mode}.yaml")
sys.modules["tandem_memory_only"] = types.ModuleType("tandem_memory_only")  # importable by no fresh interpreter
if {busy}:
    threading.Thread(target=threading.Event().wait, daemon=True).start()
started = processes.fork_server_here(spec)
report = None
if started:
    from tests.runtime.test_processes import _describe_lineage
    ctx = processes.context()
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_describe_lineage, args=(send,), daemon=True)
    proc.start()
    send.close()
    report = recv.recv()
    proc.join(timeout=60)
    report = [report[0], report[1] == os.getpid(), report[2] == open("/proc/self/cmdline", "rb").read()]
print(json.dumps({{"started": started, "report": report}}))
"""


def _fork_here(mode: str, busy: bool = False) -> dict:
    script = FORK_HERE.format(mode=mode, busy=busy)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(processes.START_METHOD != "forkserver", reason="no fork server on this platform")
def test_an_entry_point_forks_the_fork_server_from_itself_and_children_share_its_memory():
    out = _fork_here("async")
    assert out["started"] is True
    has_memory_only_module, server_is_our_child, server_is_a_copy_of_us = out["report"]
    assert has_memory_only_module  # the child began from this process's memory, not a fresh interpreter's
    assert server_is_our_child and server_is_a_copy_of_us  # the fork server is a fork of the caller


@pytest.mark.skipif(processes.START_METHOD != "forkserver", reason="no fork server on this platform")
@pytest.mark.parametrize(("mode", "busy"), [("sync", False), ("async", True)])
def test_no_fork_server_is_forked_for_a_run_without_children_nor_beside_another_thread(mode, busy):
    """A sync run starts no child; a second thread might hold a lock the copy would inherit held."""
    assert _fork_here(mode, busy) == {"started": False, "report": None}


def test_an_async_run_from_the_cli_trains_on_the_samples_of_its_forked_children_and_leaves_none(tmp_path):
    """End to end through ``python -m runtime run``: the rollout process comes from the fork of the run's own
    process; the run ends (its fork server with it: the captured output reaches its end) with every step."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "runtime", "run", "examples/grpo-async.yaml", f"output_dir={out}"]
        + ["pipeline.steps=3", "pipeline.eval_interval=0", "checkpoint.interval=0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "time/step" in r] == [1, 2, 3]
    assert all(r["staleness/max"] <= 1 for r in steps if "time/step" in r)
    deadline = time.monotonic() + 60  # the fork server (same command line) exits once its parent has
    while _processes_naming(str(out)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_naming(str(out)) == []


def _processes_naming(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass  # exited meanwhile
    return found
