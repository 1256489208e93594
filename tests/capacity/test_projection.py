"""The scaling projection: its device split, its efficiency definition and its rows on a tiny grid."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from capacity import LengthDistribution
from capacity.projection import (
    SPLIT_SHARES,
    SUPERNODE,
    Grid,
    Point,
    Row,
    Workload,
    balanced_share,
    device_split,
    efficiency_between,
    sweep,
    with_efficiency,
)

ROOT = Path(__file__).resolve().parents[2]

# One prompt of 2 short answers per device: the simulations take milliseconds.
TINY = Workload(
    prompts_per_device=1,
    group_size=2,
    prompt_tokens=8,
    lengths=LengthDistribution(median=16, max_new_tokens=32, sigma=0.5),
    max_batch_size=8,
)


@pytest.mark.parametrize("mode", ["sync", "colocated"])
def test_lock_step_modes_train_and_generate_on_every_device(mode):
    assert device_split(mode, 1, 0.6) == (1, 1)
    assert device_split(mode, 384, 0.6) == (384, 384)


def test_async_splits_by_the_training_share_keeping_one_device_each_side():
    assert device_split("async", 2, 0.6) == (1, 1)
    assert device_split("async", 10, 0.6) == (6, 4)
    assert device_split("async", 64, 0.6) == (38, 26)  # round(38.4)
    assert device_split("async", 1536, 0.5) == (768, 768)
    assert device_split("async", 4, 0.99) == (3, 1)  # round(3.96) = 4 leaves no rollout device
    assert device_split("async", 4, 0.0) == (1, 3)


def test_async_on_one_device_is_refused():
    with pytest.raises(ValueError, match="at least 2 devices"):
        device_split("async", 1, 0.5)


def _row(mode: str, devices: int, samples_per_s: float) -> Row:
    return Row(
        hardware="h",
        model="7b",
        mode=mode,
        comm="isolated",
        publication="local",
        devices=devices,
        supernodes=devices / 4,
        trainer_ranks=devices,
        rollout_instances=devices,
        prompts_per_step=devices,
        samples_per_s=samples_per_s,
        samples_per_s_per_device=samples_per_s / devices,
        step_time_s=1.0,
        time_split={},
        rollout_split={},
        bottleneck="generation",
        mean_staleness=0.0,
    )


def test_efficiency_is_samples_per_device_over_that_of_the_smallest_size_of_the_series():
    rows = [_row("sync", 4, 6.0), _row("sync", 1, 2.0), _row("sync", 16, 24.0), _row("async", 2, 3.0)]

    got = {(r.mode, r.devices): r.efficiency for r in with_efficiency(rows)}

    # sync: 2.0 samples/s per device on 1 device; 6.0 / 4 = 1.5 on 4; 24 / 16 = 1.5 on 16
    assert got == {("sync", 1): 1.0, ("sync", 4): 0.75, ("sync", 16): 0.75, ("async", 2): 1.0}
    assert efficiency_between(rows, rows[0].series, 4, 16) == 1.0
    with pytest.raises(KeyError, match="no row with 8 devices"):
        efficiency_between(rows, rows[0].series, 4, 8)


def test_the_grid_leaves_out_async_on_one_device_and_varies_comm_for_async_only():
    grid = Grid(
        models=("7b",),
        modes=("sync", "async"),
        devices=(1, 2),
        shared_comm_domain=(False, True),
        weight_publications=("unicast",),
    )

    points = grid.points()

    assert points == [
        Point(SUPERNODE, "7b", "sync", 1, False, "local"),
        Point(SUPERNODE, "7b", "sync", 2, False, "local"),
        Point(SUPERNODE, "7b", "async", 2, False, "unicast"),
        Point(SUPERNODE, "7b", "async", 2, True, "unicast"),
    ]


def test_a_model_that_does_not_fit_the_device_is_left_out():
    grid = Grid(hardware=("ascend-910b",), models=("7b", "32b"), modes=("sync",), devices=(1,))

    assert [p.model for p in grid.points()] == ["7b"]  # 65 GB of 32B weights in a 64 GB 910B


def test_the_sweep_of_a_tiny_grid_gives_one_consistent_row_per_point():
    grid = Grid(models=("7b",), devices=(1, 2, 4))

    rows = sweep(grid, TINY, sim_steps=4, warmup_steps=1, reference_devices=4)

    assert [(r.mode, r.devices) for r in rows] == [
        ("sync", 1),
        ("sync", 2),
        ("sync", 4),
        ("async", 2),
        ("async", 4),
        ("colocated", 1),
        ("colocated", 2),
        ("colocated", 4),
    ]
    share = balanced_share(SUPERNODE, "7b", TINY, reference_devices=4)
    assert share in SPLIT_SHARES
    for r in rows:
        assert r.prompts_per_step == r.devices
        assert r.samples_per_s_per_device == r.samples_per_s / r.devices
        assert sum(r.time_split.values()) == pytest.approx(r.step_time_s, rel=1e-9)
        if r.mode == "async":
            assert (r.trainer_ranks, r.rollout_instances) == device_split("async", r.devices, share)
        else:
            assert (r.trainer_ranks, r.rollout_instances, r.publication) == (r.devices, r.devices, "local")
        assert r.supernodes == r.devices / 384
        assert math.isfinite(r.efficiency) and r.efficiency > 0
    assert [r.efficiency for r in rows if r.devices == min(x.devices for x in rows if x.mode == r.mode)] == [1.0] * 3


def test_isolated_comm_domains_are_never_slower_than_a_shared_one_under_the_same_load():
    """8-NPU servers: once the trainer ranks span servers (13 of 64 devices, 26 of 128 at this
    workload's 0.2 training share) their all-reduce and the weights' publication cross the same
    inter-node link when the domain is shared."""
    grid = Grid(
        hardware=("ascend-910b",),
        models=("7b",),
        modes=("async",),
        devices=(2, 64, 128),
        shared_comm_domain=(False, True),
        weight_publications=("unicast", "hierarchical"),
    )

    rows = sweep(grid, TINY, sim_steps=4, warmup_steps=1, reference_devices=16)

    by = {(r.publication, r.comm, r.devices): r for r in rows}
    assert len(by) == len(rows) == 12
    assert [by["unicast", "isolated", n].trainer_ranks for n in (2, 64, 128)] == [1, 13, 26]
    for publication in ("unicast", "hierarchical"):
        for n in (2, 64, 128):
            isolated, shared = by[publication, "isolated", n], by[publication, "shared", n]
            assert isolated.samples_per_s >= shared.samples_per_s
            assert isolated.time_split["allreduce"] <= shared.time_split["allreduce"]
        for n in (64, 128):  # sharing does cost once the ranks span servers
            isolated, shared = by[publication, "isolated", n], by[publication, "shared", n]
            assert shared.time_split["allreduce"] > isolated.time_split["allreduce"]


def test_the_projection_imports_neither_matplotlib_nor_torch():
    code = "import sys, capacity.projection; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = {name.split(".")[0] for name in out.stdout.split()}
    assert not loaded & {"matplotlib", "torch", "django"}
