"""Greedy evaluation: whole episodes, the most likely action, seeded episode by episode."""

from __future__ import annotations

import torch

from runtime.workloads.gym.envs import describe_spaces, make_env
from runtime.workloads.gym.evaluation import greedy_returns
from runtime.workloads.gym.learners import PPOConfig, PPOLearner, sampling_policy

USER = "tests.runtime.workloads.gym.user_envs:make_env"


class FixedChoice:
    """Greedy action ``action`` everywhere; ``act`` is never called by the evaluator."""

    def __init__(self, action: int):
        self.action = action

    def act(self, obs, generator):
        raise AssertionError("evaluation must act greedily")

    def greedy(self, obs):
        return torch.full((obs.shape[0],), self.action, dtype=torch.int64)


def test_episodes_run_to_their_end_either_way():
    env = make_env(entry_point=USER, kwargs={"max_steps": 4})
    space = describe_spaces(env)
    assert greedy_returns(FixedChoice(0), env, space, episodes=3, seed=0) == [4.0, 4.0, 4.0]  # truncated
    assert greedy_returns(FixedChoice(1), env, space, episodes=2, seed=0) == [1.0, 1.0]  # terminated


def test_same_seed_same_returns():
    env = make_env("CartPole-v1")
    space = describe_spaces(env)
    policy = sampling_policy(space, PPOConfig())
    policy.load_state_dict(PPOLearner(space, PPOConfig(), seed=3).publish_state())
    first = greedy_returns(policy, env, space, episodes=4, seed=11)
    assert greedy_returns(policy, env, space, episodes=4, seed=11) == first
    assert len(set(first)) > 1  # each episode has a seed of its own
