"""Segments pack to plain tensors that torch.load(weights_only=True) reads, and unpack to the same segments."""

from __future__ import annotations

import io

import pytest
import torch

from runtime.sample_queue import PackError
from runtime.workloads.gym.segments import Segment, pack_segments, unpack_segments
from tests.runtime.workloads.gym.helpers import make_segment


def through_disk(packed: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(packed, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def assert_equal_segments(a: Segment, b: Segment, version_offset: int = 0) -> None:
    assert (a.sample_id, a.group_id) == (b.sample_id, b.group_id)
    for name in ("obs", "actions", "logprobs", "rewards", "terminated", "truncated", "next_obs", "final_obs"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(a.episode_returns, b.episode_returns) and torch.equal(a.episode_lengths, b.episode_lengths)
    assert torch.equal(a.versions + version_offset, b.versions)


@pytest.mark.parametrize("box", [False, True])
def test_pack_unpack_round_trip_through_a_weights_only_load(box):
    segments = [make_segment(i, box=box, seed=i) for i in range(4)]  # 0, 1, 2 and 0 finished episodes
    restored = unpack_segments(through_disk(pack_segments(segments)))
    assert len(restored) == 4
    for a, b in zip(segments, restored, strict=True):
        assert_equal_segments(a, b)


def test_version_offset_shifts_every_step_version():
    segments = [make_segment(1), make_segment(2)]
    restored = unpack_segments(pack_segments(segments), version_offset=10)
    for a, b in zip(segments, restored, strict=True):
        assert_equal_segments(a, b, version_offset=10)
    assert [s.version for s in restored] == [15, 15]


def test_an_empty_list_round_trips():
    assert unpack_segments(through_disk(pack_segments([]))) == []


def test_segments_of_different_shapes_do_not_pack():
    with pytest.raises(PackError, match="differs"):
        pack_segments([make_segment(0, t=3), make_segment(1, t=2)])


def test_a_foreign_or_inconsistent_pack_does_not_unpack():
    with pytest.raises(PackError, match="not a packed segment list"):
        unpack_segments({"kind": "samples"})
    packed = pack_segments([make_segment(1), make_segment(2)])
    packed["episode_counts"] = torch.tensor([1, 1])  # the returns hold 1 + 2 rows
    with pytest.raises(PackError, match="episode_returns"):
        unpack_segments(packed)


def test_a_segment_checks_its_shapes():
    good = make_segment(0)
    with pytest.raises(PackError, match="final_obs must be"):
        Segment(**{**vars(good), "final_obs": torch.zeros(1, 2)})  # two episodes ended, one final observation
    with pytest.raises(PackError, match="rewards must be"):
        Segment(**{**vars(good), "rewards": torch.zeros(3, 3)})


def test_next_observations_take_the_final_observation_where_an_episode_ended():
    seg = make_segment(0)
    following = seg.next_observations()
    assert torch.equal(following[0, 0], seg.obs[1, 0])
    assert torch.equal(following[0, 1], seg.final_obs[0])  # terminated at (0, 1): first in row-major order
    assert torch.equal(following[1, 0], seg.final_obs[1])  # truncated at (1, 0)
    assert torch.equal(following[2], seg.next_obs)
    assert seg.num_steps == 6
