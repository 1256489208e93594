"""The gym workload through the pipeline: a sync run samples, trains, evaluates and checkpoints; a resumed
run continues bit-identically; a colocated run learns exactly as a sync one; the spec refuses what a gym run cannot do, naming the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from runtime.checkpoint import load_checkpoint
from runtime.contract import ENV_STEPS, ENV_STEPS_PER_S, EVAL_RETURN_MEAN, EVAL_WEIGHTS_VERSION, EXIT_BAD_INPUT
from runtime.pipeline import run
from runtime.spec import SpecError, load_spec

ROOT = Path(__file__).resolve().parents[4]


def _spec(tmp_path: Path, name: str, algorithm: str = "ppo", **pipeline):
    agent = {"algorithm": algorithm}
    if algorithm == "dqn":
        agent.update(learning_starts=64, updates_per_step=4, batch_size=32)
    return load_spec(
        {
            "name": name,
            "seed": 3,
            "workload": "gym",
            "output_dir": str(tmp_path / name),
            "env": {"id": "CartPole-v1", "num_envs": 2, "segment_length": 32, "segments_per_step": 2},
            "agent": agent,
            "pipeline": {"mode": "sync", "steps": 4, "eval_interval": 2, **pipeline},
            "checkpoint": {"interval": 2, "keep_last": 5},
            "metrics": {"progress_bar": False, "jsonl": False},
        }
    )


@pytest.mark.parametrize("algorithm", ["ppo", "dqn"])
def test_a_sync_gym_run_samples_trains_evaluates_and_checkpoints(tmp_path, algorithm):
    torch.set_num_threads(1)
    result = run(_spec(tmp_path, "r", algorithm))
    assert result["steps"] == 4 and result["outcome"] == "completed"
    # every step trained on segments_per_step segments of num_envs x segment_length env steps
    assert result["metrics"][ENV_STEPS] == 4 * 2 * 2 * 32
    assert result["metrics"][ENV_STEPS_PER_S] > 0
    assert [e["step"] for e in result["eval"]] == [0, 2, 4]
    assert all(e[EVAL_RETURN_MEAN] >= 8 for e in result["eval"])  # CartPole pays 1 per step, 8 steps at least
    assert result["trace"]["consumed"] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # segment indices, in order
    policy = Path(result["checkpoint"]) / "policy"
    assert (policy / "policy.pt").is_file() and (policy / "policy.json").is_file()


def _untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(("time/", "throughput/", "bubble/"))}


@pytest.mark.parametrize("algorithm", ["ppo", "dqn"])
def test_a_resumed_sync_gym_run_continues_bit_identically(tmp_path, algorithm):
    torch.set_num_threads(1)
    whole = run(_spec(tmp_path, "whole", algorithm))
    halfway = tmp_path / "whole" / "checkpoints" / "step-00000002"
    resumed = run(_spec(tmp_path, "resumed", algorithm), resume=halfway)
    assert _untimed(resumed["metrics"]) == _untimed(whole["metrics"])  # losses, returns, env steps: exactly
    assert resumed["eval"][-1] == {**whole["eval"][-1], "time/eval": resumed["eval"][-1]["time/eval"]}
    a = load_checkpoint(Path(whole["checkpoint"]), keys=["trainer"])["trainer"]
    b = load_checkpoint(Path(resumed["checkpoint"]), keys=["trainer"])["trainer"]
    weights = "actor" if algorithm == "ppo" else "q"
    assert a[weights].keys() == b[weights].keys()
    assert all(torch.equal(a[weights][k], b[weights][k]) for k in a[weights])


@pytest.mark.parametrize("algorithm", ["ppo", "dqn"])
def test_a_colocated_gym_run_samples_on_the_learners_own_networks_and_learns_exactly_as_sync(tmp_path, algorithm):
    # colocated skips the weight copy, nothing else: every loss, return and weight is sync's
    torch.set_num_threads(1)
    sync = run(_spec(tmp_path, "sync", algorithm))
    colocated = run(_spec(tmp_path, "colocated", algorithm, mode="colocated"))
    assert colocated["outcome"] == "completed" and colocated["steps"] == 4
    assert _untimed(colocated["metrics"]) == _untimed(sync["metrics"])
    assert [_untimed(e) for e in colocated["eval"]] == [_untimed(e) for e in sync["eval"]]
    a = load_checkpoint(Path(sync["checkpoint"]), keys=["trainer"])["trainer"]
    b = load_checkpoint(Path(colocated["checkpoint"]), keys=["trainer"])["trainer"]
    weights = "actor" if algorithm == "ppo" else "q"
    assert all(torch.equal(a[weights][k], b[weights][k]) for k in a[weights])


@pytest.mark.parametrize("algorithm", ["ppo", "dqn"])
def test_a_run_started_from_a_checkpoints_networks_begins_where_that_run_ended(tmp_path, algorithm):
    # a fork: the child's first evaluation (step 0, the same seeded episodes) is the parent's last
    torch.set_num_threads(1)
    parent = run(_spec(tmp_path, "parent", algorithm))
    child_spec = _spec(tmp_path, "child", algorithm).model_copy(deep=True)
    child_spec.agent.init_path = parent["checkpoint"]
    child = run(child_spec)
    assert child["eval"][0]["step"] == 0
    assert _untimed(child["eval"][0]) == {**_untimed(parent["eval"][-1]), "step": 0, EVAL_WEIGHTS_VERSION: 0.0}
    fresh = run(_spec(tmp_path, "fresh", algorithm))
    assert _untimed(fresh["eval"][0]) != _untimed(child["eval"][0])  # a new learner evaluates otherwise


def test_a_checkpoint_of_another_algorithm_or_none_is_bad_input_naming_agent_init_path(tmp_path):
    torch.set_num_threads(1)
    ppo = run(_spec(tmp_path, "ppo", "ppo", steps=1, eval_interval=0))
    for name, init_path, expected in (
        ("dqn", ppo["checkpoint"], "holds no q and target network"),
        ("nowhere", str(tmp_path / "no-such-checkpoint"), "is not a readable checkpoint"),
    ):
        spec = _spec(tmp_path, name, "dqn" if name == "dqn" else "ppo").resolved()
        spec["agent"]["init_path"] = init_path
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(spec))
        done = subprocess.run(
            [sys.executable, "-m", "runtime", "run", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == EXIT_BAD_INPUT, done.stderr[-2000:]
        assert "agent.init_path" in done.stderr and expected in done.stderr


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"env": {"id": "NoSuchEnv-v0"}}, "env.id"),
        ({"env": {"id": None}}, "env.id"),
        ({"env": {"entry_point": "not an entry point", "id": None}}, "env.entry_point"),
        ({"model": {"builtin": "tiny-llama"}}, "model.builtin"),
        ({"pipeline": {"prompts_per_step": 4}}, "pipeline.prompts_per_step"),
        ({"pipeline": {"mode": "colocated", "offload_optimizer": True}}, "pipeline.offload_optimizer"),
        (
            {
                "pipeline": {"mode": "async", "remote_weight_sync": "broadcast"},
                "resources": {"remote_rollout_workers": 1},
            },
            "pipeline.remote_weight_sync",
        ),
        ({"pipeline": {"mode": "async"}, "resources": {"remote_evaluator": True}}, "resources.remote_evaluator"),
        ({"pipeline": {"mode": "async", "transfer_window_s": 1.0}}, "pipeline.transfer_window_s"),
        ({"agent": {"algorithm": "ppo", "tau": 0.5}}, "agent.tau"),
        ({"agent": {"algorithm": "dqn", "epochs": 2}}, "agent.epochs"),
        ({"resources": {"trainer_devices": 2}}, "resources.trainer_devices"),
    ],
)
def test_a_gym_spec_refuses_what_a_gym_run_cannot_do_naming_the_field(overrides, field):
    data = {"workload": "gym", "env": {"id": "CartPole-v1"}}
    for section, values in overrides.items():
        data[section] = {**data.get(section, {}), **values}
    with pytest.raises(SpecError) as caught:
        load_spec(data)
    assert field in [e["field"] for e in caught.value.errors]


def test_an_llm_spec_refuses_gym_sections_and_leaves_them_out_of_its_resolved_spec():
    with pytest.raises(SpecError) as caught:
        load_spec({"env": {"id": "CartPole-v1"}})
    assert caught.value.errors == [{"field": "env.id", "message": "acts only with workload gym, not llm"}]
    assert {"env", "agent"}.isdisjoint(load_spec({}).resolved())
    gym = load_spec({"workload": "gym", "env": {"id": "CartPole-v1"}, "agent": {"algorithm": "dqn"}}).resolved()
    assert {"model", "task", "algorithm", "trainer", "rollout", "reward"}.isdisjoint(gym)
    assert "epochs" not in gym["agent"] and gym["agent"]["activation"] == "relu"  # the algorithm's default, filled


def test_the_cli_exits_with_the_bad_input_code_when_the_learner_cannot_act_in_the_env(tmp_path):
    # DQN needs Discrete actions; Pendulum's are a Box: refused before any work starts
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"workload: gym\noutput_dir: {tmp_path}/out\nenv: {{id: Pendulum-v1}}\nagent: {{algorithm: dqn}}\n")
    done = subprocess.run(
        [sys.executable, "-m", "runtime", "run", str(spec)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == EXIT_BAD_INPUT, done.stderr
    assert "env.id" in done.stderr and "dqn" in done.stderr
    assert not (tmp_path / "out" / "checkpoints").exists()
