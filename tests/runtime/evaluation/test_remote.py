"""The evaluator as a process of its own (``resources.remote_evaluator``): it connects to the trainer like a
remote rollout instance, evaluates the weights of each evaluation step, and a killed one is replaced by a
new process that takes over the unanswered request; the final step is always evaluated."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from runtime.__main__ import main
from runtime.contract import EVAL_ACCURACY
from runtime.control import Control
from runtime.metrics import read_jsonl
from runtime.pipeline import run
from runtime.spec import SpecError, load_spec, validate_spec
from tests.runtime.helpers import derived, tiny_spec

ROOT = Path(__file__).resolve().parents[3]
BASE = derived(
    seed=5,
    pipeline={
        "mode": "async",
        "steps": 8,
        "eval_interval": 2,
        "rollout_listen": "127.0.0.1:0",
        "rollout_reconnect_s": 60,
    },
    resources={"rollout_workers": 1, "remote_evaluator": True, "threads_per_process": 1},
    checkpoint={"interval": 0},
)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_a_remote_evaluator_is_checked_in_the_spec(tmp_path):
    spec = tiny_spec(tmp_path, "check", BASE)
    assert spec.resources.total_devices == 2  # the trainer's and the evaluator's
    data = spec.resolved()
    data["pipeline"]["mode"] = "sync"
    with pytest.raises(SpecError) as err:
        validate_spec(data)
    assert "resources.remote_evaluator: a remote evaluator needs pipeline.mode async, not sync" in str(err.value)
    data = spec.resolved()
    data["resources"]["eval_devices"] = 1
    with pytest.raises(SpecError) as err:
        validate_spec(data)
    assert "resources.eval_devices: 1 devices for an evaluator on the trainer's host" in str(err.value)


def test_the_evaluator_command_refuses_a_run_that_evaluates_inside_its_trainer(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    data = tiny_spec(tmp_path, "inside", BASE).resolved()
    data["resources"]["remote_evaluator"] = False
    path.write_text(yaml.safe_dump(data))
    assert main(["evaluator", str(path)]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: resources.remote_evaluator: false; this run evaluates inside its trainer"
    )
    assert load_spec(path).resources.remote_evaluator is False


def _evaluator(spec_path: Path, log: Path) -> subprocess.Popen:
    with open(log, "ab") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "runtime", "evaluator", str(spec_path)],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "TANDEM_ROLLOUT_KEY": "e" * 64},
            stdout=fh,
            stderr=subprocess.STDOUT,
        )


def _wait_until_connected(proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    """Until the evaluator logs its welcome: the trainer (the caller's thread holds it) records the
    connection before it starts listening to the evaluator, so it is in the run's events too."""
    deadline = time.monotonic() + timeout
    while "connected to the trainer" not in log.read_text():
        assert proc.poll() is None, f"the evaluator exited: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"the evaluator never connected: {log.read_text()[-2000:]}"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_remote_evaluator_evaluates_for_the_trainer_and_a_killed_one_is_replaced(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_ROLLOUT_KEY", "e" * 64)
    spec = tiny_spec(tmp_path, "remote-eval", BASE)
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec.resolved()))
    procs = [_evaluator(spec_path, tmp_path / "first.log")]
    events: list[tuple[int, str]] = []

    def stop(step, metrics):
        if step == 4:  # whatever it was doing, the next one takes over
            # ... once it has connected: a busy machine may start it later than the trainer's step 4
            _wait_until_connected(procs[0], tmp_path / "first.log")
            os.kill(procs[0].pid, signal.SIGKILL)
            procs[0].wait(timeout=30)
            procs.append(_evaluator(spec_path, tmp_path / "second.log"))
            # hold the trainer until it is connected (the listener admits it meanwhile): a run that
            # ends before any evaluator is connected ends without its last evaluation
            _wait_until_connected(procs[1], tmp_path / "second.log")
        return False

    try:
        result = run(spec, control=Control(), stop=stop)
        assert procs[1].wait(timeout=60) == 0, (tmp_path / "second.log").read_text()[-2000:]
    finally:
        for p in procs:
            p.kill()
    _, events = read_jsonl(tmp_path / "remote-eval" / "metrics.jsonl")
    seen = [(e["event"], e["payload"]["pid"]) for e in events if e["event"].startswith("evaluator_")]
    assert seen == [
        ("evaluator_connected", procs[0].pid),
        ("evaluator_disconnected", procs[0].pid),
        ("evaluator_connected", procs[1].pid),
        ("evaluator_disconnected", procs[1].pid),  # told the run ended, it left
    ]
    steps = [e["step"] for e in result["eval"]]
    # evaluation may fall behind (a newer request replaces a waiting one), never ahead, and the last
    # step is always evaluated before the run ends
    assert steps == sorted(set(steps)) and set(steps) <= {0, 2, 4, 6, 8} and steps[-1] == 8
    assert all(0.0 <= e[EVAL_ACCURACY] <= 1.0 for e in result["eval"])
    # it scores the final weights as `python -m runtime eval` scores the final checkpoint
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(result["checkpoint"])]) == 0
    offline = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert offline[EVAL_ACCURACY] == result["eval"][-1][EVAL_ACCURACY]
    assert offline["eval/reward"] == result["eval"][-1]["eval/reward"]
