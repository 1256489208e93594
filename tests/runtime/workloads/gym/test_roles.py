"""The roles' priorities (issue 16): the evaluation agent runs on env copies of its own, in a process of its own
at the lowest CPU priority, and a held-up evaluation never holds up a training step; its result arrives
later, tagged with the step it was asked at and the weight version it evaluated. (The target sync's place
behind the update: ``test_target_sync_events.py``.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from runtime.contract import EVAL_RETURN_MEAN, EVAL_WEIGHTS_VERSION
from runtime.evaluation.process import NICE, ProcessEvaluator
from runtime.pipeline import run
from runtime.spec import load_spec
from runtime.workloads.gym.envs import describe_spaces, episode_seed, make_env, make_vector_env
from runtime.workloads.gym.learners import PPOConfig, PPOLearner, sampling_policy
from runtime.workloads.gym.sampler import SegmentSampler
from runtime.workloads.gym.workload import EVAL_SEED_OFFSET, GymWorkload
from tests.runtime.workloads.gym.helpers import sync_loop

GATED = "tests.runtime.workloads.gym.gated_env:make_env"
PPO_SMALL = PPOConfig(hidden=(16,), epochs=1, minibatches=2)
WAIT_S = 60.0  # a bound on waiting for a state, never a measured duration


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _wait_for(condition, what: str):
    deadline = time.monotonic() + WAIT_S
    while not (found := condition()):
        assert time.monotonic() < deadline, f"waited {WAIT_S:g} s for {what}"
        time.sleep(0.01)
    return found


def _training(seed: int = 0):
    make = lambda: make_env("CartPole-v1")  # noqa: E731
    space = describe_spaces(make())
    learner = PPOLearner(space, PPO_SMALL, seed=seed)
    sampler = SegmentSampler(make_vector_env(make, 2), space, 16, seed=seed)
    return space, learner, sampler, sampling_policy(space, PPO_SMALL)


def _untimed(metrics: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in metrics]


def _spec_data(tmp_path: Path, mode: str) -> dict:
    """A run whose evaluation's first episode is held at the gate ``tmp_path / "gate"`` until the test opens it."""
    gate = tmp_path / "gate"
    gate.mkdir(exist_ok=True)
    seed = 3
    data = {
        "name": "roles",
        "seed": seed,
        "workload": "gym",
        "output_dir": str(tmp_path / "roles"),
        "env": {
            "id": None,
            "entry_point": GATED,
            "kwargs": {"gate": str(gate), "block_seeds": [episode_seed(seed + EVAL_SEED_OFFSET, 0)]},
            "num_envs": 2,
            "segment_length": 16,
            "eval_episodes": 1,
        },
        "agent": {"algorithm": "ppo", "hidden": [16], "epochs": 1, "minibatches": 2},
        "pipeline": {"mode": mode, "steps": 4, "eval_interval": 1},
        "checkpoint": {"interval": 0},
        "metrics": {"progress_bar": False, "jsonl": False},
    }
    if mode == "async":
        data["pipeline"].update(max_policy_lag=1)
        data["resources"] = {"rollout_workers": 1}
    return data


def _held(gate: Path) -> list[Path]:
    return sorted(gate.glob("entered-*"))


