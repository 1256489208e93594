"""Entry point of the roles tests: CartPole whose episodes reset with one of ``block_seeds`` stop inside
``step`` until the file ``<gate>/open`` exists — an evaluation agent that is deliberately held up, in
whatever process it runs. Held, it writes ``<gate>/entered-<pid>`` with its thread's nice value.

The training envs get the same arguments, but their episode seeds never are the evaluation's.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import gymnasium as gym

GUARD_S = 60.0  # a test that fails before opening the gate must not hold the evaluator for ever
POLL_S = 0.01


class GatedEnv(gym.Wrapper):
    def __init__(self, env: gym.Env, gate: Path, block_seeds: set[int]):
        super().__init__(env)
        self.gate, self.block_seeds = gate, block_seeds
        self.held = False

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        self.held = seed in self.block_seeds
        return super().reset(seed=seed, options=options)

    def step(self, action: Any) -> Any:
        if self.held and not (self.gate / "open").exists():
            nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            (self.gate / f"entered-{os.getpid()}").write_text(f"{nice}\n")
            deadline = time.monotonic() + GUARD_S
            while not (self.gate / "open").exists():
                if time.monotonic() > deadline:
                    raise RuntimeError("the test never opened the gate")
                time.sleep(POLL_S)
        return super().step(action)


def make_env(gate: str = "", block_seeds: list[int] | None = None) -> gym.Env:
    return GatedEnv(gym.make("CartPole-v1"), Path(gate), set(block_seeds or []))
