"""Tiny end-to-end runs that assert learning happened: CartPole-v1 through the sync loop (sample with the
published weights, train, publish), PPO and DQN each in a few thousand env steps.

The measure is the mean return of the episodes that ended in the first eighth of the steps against the
last eighth. With these settings the ratio was 4.7-9.0 for PPO (seeds 0-4) and 5.6-12.2 for DQN (seeds
0-6) when they were written, so 2x leaves a wide margin, while a learner that does not learn stays
near 1 (PPO with a learning rate of 1e-12: 0.91-1.09 over seeds 0-4)."""

from __future__ import annotations

import torch

from runtime.workloads.gym import metric_names as N
from runtime.workloads.gym.envs import describe_spaces, make_env, make_vector_env
from runtime.workloads.gym.learners import DQNConfig, DQNLearner, PPOConfig, PPOLearner, sampling_policy
from runtime.workloads.gym.sampler import SegmentSampler
from tests.runtime.workloads.gym.helpers import sync_loop

torch.set_num_threads(1)


def mean_return(metrics: list[dict[str, float]]) -> float:
    """Mean return over every episode that ended in these steps (steps weighted by their episode count)."""
    episodes = sum(m[N.EPISODES] for m in metrics)
    assert episodes > 0, "no episode ended in the window"
    return sum(m[N.EPISODE_RETURN_MEAN] * m[N.EPISODES] for m in metrics if m[N.EPISODES]) / episodes


def run_cartpole(learner_cls, cfg, num_envs: int, length: int, steps: int, seed: int = 0) -> list[dict[str, float]]:
    make = lambda: make_env("CartPole-v1")  # noqa: E731
    space = describe_spaces(make())
    learner = learner_cls(space, cfg, seed=seed)
    sampler = SegmentSampler(make_vector_env(make, num_envs), space, length, seed=seed)
    return sync_loop(learner, sampler, sampling_policy(space, cfg), range(steps))


def test_ppo_return_rises_on_cartpole():
    metrics = run_cartpole(PPOLearner, PPOConfig(), num_envs=4, length=128, steps=16)  # 8,192 env steps
    first, last = mean_return(metrics[:2]), mean_return(metrics[-2:])
    assert last >= 2 * first, f"mean return {first:.1f} -> {last:.1f}"


def test_dqn_return_rises_on_cartpole():
    metrics = run_cartpole(DQNLearner, DQNConfig(), num_envs=4, length=16, steps=100)  # 6,400 env steps
    first, last = mean_return(metrics[:12]), mean_return(metrics[-12:])
    assert last >= 2 * first, f"mean return {first:.1f} -> {last:.1f}"
