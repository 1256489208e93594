"""The replay buffer: keeps the newest transitions, samples reproducibly, and its state round-trips."""

from __future__ import annotations

import io

import pytest
import torch

from runtime.workloads.gym.replay import ReplayBuffer, Transitions
from tests.runtime.workloads.gym.helpers import make_segment


def transitions(start: int, n: int) -> Transitions:
    ids = torch.arange(start, start + n, dtype=torch.float32)
    return Transitions(
        obs=ids.unsqueeze(1).repeat(1, 2),
        actions=ids.long() % 3,
        rewards=ids,
        next_obs=(ids + 0.5).unsqueeze(1).repeat(1, 2),
        terminated=ids.long() % 2 == 0,
    )


def test_the_ring_keeps_the_newest_capacity_transitions():
    buffer = ReplayBuffer(capacity=5, obs_dim=2, seed=0)
    buffer.add(transitions(0, 3))
    buffer.add(transitions(3, 4))  # wraps: 0 and 1 are overwritten
    assert len(buffer) == 5
    assert sorted(buffer.storage["rewards"].tolist()) == [2.0, 3.0, 4.0, 5.0, 6.0]
    buffer.add(transitions(7, 12))  # more than fits at once: only the newest five
    assert sorted(buffer.storage["rewards"].tolist()) == [14.0, 15.0, 16.0, 17.0, 18.0]


def test_a_segment_adds_every_step_with_its_true_next_observation():
    seg = make_segment(0)
    buffer = ReplayBuffer(capacity=10, obs_dim=2, seed=0)
    buffer.add_segment(seg)
    assert len(buffer) == 6
    assert torch.equal(buffer.storage["obs"][:6], seg.obs.reshape(6, 2))
    assert torch.equal(buffer.storage["next_obs"][:6], seg.next_observations().reshape(6, 2))
    assert buffer.storage["terminated"][:6].tolist() == seg.terminated.reshape(-1).tolist()


def test_same_seed_same_batches():
    a, b = ReplayBuffer(100, 2, seed=3), ReplayBuffer(100, 2, seed=3)
    for buffer in (a, b):
        buffer.add(transitions(0, 50))
    for _ in range(3):
        assert torch.equal(a.sample(8).rewards, b.sample(8).rewards)
    other = ReplayBuffer(100, 2, seed=4)
    other.add(transitions(0, 50))
    assert not torch.equal(other.sample(8).rewards, a.sample(8).rewards)


def test_state_round_trips_through_a_weights_only_load_and_samples_continue_alike():
    original = ReplayBuffer(capacity=20, obs_dim=2, seed=1)
    original.add(transitions(0, 25))
    original.sample(4)
    data = io.BytesIO()
    torch.save(original.state_dict(), data)
    data.seek(0)
    restored = ReplayBuffer(capacity=20, obs_dim=2, seed=99)
    restored.load_state_dict(torch.load(data, weights_only=True))
    assert (restored.position, len(restored)) == (original.position, len(original))
    for name, values in original.storage.items():
        assert torch.equal(restored.storage[name], values), name
    for _ in range(3):
        x, y = original.sample(6), restored.sample(6)
        assert torch.equal(x.obs, y.obs) and torch.equal(x.actions, y.actions)
    original.add(transitions(100, 3))
    restored.add(transitions(100, 3))
    assert torch.equal(original.storage["rewards"], restored.storage["rewards"])


def test_a_partly_filled_buffer_round_trips_and_a_different_capacity_is_refused():
    original = ReplayBuffer(capacity=20, obs_dim=2, seed=1)
    original.add(transitions(0, 7))
    restored = ReplayBuffer(capacity=20, obs_dim=2, seed=1)
    restored.load_state_dict(original.state_dict())
    assert torch.equal(restored.sample(5).rewards, original.sample(5).rewards)
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(capacity=21, obs_dim=2, seed=1).load_state_dict(original.state_dict())


def test_an_empty_buffer_cannot_be_sampled():
    with pytest.raises(ValueError, match="empty"):
        ReplayBuffer(4, 2, seed=0).sample(1)
