"""A trajectory segment: what a sampling worker sends, the gym workload's sample.

One :class:`Segment` is ``T`` steps of a vector env of ``E`` copies, taken by a policy of known
weight versions; episodes start and end anywhere inside it. It carries what the pipeline reads of
any sample (``sample_id``, ``version``: the oldest policy version in it, ``group_id``) and what the
learners need: per-step observations, actions, behaviour log-probs, rewards, the two kinds of
episode end (Gymnasium's ``terminated`` and ``truncated``), the observation after the last step,
and the final observation of every episode that ended inside the segment, which a truncated
episode's value bootstraps from.

:func:`pack_segments` / :func:`unpack_segments` turn segments into plain tensors (what
``torch.load(weights_only=True)`` reads: the transfer and checkpoint format) and back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from runtime.sample_queue import PackError

PACK_KIND = "gym-segments"


@dataclass
class Segment:
    """``T`` steps of ``E`` environments. Shapes below; ``D`` the flattened observation size."""

    sample_id: int
    group_id: int  # the issue index of the work item that made it
    obs: Tensor  # [T, E, D] float32: the raw observation each action was taken on
    actions: Tensor  # [T, E] int64 (Discrete, numbered from 0) or [T, E, A] float32 (Box, before clipping)
    logprobs: Tensor  # [T, E] float32: log-probability of the action under the behaviour policy
    rewards: Tensor  # [T, E] float32
    terminated: Tensor  # [T, E] bool: the step ended its episode in a terminal state (no future value)
    truncated: Tensor  # [T, E] bool: the step ended its episode early (time limit): its future has a value
    versions: Tensor  # [T] int64: the policy version that chose each step's actions
    next_obs: Tensor  # [E, D] float32: the observation after the last step (a new episode's first where one ended)
    # [K, D] float32: the last observation of each episode that ended in the segment, in row-major
    # order of (t, e) over terminated | truncated
    final_obs: Tensor
    episode_returns: Tensor  # [M] float64: undiscounted returns of the episodes that ended in the segment
    episode_lengths: Tensor  # [M] int64: their lengths in steps (counted from the episode's start)

    def __post_init__(self) -> None:
        if self.obs.dim() != 3:
            raise PackError(f"segment {self.sample_id}: obs must be [T, E, D], got {tuple(self.obs.shape)}")
        t, e, d = self.obs.shape
        for name in ("logprobs", "rewards", "terminated", "truncated"):
            if tuple(getattr(self, name).shape) != (t, e):
                raise PackError(f"segment {self.sample_id}: {name} must be [{t}, {e}]")
        if tuple(self.actions.shape[:2]) != (t, e) or self.actions.dim() not in (2, 3):
            raise PackError(f"segment {self.sample_id}: actions must be [{t}, {e}] or [{t}, {e}, A]")
        if tuple(self.versions.shape) != (t,) or tuple(self.next_obs.shape) != (e, d):
            raise PackError(f"segment {self.sample_id}: versions must be [{t}] and next_obs [{e}, {d}]")
        ended = int(self.done.sum())
        if tuple(self.final_obs.shape) != (ended, d):
            raise PackError(f"segment {self.sample_id}: final_obs must be [{ended}, {d}] (one per episode end)")
        if self.episode_returns.shape != self.episode_lengths.shape or self.episode_returns.dim() != 1:
            raise PackError(f"segment {self.sample_id}: episode_returns and episode_lengths must be [M]")

    @property
    def version(self) -> int:
        """The oldest policy version that chose an action in this segment (staleness is measured from it)."""
        return int(self.versions.min()) if self.versions.numel() else 0

    @property
    def done(self) -> Tensor:
        """``[T, E]`` bool: the step ended its episode, either way."""
        return self.terminated | self.truncated

    @property
    def num_steps(self) -> int:
        """Environment steps in the segment, ``T * E``."""
        return int(self.rewards.numel())

    def next_observations(self) -> Tensor:
        """``[T, E, D]``: the state each step led to — the next step's observation, or for a step that
        ended an episode that episode's final observation (not the next episode's first)."""
        following = torch.cat([self.obs[1:], self.next_obs.unsqueeze(0)], dim=0)
        following[self.done] = self.final_obs  # boolean-mask assignment fills rows in row-major order
        return following


def pack_segments(segments: list[Segment]) -> dict[str, Any]:
    """Segments of one shape as plain tensors: per-step fields stacked ``[S, ...]``, ragged ones flat with counts."""
    packed: dict[str, Any] = {"kind": PACK_KIND, "count": len(segments)}
    if not segments:
        return packed
    first = segments[0]
    for s in segments[1:]:
        if s.obs.shape != first.obs.shape or s.actions.shape != first.actions.shape:
            raise PackError(
                f"segment {s.sample_id}: shape {tuple(s.obs.shape)} / {tuple(s.actions.shape)} differs from "
                f"segment {first.sample_id}'s {tuple(first.obs.shape)} / {tuple(first.actions.shape)}"
            )
    packed["sample_id"] = torch.tensor([s.sample_id for s in segments], dtype=torch.int64)
    packed["group_id"] = torch.tensor([s.group_id for s in segments], dtype=torch.int64)
    for name in _STACKED:
        packed[name] = torch.stack([getattr(s, name) for s in segments])
    for name, count_key in _RAGGED.items():
        packed[name] = torch.cat([getattr(s, name) for s in segments])
        packed[count_key] = torch.tensor([len(getattr(s, name)) for s in segments], dtype=torch.int64)
    return packed


def unpack_segments(packed: dict[str, Any], version_offset: int = 0) -> list[Segment]:
    """Inverse of :func:`pack_segments`; ``version_offset`` is added to every step's policy version."""
    if packed.get("kind") != PACK_KIND:
        raise PackError(f"not a packed segment list (kind {packed.get('kind')!r})")
    count = int(packed["count"])
    if count == 0:
        return []
    ragged: dict[str, list[Tensor]] = {}
    for name, count_key in _RAGGED.items():
        sizes = packed[count_key].tolist()
        if len(sizes) != count or sum(sizes) != len(packed[name]):
            raise PackError(f"packed segments: `{name}` has {len(packed[name])} rows, its counts {sizes}")
        ragged[name] = list(torch.split(packed[name], sizes))
    segments = []
    for i in range(count):
        fields = {name: packed[name][i].clone() for name in _STACKED}
        fields["versions"] = fields["versions"] + version_offset
        fields.update({name: rows[i].clone() for name, rows in ragged.items()})
        segments.append(Segment(sample_id=int(packed["sample_id"][i]), group_id=int(packed["group_id"][i]), **fields))
    return segments


_STACKED = ("obs", "actions", "logprobs", "rewards", "terminated", "truncated", "versions", "next_obs")
_RAGGED = {"final_obs": "final_obs_counts", "episode_returns": "episode_counts", "episode_lengths": "episode_counts"}
