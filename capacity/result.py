"""What a simulation answers: throughput, step time, where the step's time goes, and the bottleneck.

The bottleneck is a value chosen by one pure function (:func:`bottleneck_of`) from the time split,
so the rule is read and tested in one place.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

# Where the trainer's step time goes, in seconds per step (the keys of Result.time_split).
GENERATE = "generate"  # lock-step modes: generating on the trainer's devices
TRAIN = "train"  # forward, backward and optimizer compute
ALLREDUCE = "allreduce"  # gradient (or sharded parameter) collectives
WEIGHT_SYNC = "weight_sync"  # publishing the new weights, as far as the trainer waits for it
SWITCH = "switch"  # colocated: switching between generation and training, optimizer offload/reload
TRANSFER = "transfer"  # taking the batch from the sample queue and scattering it to the ranks
WAIT = "wait"  # async: waiting for enough fresh samples (the trainer's bubble)
SPLIT_KEYS = (GENERATE, TRAIN, ALLREDUCE, WEIGHT_SYNC, SWITCH, TRANSFER, WAIT)

# Where a rollout engine's time goes, in seconds per step (the keys of Result.rollout_split).
ROLLOUT_GENERATE = "generate"  # computing engine steps
ROLLOUT_LOAD = "load_weights"  # loading a new weight version
ROLLOUT_AWAIT = "await_weights"  # holding work back (throttle) for a version staged but not yet delivered
ROLLOUT_IDLE = "idle"  # the rest: no work, or work held for weights not yet trained
ROLLOUT_KEYS = (ROLLOUT_GENERATE, ROLLOUT_LOAD, ROLLOUT_AWAIT, ROLLOUT_IDLE)


class Bottleneck(StrEnum):
    """What limits the step time."""

    GENERATION = "generation"
    TRAINING = "training"
    ALLREDUCE = "allreduce"
    WEIGHT_SYNC = "weight_sync"
    SWITCH = "switch"
    TRANSFER = "transfer"


_OWNER = {
    GENERATE: Bottleneck.GENERATION,
    WAIT: Bottleneck.GENERATION,  # the trainer waits for samples: generation cannot keep up
    TRAIN: Bottleneck.TRAINING,
    ALLREDUCE: Bottleneck.ALLREDUCE,
    WEIGHT_SYNC: Bottleneck.WEIGHT_SYNC,
    SWITCH: Bottleneck.SWITCH,
    TRANSFER: Bottleneck.TRANSFER,
}


def bottleneck_of(time_split: dict[str, float], rollout_split: dict[str, float] | None = None) -> Bottleneck:
    """The part of the step that takes longest, generation counting both generating in lock-step and
    the trainer's waiting for samples in async (ties go to the earlier in :data:`SPLIT_KEYS`).

    When the trainer waits for samples but the rollout engines spend more time receiving and loading
    weights than generating (``rollout_split``), weight delivery is what starves it."""
    totals: dict[Bottleneck, float] = {}
    for key in SPLIT_KEYS:
        owner = _OWNER[key]
        totals[owner] = totals.get(owner, 0.0) + time_split.get(key, 0.0)
    worst = max(totals, key=lambda b: totals[b])
    if worst is Bottleneck.GENERATION and rollout_split is not None:
        weights = rollout_split.get(ROLLOUT_LOAD, 0.0) + rollout_split.get(ROLLOUT_AWAIT, 0.0)
        if weights > rollout_split.get(ROLLOUT_GENERATE, 0.0):
            return Bottleneck.WEIGHT_SYNC
    return worst


@dataclass(frozen=True)
class Result:
    """Steady-state figures of one simulated configuration (the warm-up steps left out)."""

    samples_per_s: float
    """Samples trained on per second."""
    tokens_per_s: float
    """Response tokens trained on per second."""
    step_time_s: float
    """Mean seconds between the ends of consecutive training steps."""
    time_split: dict[str, float]
    """Mean seconds per step of each part of the trainer's step (SPLIT_KEYS); they sum to the step time."""
    rollout_split: dict[str, float]
    """Mean seconds per step of one rollout engine's time (ROLLOUT_KEYS); they sum to the step time."""
    mean_staleness: float
    """Mean (trainer version - sample version) over the samples trained on."""
    max_staleness: int
    dropped_samples: int
    """Samples discarded or regenerated for staleness over the measured steps."""
    bottleneck: Bottleneck
    run_time_s: float
    """Estimated time of the run's steps (``run_steps`` x step time; start-up and evaluation left out)."""
    steps_measured: int

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["bottleneck"] = str(self.bottleneck)
        return data
