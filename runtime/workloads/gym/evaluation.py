"""Greedy evaluation: whole episodes on an env copy of the evaluator's own, acting on the most likely action.

The evaluation agent is the lowest of the gym run's roles: in async mode the pipeline's
:class:`~runtime.evaluation.evaluator.BackgroundEvaluator` evaluates a private copy of a published
version's weights in a thread at ``nice`` 10 and the trainer never waits for it, so a result may arrive
steps after the step it was asked at: :func:`evaluate_policy` tags it with the version it evaluated
(``eval/weights_version``).
"""

from __future__ import annotations

import statistics
import time
from typing import Protocol

import gymnasium as gym
import numpy as np
import torch

from runtime.contract import EVAL_RETURN_MAX, EVAL_RETURN_MEAN, EVAL_RETURN_MIN, EVAL_WEIGHTS_VERSION
from runtime.evaluation.evaluator import TIME_EVAL
from runtime.workloads.gym.envs import SpaceInfo, episode_seed, to_env_actions
from runtime.workloads.gym.networks import Policy


class EvalEngine(Protocol):
    """What the evaluator holds: a policy and the weight version loaded into it (build.PolicyEngine)."""

    @property
    def policy(self) -> Policy: ...

    @property
    def version(self) -> int: ...


def evaluate_policy(engine: EvalEngine, env: gym.Env, space: SpaceInfo, episodes: int, seed: int) -> dict[str, float]:
    """One evaluation: the returns of :func:`greedy_returns`, the weight version they belong to, the seconds."""
    started = time.perf_counter()
    version = engine.version  # read first: the evaluated weights are the ones loaded now
    returns = greedy_returns(engine.policy, env, space, episodes, seed)
    return {
        EVAL_RETURN_MEAN: statistics.fmean(returns),
        EVAL_RETURN_MIN: min(returns),
        EVAL_RETURN_MAX: max(returns),
        EVAL_WEIGHTS_VERSION: float(version),
        TIME_EVAL: time.perf_counter() - started,
    }


@torch.no_grad()
def greedy_returns(policy: Policy, env: gym.Env, space: SpaceInfo, episodes: int, seed: int) -> list[float]:
    """Undiscounted returns of ``episodes`` greedy episodes; episode ``i`` is reset with ``episode_seed(seed, i)``.

    An episode runs until the env terminates or truncates it (give the env a time limit)."""
    returns = []
    for i in range(episodes):
        obs, _ = env.reset(seed=episode_seed(seed, i))
        total, ended = 0.0, False
        while not ended:
            flat = torch.from_numpy(np.asarray(obs, dtype=np.float32).reshape(1, -1))
            action = to_env_actions(space, policy.greedy(flat), env.action_space.dtype)[0]
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            ended = bool(terminated or truncated)
        returns.append(total)
    return returns
