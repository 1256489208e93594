"""Entry points of the user-environment tests: a small environment written by hand, and factories that go wrong.

``CountingEnv``: the observation is ``[steps since reset, reset seed]``; every step pays 1; action 1
ends the episode in a terminal state, action 0 does not, and ``max_steps`` truncates it (Gymnasium's
TimeLimit). Its trajectory is a function of the reset seed and the actions, as Gymnasium asks.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.wrappers import TimeLimit


class CountingEnv(gym.Env):
    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, shape=(2,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.steps = 0
        self.seed_seen = 0.0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.steps = 0
        self.seed_seen = float(seed % 1000) if seed is not None else -1.0
        return self._obs(), {}

    def step(self, action):
        self.steps += 1
        return self._obs(), 1.0, bool(action == 1), False, {}

    def _obs(self) -> np.ndarray:
        return np.array([self.steps, self.seed_seen], dtype=np.float32)


def make_env(max_steps: int = 3) -> gym.Env:
    return TimeLimit(CountingEnv(), max_episode_steps=max_steps)


def make_not_an_env() -> dict:
    return {"observation_space": None}


def make_failing_env() -> gym.Env:
    raise RuntimeError("simulator licence not found")


NOT_CALLABLE = 42
