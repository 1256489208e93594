"""Async sampling workers continue their episodes where the last trained segment left them: after a worker
is killed and replaced, after a resume, and on another host (a remote worker, itself replaced by a new
process). The check is exact: every segment trained starts from the observation the one before it (of the
same worker) ended on, and every segment is trained once.

One worker per run, a lag bound no segment reaches: then the order segments are trained in is the order
that worker sampled them, so consecutive trained segments are consecutive stretches of its envs.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import yaml

from runtime.control import Control
from runtime.metrics import read_jsonl
from runtime.pipeline import run
from runtime.spec import load_spec
from runtime.workloads.gym.learners import PPOLearner
from tests.runtime.helpers import assert_each_group_once, remote_rollout


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture
def trained(monkeypatch):
    """Every segment the learner trains on, in order (the trainer runs in this process)."""
    seen: list = []
    original = PPOLearner.train_step

    def recording(self, segments, step):
        seen.extend(segments)
        return original(self, segments, step)

    monkeypatch.setattr(PPOLearner, "train_step", recording)
    return seen


def _spec(tmp_path: Path, *, local: int = 1, remote: int = 0, **pipeline):
    return load_spec(
        {
            "name": "w",
            "seed": 3,
            "workload": "gym",
            "output_dir": str(tmp_path / "w"),
            # short segments and a short-lived env: episodes span segments and end inside them
            "env": {"id": "CartPole-v1", "num_envs": 2, "segment_length": 8, "segments_per_step": 2},
            "agent": {"algorithm": "ppo"},
            "pipeline": {
                "mode": "async",
                "steps": 6,
                "eval_interval": 0,
                "max_policy_lag": 20,  # nothing goes stale: no segment is sampled again out of order
                "queue_capacity": 4,
                "rollout_listen": "127.0.0.1:0",
                "rollout_reconnect_s": 60,
                **pipeline,
            },
            "resources": {
                "rollout_workers": local,
                "remote_rollout_workers": remote,
                "rollout_restarts": 2,
                "threads_per_process": 1,
            },
            "checkpoint": {"interval": 0},
            "metrics": {"progress_bar": False},
        }
    )


def _continuous(segments: list) -> None:
    """Each segment starts where the one before it ended (the observation after its last step)."""
    assert len(segments) > 1
    for before, after in zip(segments, segments[1:], strict=False):
        assert torch.equal(after.obs[0], before.next_obs), (before.sample_id, after.sample_id)


def test_a_replaced_worker_continues_the_episodes_of_the_one_it_replaces(tmp_path, trained):
    control = Control()
    killed: list[int] = []

    def stop(step, metrics):
        # from step 2, every other step, the worker that runs now: a replacement is seen once the queue has
        # drained and the trainer waited for samples (its supervision runs on this thread: never wait here)
        pids = control.status()["rollout_pids"]
        if len(killed) < 2 and step >= 2 * (len(killed) + 1) and pids and pids[0] not in killed:
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])
        return False

    result = run(_spec(tmp_path, steps=8), control=control, stop=stop)
    assert result["outcome"] == "completed" and len(killed) == 2
    _, events = read_jsonl(tmp_path / "w" / "metrics.jsonl")
    assert [e["payload"]["restarts"] for e in events if e["event"] == "rollout_restarted"] == [1, 2]
    trace = result["trace"]
    assert trace["dropped"] == []
    assert_each_group_once(trace["consumed"], trace["leftover"])
    assert len(trained) == 16
    _continuous(trained)
    # the envs really were mid-episode: episodes ended inside segments, and went on across them
    assert any(bool(s.done.any()) for s in trained) and not all(bool(s.done[-1].all()) for s in trained)


def test_a_resumed_run_continues_the_episodes_where_its_checkpoint_left_them(tmp_path, trained):
    first = run(_spec(tmp_path, steps=3))
    before = list(trained)
    second = run(_spec(tmp_path, steps=6), resume=first["checkpoint"])
    assert second["steps"] == 6 and second["trace"]["dropped"] == []
    assert len(trained) == 12
    # the segments queued at the checkpoint are trained first, then the new worker's, which follow them
    _continuous(trained)
    assert trained[: len(before)] == before


@pytest.mark.slow
def test_a_worker_on_another_host_feeds_the_learner_and_its_replacement_continues_its_episodes(
    tmp_path, trained, monkeypatch
):
    monkeypatch.setenv("TANDEM_ROLLOUT_KEY", "g" * 64)  # as the platform gives it: both sides
    spec = _spec(tmp_path, local=0, remote=1)
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec.resolved()))
    control = Control()
    procs = [remote_rollout(spec_path, 0, tmp_path / "first.log")]

    def stop(step, metrics):
        if step == 3:
            remote = control.status()["rollout_remote"]
            assert [(r["rank"], r["pid"]) for r in remote] == [(0, procs[0].pid)]
            os.kill(procs[0].pid, signal.SIGKILL)
            procs[0].wait(timeout=30)
            procs.append(remote_rollout(spec_path, 0, tmp_path / "second.log"))
        return False

    try:
        result = run(spec, control=control, stop=stop)
        assert procs[1].wait(timeout=60) == 0  # told the run ended
    finally:
        for p in procs:
            p.kill()
    _, events = read_jsonl(tmp_path / "w" / "metrics.jsonl")
    assert [(e["event"], e["payload"].get("pid")) for e in events if e["event"].startswith("rollout_")][1:] == [
        ("rollout_connected", procs[0].pid),
        ("rollout_disconnected", None),
        ("rollout_connected", procs[1].pid),
    ]
    trace = result["trace"]
    assert {rank for _, rank, _ in trace["issued_to"]} == {0}
    assert trace["dropped"] == []
    assert_each_group_once(trace["consumed"], trace["leftover"])
    assert len(trained) == 12
    _continuous(trained)  # the new process took over the killed one's episodes from the trainer's record
