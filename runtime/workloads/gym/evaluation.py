"""Greedy evaluation: whole episodes on an env copy of the evaluator's own, acting on the most likely action."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch

from runtime.workloads.gym.envs import SpaceInfo, episode_seed, to_env_actions
from runtime.workloads.gym.networks import Policy


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
