"""The costs the planner's tests plan on: a CPU-like device, written to a calibration file by each test
module (the tests never depend on the calibrations the project ships)."""

from __future__ import annotations

from pathlib import Path

from capacity import Costs, Link
from capacity.calibration import Calibration

TEST_COSTS = Costs(
    decode_s_per_token=2e-4,
    prefill_s_per_token=2e-5,
    train_s_per_token=4e-4,
    weight_bytes=2e6,
    local=Link(5e9),
    intra_node=Link(5e9, 1e-5),
    inter_node=Link(1e8, 1e-4),
    decode_step_s=1e-3,
    optimizer_step_s=1e-3,
)


def write_calibration(directory: Path, name: str, source: str) -> Path:
    """A calibration file of :data:`TEST_COSTS` named ``name``; returns its path."""
    path = directory / f"{name}.json"
    Calibration(name, source, TEST_COSTS).save(path)
    return path
