"""The gym workload in async mode: sampling workers in their own processes feed the learner under the lag
bound; a killed worker is replaced and no segment is lost or trained on twice."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from runtime.contract import ENV_STEPS, EVAL_RETURN_MEAN, STALENESS_MAX
from runtime.control import Control
from runtime.metrics import read_jsonl
from runtime.pipeline import run
from runtime.spec import load_spec


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _spec(tmp_path, algorithm="ppo", **pipeline):
    agent = {"algorithm": algorithm}
    if algorithm == "dqn":
        agent.update(learning_starts=64, updates_per_step=4, batch_size=32)
    return load_spec(
        {
            "name": "g",
            "seed": 5,
            "workload": "gym",
            "output_dir": str(tmp_path / "g"),
            "env": {"id": "CartPole-v1", "num_envs": 2, "segment_length": 16, "segments_per_step": 2},
            "agent": agent,
            "pipeline": {"mode": "async", "steps": 6, "eval_interval": 3, "max_policy_lag": 1, **pipeline},
            "resources": {"rollout_workers": 2, "rollout_restarts": 2},
            "checkpoint": {"interval": 0},
            "metrics": {"progress_bar": False},
        }
    )


def _every_segment_once(trace: dict) -> list[int]:
    consumed = [g for step in trace["consumed"] for g in step]
    everything = consumed + trace["dropped"] + trace["leftover"]
    assert len(everything) == len(set(everything))  # none twice
    assert set(everything) == set(range(max(everything) + 1))  # none lost
    return consumed


@pytest.mark.parametrize("algorithm", ["ppo", "dqn"])
def test_sampling_workers_feed_the_learner_within_the_lag_bound(tmp_path, algorithm):
    result = run(_spec(tmp_path, algorithm))
    assert result["outcome"] == "completed" and result["steps"] == 6
    assert [len(step) for step in result["trace"]["consumed"]] == [2] * 6
    _every_segment_once(result["trace"])
    assert result["metrics"][ENV_STEPS] == 6 * 2 * 2 * 16
    steps, _ = read_jsonl(tmp_path / "g" / "metrics.jsonl")
    lags = [r[STALENESS_MAX] for r in steps if STALENESS_MAX in r]  # (evaluation rows carry none)
    assert len(lags) == 6 and max(lags) <= 1
    # the evaluator (a process of its own, started with the run) never holds training up: a request made while it
    # is busy waits, and a newer one replaces it; the first and the final ones are always evaluated
    evals = [e["step"] for e in result["eval"]]
    assert evals[0] == 0 and evals[-1] == 6 and set(evals) <= {0, 3, 6}
    assert all(e[EVAL_RETURN_MEAN] >= 8 for e in result["eval"])


@pytest.mark.slow
def test_a_killed_sampling_worker_is_replaced_and_no_segment_is_lost_or_trained_twice(tmp_path):
    # lag 0 under throttle: at a boundary the workers certainly hold work for the step after next
    spec = _spec(tmp_path, max_policy_lag=0, on_lag_exceeded="throttle", queue_capacity=4)
    control = Control()
    killed: list[int] = []

    def stop(step, metrics):
        if step in (2, 4):
            pid = control.status()["rollout_pids"][0]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        return False

    result = run(spec, control=control, stop=stop)

    assert result["outcome"] == "completed" and result["steps"] == 6 and len(killed) == 2
    _, events = read_jsonl(tmp_path / "g" / "metrics.jsonl")
    restarted = [e["payload"] for e in events if e["event"] == "rollout_restarted"]
    assert sorted((e["rank"], e["restarts"], e["reason"]) for e in restarted) == [
        (0, 1, "killed by SIGKILL"),
        (0, 2, "killed by SIGKILL"),
    ]
    assert not set(killed) & set(control.status()["rollout_pids"])
    consumed = _every_segment_once(result["trace"])
    assert len(consumed) == 12 and result["trace"]["dropped"] == []
    steps, _ = read_jsonl(tmp_path / "g" / "metrics.jsonl")
    assert [r[STALENESS_MAX] for r in steps if STALENESS_MAX in r] == [0] * 6


def test_an_async_run_resumed_from_its_checkpoint_trains_every_segment_once(tmp_path):
    # the first half stops at step 3 with segments in the queue and in flight; the second takes them over
    first = run(_spec(tmp_path, steps=3))
    checkpoint = first["checkpoint"]
    second = run(_spec(tmp_path, steps=6), resume=checkpoint)  # in place, as a restarted role resumes
    assert second["steps"] == 6
    consumed = [g for step in first["trace"]["consumed"] + second["trace"]["consumed"] for g in step]
    everything = consumed + second["trace"]["dropped"] + second["trace"]["leftover"]
    assert len(consumed) == 12 and len(everything) == len(set(everything))  # none twice
    assert set(everything) == set(range(max(everything) + 1))  # none lost
