"""DQN's replay buffer: a ring of transitions, sampled uniformly with a generator of its own.

A transition is ``(s, a, r, s', terminated)``: ``s'`` is the state the action led to (a finished
episode's final observation, :meth:`Segment.next_observations`), so a truncated transition
bootstraps from it and only ``terminated`` cuts the future. Its whole state — the stored
transitions, the write position and the sampling generator — is plain tensors in
:meth:`ReplayBuffer.state_dict`, so a resumed run samples the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from runtime.workloads.gym.segments import Segment


@dataclass
class Transitions:
    """A batch of ``N`` transitions."""

    obs: Tensor  # [N, D] float32
    actions: Tensor  # [N] int64 or [N, A] float32
    rewards: Tensor  # [N] float32
    next_obs: Tensor  # [N, D] float32
    terminated: Tensor  # [N] bool


class ReplayBuffer:
    """The newest ``capacity`` transitions; the oldest is overwritten first."""

    _FIELDS = ("obs", "actions", "rewards", "next_obs", "terminated")

    def __init__(
        self,
        capacity: int,
        obs_dim: int,
        seed: int,
        action_shape: tuple[int, ...] = (),
        action_dtype: torch.dtype = torch.int64,
    ):
        if capacity < 1:
            raise ValueError("buffer_size must be >= 1")
        self.capacity = capacity
        self.storage: dict[str, Tensor] = {
            "obs": torch.zeros(capacity, obs_dim),
            "actions": torch.zeros((capacity, *action_shape), dtype=action_dtype),
            "rewards": torch.zeros(capacity),
            "next_obs": torch.zeros(capacity, obs_dim),
            "terminated": torch.zeros(capacity, dtype=torch.bool),
        }
        self.position = 0  # where the next transition goes
        self.size = 0
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return self.size

    def add_segment(self, segment: Segment) -> None:
        """Every step of every copy in ``segment``, in row-major (t, e) order."""
        t, e = segment.rewards.shape
        self.add(
            Transitions(
                obs=segment.obs.reshape(t * e, -1),
                actions=segment.actions.reshape(t * e, *segment.actions.shape[2:]),
                rewards=segment.rewards.reshape(-1),
                next_obs=segment.next_observations().reshape(t * e, -1),
                terminated=segment.terminated.reshape(-1),
            )
        )

    def add(self, batch: Transitions) -> None:
        n = batch.rewards.shape[0]
        keep = min(n, self.capacity)  # more than fits: only the newest survive
        slots = (self.position + torch.arange(n - keep, n)) % self.capacity
        for name in self._FIELDS:
            self.storage[name][slots] = getattr(batch, name)[n - keep :].to(self.storage[name].dtype)
        self.position = (self.position + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    def sample(self, batch_size: int) -> Transitions:
        """``batch_size`` transitions drawn uniformly, with replacement."""
        if self.size == 0:
            raise ValueError("cannot sample an empty replay buffer")
        idx = torch.randint(self.size, (batch_size,), generator=self.generator)
        return Transitions(**{name: self.storage[name][idx] for name in self._FIELDS})

    def state_dict(self) -> dict[str, Any]:
        """The filled rows (in storage order), the write position and the generator."""
        return {
            "capacity": self.capacity,
            "position": self.position,
            "size": self.size,
            "generator": self.generator.get_state(),
            **{name: self.storage[name][: self.size].clone() for name in self._FIELDS},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["capacity"]) != self.capacity:
            raise ValueError(f"replay state has capacity {state['capacity']}, this buffer {self.capacity}")
        size = int(state["size"])
        for name in self._FIELDS:
            rows = state[name]
            if rows.shape[1:] != self.storage[name].shape[1:] or rows.shape[0] != size:
                raise ValueError(f"replay state: `{name}` has shape {tuple(rows.shape)}, expected [{size}, ...]")
            self.storage[name].zero_()
            self.storage[name][:size] = rows
        self.position = int(state["position"])
        self.size = size
        self.generator.set_state(state["generator"])
