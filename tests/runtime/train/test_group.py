"""Runs with several data-parallel trainer ranks (``resources.trainer_devices`` > 1, gloo on CPU): the
leader takes each batch and scatters shards to the follower processes, which end every step with the
leader's weights — in sync and async mode, across a checkpoint and resume, after a live learning-rate
change; a follower that dies fails the run naming its rank."""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest
import torch

from runtime.checkpoint import load_checkpoint
from runtime.control import Control, Directive
from runtime.metrics import read_jsonl
from runtime.pipeline import run
from runtime.pipeline.driver import CHECKPOINT_DIR
from runtime.placement import TrainerGroupError
from runtime.train.group import TrainerGroup, shards
from tests.runtime.helpers import assert_each_group_once, derived, tiny_spec

BASE = derived(seed=7, pipeline={"steps": 2}, checkpoint={"interval": 0}, trainer={"collective_timeout_s": 60})


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def policy_of(result) -> dict[str, torch.Tensor]:
    state = load_checkpoint(result["checkpoint"], keys=["trainer"])["trainer"]
    return state["policy"]


def followers() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("trainer-rank-")]


def test_shards_interleave_and_refuse_too_few_samples():
    assert shards(list(range(7)), 3) == [[0, 3, 6], [1, 4], [2, 5]]
    with pytest.raises(TrainerGroupError, match="trainer_devices=3"):
        shards([1, 2], 3)


@pytest.mark.slow
def test_two_ranks_train_as_one_process_on_the_whole_batch(tmp_path):
    over = {"checkpoint__interval": 2}
    one = run(tiny_spec(tmp_path, "one", BASE, **over))
    two = run(tiny_spec(tmp_path, "two", BASE, resources__trainer_devices=2, **over))
    assert two["outcome"] == "completed" and followers() == []
    assert two["trace"]["consumed"] == one["trace"]["consumed"]
    a, b = policy_of(one), policy_of(two)
    for name in a:
        # gradients summed over two ranks in another order differ in the last bits
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=2e-5, msg=name)
    steps_one, _ = read_jsonl(tmp_path / "one" / "metrics.jsonl")
    steps_two, _ = read_jsonl(tmp_path / "two" / "metrics.jsonl")
    for key in ("reward/mean", "response_len/mean", "loss/policy", "grad_norm"):  # global over the ranks
        assert steps_two[0][key] == pytest.approx(steps_one[0][key], rel=1e-4, abs=1e-6), key
    # every rank's gradient all-reduce time, reported by the leader; one rank communicates nothing
    comm = [f"comm/rank{r}/{field}" for r in range(2) for field in ("grad_s", "grad_wait_s")]
    assert all(key in step and step[key] >= 0 for step in steps_two for key in comm)
    assert all(step[f"comm/rank{r}/grad_s"] > 0 for step in steps_two for r in range(2))
    assert not [key for step in steps_one for key in step if key.startswith("comm/")]


@pytest.mark.slow
def test_async_with_two_ranks_resumes_and_follows_a_live_lr_change(tmp_path):
    over = dict(
        pipeline__mode="async",
        resources__trainer_devices=2,
        checkpoint__interval=2,
        checkpoint__keep_last=5,
    )
    control = Control()
    control.submit(Directive(1, "set_params", {"params": {"trainer.lr": 5e-4}}))
    first = run(tiny_spec(tmp_path, "run", BASE, pipeline__steps=2, **over), control=control)
    # the checkpoint at step 2 verified that both ranks hold the same weights after the lr change
    assert first["outcome"] == "completed" and followers() == []
    steps, _ = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert steps[-1]["lr"] == pytest.approx(5e-4)
    ckpt = tmp_path / "run" / CHECKPOINT_DIR / "step-00000002"
    second = run(tiny_spec(tmp_path, "run", BASE, pipeline__steps=4, **over), resume=ckpt)
    assert second["outcome"] == "completed" and second["steps"] == 4
    assert_each_group_once(
        first["trace"]["consumed"] + second["trace"]["consumed"],
        second["trace"]["dropped"],
        second["trace"]["leftover"],
    )