def test_a_held_up_evaluation_never_holds_up_training_and_reports_the_version_it_evaluated(tmp_path):
    spec = load_spec(_spec_data(tmp_path, "async"))
    gate = tmp_path / "gate"
    space, learner, sampler, policy = _training()
    evaluator = ProcessEvaluator(spec.resolved(), "cpu")
    try:
        evaluator.submit(0, learner.version, learner.publish_state())
        held = _wait_for(lambda: _held(gate), "the evaluation of version 0 to be held inside env.step")
        trained = sync_loop(learner, sampler, policy, range(3))  # three training steps meanwhile
        assert learner.version == 3 and evaluator.results() == []  # ... and that evaluation is still unfinished
        evaluator.submit(3, learner.version, learner.publish_state())
    finally:
        (gate / "open").touch()
    results = evaluator.close(wait=True)
    assert [(step, m[EVAL_WEIGHTS_VERSION]) for step, m in results] == [(0, 0.0), (3, 3.0)]
    # held in the evaluator's process, not this one, at the lowest CPU priority
    assert [p.name for p in held] == [f"entered-{evaluator.pid}"] and evaluator.pid != os.getpid()
    assert held[0].read_text() == f"{NICE}\n"

    # Its own env copy and a copy of the weights: the training went exactly as with no evaluation.
    _, alone, alone_sampler, alone_policy = _training()
    assert _untimed(sync_loop(alone, alone_sampler, alone_policy, range(3))) == _untimed(trained)


def test_an_evaluation_that_fails_is_raised_to_the_trainer_with_its_traceback(tmp_path):
    spec = load_spec(_spec_data(tmp_path, "async"))
    evaluator = ProcessEvaluator(spec.resolved(), "cpu")
    evaluator.submit(0, 0, {"no_such_parameter": torch.zeros(1)})  # weights of another network

    def raised():
        try:
            evaluator.results()
        except RuntimeError as exc:
            return str(exc)
        return None

    message = _wait_for(raised, "the evaluation's error")
    assert message.startswith("evaluator failed: Traceback") and "no_such_parameter" in message
    with pytest.raises(RuntimeError, match="no_such_parameter"):  # closing reports it too
        evaluator.close(wait=False)
    assert evaluator._proc.exitcode is not None  # the process is gone


def test_the_evaluation_env_is_a_copy_of_its_own(tmp_path):
    spec = load_spec(_spec_data(tmp_path, mode="sync"))
    task = GymWorkload().build_task(spec)
    try:
        training = [env.unwrapped for env in task.sampler.envs.envs]
        assert len(training) == 2 and all(env is not task.eval_env.unwrapped for env in training)
    finally:
        task.sampler.envs.close()
        task.eval_env.close()


class _Order:
    """A reporter that logs the order of step and evaluation reports; it holds step 1 until the evaluation
    asked for at step 0 is held at the gate, and opens the gate once step 4 is reported."""

    def __init__(self, gate: Path) -> None:
        self.gate = gate
        self.log: list[tuple[str, int]] = []

    def report(self, step: int, metrics) -> None:
        self.log.append(("eval" if EVAL_RETURN_MEAN in metrics else "step", step))
        if self.log[-1] == ("step", 1):
            _wait_for(lambda: _held(self.gate), "the step-0 evaluation to be held")
        if self.log[-1] == ("step", 4):
            (self.gate / "open").touch()

    def event(self, kind: str, payload) -> None:
        pass

    def close(self) -> None:
        pass


def test_in_async_mode_training_steps_go_on_while_an_evaluation_is_held_up(tmp_path):
    spec = load_spec(_spec_data(tmp_path, mode="async"))
    order = _Order(tmp_path / "gate")
    try:
        result = run(spec, reporters=order)
    finally:
        (tmp_path / "gate" / "open").touch()
    assert result["outcome"] == "completed" and result["steps"] == 4
    steps = [("step", s) for s in (1, 2, 3, 4)]
    assert order.log[:4] == steps  # every step reported while the step-0 evaluation was held
    evals = [step for kind, step in order.log[4:] if kind == "eval"]
    # The held evaluation's result arrives after them, then the final step's; one asked for at step 3 may
    # have been started in between (the evaluator's one-slot mailbox keeps the newest request only).
    assert evals in ([0, 4], [0, 3, 4]) and order.log[4:] == [("eval", s) for s in evals]
    assert [e["step"] for e in result["eval"]] == evals
    assert result["eval"][0][EVAL_WEIGHTS_VERSION] == 0.0  # the held one evaluated the first weights
