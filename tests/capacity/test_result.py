"""The bottleneck rule, as a table."""

from __future__ import annotations

import pytest

from capacity import Bottleneck
from capacity.result import bottleneck_of

ROLLOUT_GENERATING = {"generate": 5.0, "load_weights": 0.1, "await_weights": 0.2, "idle": 1.0}
ROLLOUT_STARVED = {"generate": 1.0, "load_weights": 0.1, "await_weights": 3.0, "idle": 1.0}


@pytest.mark.parametrize(
    "split, rollout, expected",
    [
        ({"generate": 3.0, "train": 2.0}, None, Bottleneck.GENERATION),
        ({"generate": 1.0, "train": 2.0}, None, Bottleneck.TRAINING),
        ({"train": 2.0, "allreduce": 3.0}, None, Bottleneck.ALLREDUCE),
        ({"train": 1.0, "weight_sync": 1.5}, None, Bottleneck.WEIGHT_SYNC),
        ({"train": 1.0, "switch": 1.5}, None, Bottleneck.SWITCH),
        ({"train": 1.0, "transfer": 1.5}, None, Bottleneck.TRANSFER),
        ({"wait": 2.0, "train": 1.0}, ROLLOUT_GENERATING, Bottleneck.GENERATION),  # async: waits for samples
        ({"wait": 2.0, "train": 1.0}, ROLLOUT_STARVED, Bottleneck.WEIGHT_SYNC),  # ... that wait for weights
        ({"wait": 0.5, "train": 1.0}, ROLLOUT_STARVED, Bottleneck.TRAINING),
        ({"generate": 1.0, "wait": 1.0, "train": 1.5}, None, Bottleneck.GENERATION),  # both count as generation
        ({"generate": 1.0, "train": 1.0}, None, Bottleneck.GENERATION),  # a tie: the earlier part
    ],
)
def test_the_bottleneck_is_the_longest_part_of_the_step(split, rollout, expected):
    assert bottleneck_of(split, rollout) is expected