@pytest.mark.slow
def test_ranks_that_drift_apart_are_caught_before_a_checkpoint(tmp_path, monkeypatch):
    # a learning-rate change applied on the leader only: the ranks' weights part at the next step
    monkeypatch.setattr(TrainerGroup, "set_lr", lambda self, lr: self.trainer.set_lr(lr))
    control = Control()
    control.submit(Directive(1, "set_params", {"params": {"trainer.lr": 5e-3}}))
    spec = tiny_spec(tmp_path, "drift", BASE, resources__trainer_devices=2, checkpoint__interval=2)
    with pytest.raises(TrainerGroupError, match=r"trainer ranks \[1\] hold different weights than rank 0"):
        run(spec, control=control)
    assert followers() == []
    assert not (tmp_path / "drift" / CHECKPOINT_DIR / "step-00000002").exists()  # nothing saved from bad ranks


@pytest.mark.slow
def test_a_dead_rank_fails_the_run_naming_it(tmp_path):
    killed = []

    def stop(step, metrics):
        if step == 1:
            (proc,) = followers()
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
            killed.append(proc.pid)
        return False

    spec = tiny_spec(tmp_path, "dead", BASE, resources__trainer_devices=2, pipeline__steps=3)
    with pytest.raises(TrainerGroupError, match="trainer rank 1 exited with status -9"):
        run(spec, stop=stop)
    assert killed and followers() == []


@pytest.mark.slow
def test_ranks_in_a_process_of_their_own_train_like_ranks_the_leader_started(tmp_path, monkeypatch):
    """Rank 1 served by `python -m runtime trainer-ranks` (as on another host), meeting the leader at
    MASTER_ADDR / MASTER_PORT: the same weights, bit for bit, as when the leader starts rank 1 itself."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    over = {"resources__trainer_devices": 2, "checkpoint__interval": 2}
    local = run(tiny_spec(tmp_path, "local", BASE, **over))
    spec = tiny_spec(tmp_path, "split", BASE, **over)
    spec_file = tmp_path / "split.yaml"
    spec_file.write_text(yaml.safe_dump(spec.resolved()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    for key, value in {**env, "TANDEM_LOCAL_RANKS": "0"}.items():
        monkeypatch.setenv(key, value)
    root = Path(__file__).resolve().parents[3]
    other_host = subprocess.Popen(
        [sys.executable, "-m", "runtime", "trainer-ranks", str(spec_file), "--ranks", "1-1"],
        cwd=root,
        env={**os.environ, **env},
    )
    try:
        split = run(spec)
        assert other_host.wait(timeout=60) == 0  # stopped by the leader at the end
    finally:
        other_host.kill()
    assert followers() == []  # the leader started none itself
    a, b = policy_of(local), policy_of(split)
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_rank_lists_are_checked_with_the_variable_named(monkeypatch):
    from runtime.placement import local_ranks, parse_ranks

    assert parse_ranks("2-3", 4, "--ranks") == range(2, 4) and parse_ranks("1", 4, "--ranks") == range(1, 2)
    with pytest.raises(TrainerGroupError, match=r"--ranks: '3-4' is not within the run's ranks 0-3"):
        parse_ranks("3-4", 4, "--ranks")
    with pytest.raises(TrainerGroupError, match="--ranks: expected first-last"):
        parse_ranks("one", 4, "--ranks")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert local_ranks(4, {}) == range(4)
    with pytest.raises(TrainerGroupError, match="must include rank 0"):
        local_ranks(4, {"TANDEM_LOCAL_RANKS": "1-3"})
    with pytest.raises(TrainerGroupError, match="need MASTER_ADDR and MASTER_PORT"):
        local_ranks(4, {"TANDEM_LOCAL_RANKS": "0-1"})
    assert local_ranks(4, {"TANDEM_LOCAL_RANKS": "0-1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}) == range(2)
