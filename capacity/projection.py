"""The scaling projection (issue 17): samples/s and scaling efficiency from one device to four
supernodes, for each mode, model size and comm-domain choice, as rows of data.

``bench/capacity_projection.py`` runs :func:`sweep` and plots the rows; docs/scaling.md reads them.
Every figure is a prediction of the model (:func:`capacity.simulate`) on costs derived from published
hardware figures (:mod:`capacity.hardware`), never a measurement.

Method:

* **Weak scaling**: a step's prompts grow with the devices, ``prompts_per_device x devices``, so each
  device has the same work at every scale (StaleSync's scaling figures are weak scaling: the global
  batch grows with the cluster).
* **Device split** (:func:`device_split`): sync and colocated use every device as a trainer rank that
  also holds an engine (the runtime's lock-step placement); async gives
  ``clamp(round(N * s), 1, N - 1)`` of its ``N`` devices to training and the rest to rollout
  instances, ``s`` the share of training devices that the model predicts the most samples/s for at
  64 devices (:func:`balanced_share`), kept at every scale.
* **Scaling efficiency** (:func:`with_efficiency`): samples/s per device relative to the smallest
  configuration of the same series, ``e(N) = (X(N) / N) / (X(N0) / N0)``: ``N0`` is 1 device for
  sync and colocated and 2 for async (one trainer rank, one rollout instance). Under weak scaling
  perfect scaling is 1.0. StaleSync's figures are from 1 to 4 supernodes:
  :func:`efficiency_between` gives that ratio for any two device counts.
* **Training** is sharded (ZeRO-3 / FSDP2, the runtime's FSDP2 path) for both sizes: replicated Adam
  state of a 7B model (16 bytes per parameter, 122 GB) would not fit one 128 GB device beside its
  activations. Device memory is otherwise not modelled, except the engine's KV-cache budget
  (:func:`capacity.hardware.kv_cache_tokens`), which sets ``max_batch_tokens``.
* **Colocated switch** (ASSUMPTION): one copy of the weights in device memory each way (the engine's
  layout out of the trainer's), ``weight_bytes / local bandwidth``; no optimizer offload.

Standard library, numpy and the capacity model only (no matplotlib, no torch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Any

import numpy as np

from capacity.checks import InputError
from capacity.config import Config
from capacity.costs import Costs
from capacity.hardware import (
    PRESETS,
    QWEN25_7B,
    QWEN25_32B,
    SUPERNODES,
    Accelerator,
    ModelShape,
    costs_for,
    kv_cache_tokens,
)
from capacity.lengths import LengthDistribution
from capacity.model import simulate

HARDWARE: dict[str, Accelerator] = {**PRESETS, **SUPERNODES}
MODELS: dict[str, ModelShape] = {"7b": QWEN25_7B, "32b": QWEN25_32B}
SUPERNODE = "ascend-910c-supernode"
SUPERNODE_SIZE = SUPERNODES[SUPERNODE].devices_per_node
DEVICE_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, SUPERNODE_SIZE, 2 * SUPERNODE_SIZE, 4 * SUPERNODE_SIZE)
"""From one device to four supernodes."""
LOCK_STEP_PUBLICATION = "local"
"""What the rows of sync and colocated name as their publication: engines on the trainer's devices."""


def _reasoning_lengths() -> LengthDistribution:
    return LengthDistribution(median=1024, max_new_tokens=4096, sigma=0.6, prompt_sigma=0.5)


@dataclass(frozen=True)
class Workload:
    """One device's share of a step and the run's shape (ASSUMPTIONS: a GRPO-style reasoning run)."""

    prompts_per_device: int = 4
    """Prompts per device per step; the step's prompts are this times the devices (weak scaling)."""
    group_size: int = 8
    prompt_tokens: int = 512
    lengths: LengthDistribution = field(default_factory=_reasoning_lengths)
    """Long-tailed responses: median 1,024 tokens, about 4% cut at 4,096."""
    max_policy_lag: int = 1
    max_batch_size: int = 256
    """An engine's continuous-batching slots (vLLM's default ``max_num_seqs``)."""
    seed: int = 0

    def length_moments(self, groups: int = 4096) -> tuple[float, float]:
        """(mean response tokens, mean context a decoded token attends to), from the seeded sample.

        The context of a response's ``k``-th token is ``prompt + k``; averaged over every decoded token
        it is ``prompt + E[L^2] / (2 E[L])`` (token-weighted, so long answers count more)."""
        lengths = np.array(self.lengths.sample(self.seed, groups, self.group_size), dtype=float).ravel()
        mean = float(lengths.mean())
        return mean, self.prompt_tokens + float((lengths**2).mean()) / (2 * mean)


@dataclass(frozen=True)
class Point:
    """One configuration of the sweep."""

    hardware: str
    """A key of :data:`HARDWARE`."""
    model: str
    """A key of :data:`MODELS`."""
    mode: str
    devices: int
    shared_comm_domain: bool = False
    weight_publication: str = "hierarchical"
    """Async only; sync and colocated copy the weights on their own devices."""

    @property
    def series(self) -> tuple[str, str, str, bool, str]:
        """What a scaling curve holds fixed while the devices change."""
        return (self.hardware, self.model, self.mode, self.shared_comm_domain, self.weight_publication)


@dataclass(frozen=True)
class Grid:
    """The sweep's axes; :meth:`points` leaves out what cannot run (async on one device, a model whose
    weights do not fit the device) and varies comm domain and publication for async only (lock-step
    modes send nothing over the sampling side's links)."""

    hardware: tuple[str, ...] = (SUPERNODE,)
    models: tuple[str, ...] = ("7b", "32b")
    modes: tuple[str, ...] = ("sync", "async", "colocated")
    devices: tuple[int, ...] = DEVICE_COUNTS
    shared_comm_domain: tuple[bool, ...] = (False,)
    weight_publications: tuple[str, ...] = ("hierarchical",)

    def points(self) -> list[Point]:
        out: list[Point] = []
        for hw in self.hardware:
            for model in self.models:
                if not fits(HARDWARE[hw], MODELS[model]):
                    continue
                for mode in self.modes:
                    lock_step = mode != "async"
                    variants = (
                        [(False, LOCK_STEP_PUBLICATION)]
                        if lock_step
                        else [(s, p) for s in self.shared_comm_domain for p in self.weight_publications]
                    )
                    for shared, publication in variants:
                        for n in self.devices:
                            if lock_step or n >= 2:
                                out.append(Point(hw, model, mode, n, shared, publication))
        return out


@dataclass(frozen=True)
class Row:
    """One point's prediction."""

    hardware: str
    model: str
    mode: str
    comm: str
    """``shared`` or ``isolated`` comm domain."""
    publication: str
    devices: int
    supernodes: float
    """Devices / the hardware's ``devices_per_node`` (a supernode for a supernode preset)."""
    trainer_ranks: int
    rollout_instances: int
    prompts_per_step: int
    samples_per_s: float
    samples_per_s_per_device: float
    step_time_s: float
    time_split: dict[str, float]
    """The trainer's step (generate, train, allreduce, weight_sync, switch, transfer, wait), seconds."""
    rollout_split: dict[str, float]
    """One engine's step (generate, load_weights, await_weights, idle), seconds."""
    bottleneck: str
    mean_staleness: float
    efficiency: float = math.nan
    """Filled by :func:`with_efficiency`."""

    @property
    def series(self) -> tuple[str, str, str, bool, str]:
        return (self.hardware, self.model, self.mode, self.comm == "shared", self.publication)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def fits(hw: Accelerator, model: ModelShape) -> bool:
    """Whether ``model``'s weights leave room for a KV cache on one ``hw`` device."""
    try:
        return kv_cache_tokens(hw, model) > 0
    except InputError:
        return False


def device_split(mode: str, devices: int, train_share: float) -> tuple[int, int]:
    """(trainer ranks, rollout instances) for ``devices``.

    sync, colocated: every device trains and holds an engine, ``(N, N)``. async: ``T = round(N * s)``
    clamped to ``[1, N - 1]`` trainer ranks, ``N - T`` rollout instances."""
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    if not 0.0 <= train_share <= 1.0:
        raise ValueError(f"train_share must be in [0, 1], got {train_share}")
    if mode != "async":
        return devices, devices
    if devices < 2:
        raise ValueError("async needs at least 2 devices: one trainer rank and one rollout instance")
    trainers = min(max(round(devices * train_share), 1), devices - 1)
    return trainers, devices - trainers


SPLIT_SHARES = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
"""Training shares of an async split the search tries."""
SPLIT_REFERENCE_DEVICES = 64


@lru_cache(maxsize=64)
def balanced_share(
    hardware: str,
    model: str,
    workload: Workload,
    *,
    reference_devices: int = SPLIT_REFERENCE_DEVICES,
    sim_steps: int = 5,
    warmup_steps: int = 2,
) -> float:
    """The async split's training share: of :data:`SPLIT_SHARES`, the one whose split of
    ``reference_devices`` the model predicts the most samples/s for (ties to the smaller share),
    with isolated comm domains and hierarchical publication. The same share then serves every scale.

    A closed form (training's share of one sample's device-seconds at full engine batches) gives too
    few devices to generation: under ``max_policy_lag`` an engine has only the next steps' groups to
    batch, and the long tail leaves its batch part empty, so the search asks the simulation."""
    best, best_rate = SPLIT_SHARES[0], -1.0
    for share in SPLIT_SHARES:
        point = Point(hardware, model, "async", reference_devices)
        config = config_for(point, workload, share, sim_steps=sim_steps, warmup_steps=warmup_steps)
        rate = simulate(config, costs_of(hardware, model, workload)).samples_per_s
        if rate > best_rate:
            best, best_rate = share, rate
    return best


@lru_cache(maxsize=64)
def costs_of(hardware: str, model: str, workload: Workload) -> Costs:
    """The costs of ``model`` on one ``hardware`` device for ``workload``'s contexts, with the
    colocated switch of the module docstring."""
    hw, shape = HARDWARE[hardware], MODELS[model]
    _, context = workload.length_moments()
    costs = costs_for(hw, shape, context_tokens=context)
    return replace(costs, colocated_switch_s=costs.local.time_s(costs.weight_bytes))


def config_for(point: Point, workload: Workload, train_share: float, *, sim_steps: int, warmup_steps: int) -> Config:
    """The simulated configuration of ``point``, async splitting its devices by ``train_share``."""
    hw, shape = HARDWARE[point.hardware], MODELS[point.model]
    batch_tokens = kv_cache_tokens(hw, shape)
    trainers, instances = device_split(point.mode, point.devices, train_share)
    lock_step = point.mode != "async"
    return Config(
        mode=point.mode,
        prompts_per_step=workload.prompts_per_device * point.devices,
        group_size=workload.group_size,
        prompt_tokens=workload.prompt_tokens,
        lengths=workload.lengths,
        max_policy_lag=workload.max_policy_lag,
        rollout_instances=instances,
        trainer_ranks=trainers,
        max_batch_size=workload.max_batch_size,
        max_batch_tokens=batch_tokens,
        training="sharded",
        devices_per_node=hw.devices_per_node,
        weight_publication="unicast" if lock_step else point.weight_publication,
        shared_comm_domain=point.shared_comm_domain,
        sim_steps=sim_steps,
        warmup_steps=warmup_steps,
        seed=workload.seed,
    )


def run_point(
    point: Point,
    workload: Workload,
    *,
    sim_steps: int = 5,
    warmup_steps: int = 2,
    reference_devices: int = SPLIT_REFERENCE_DEVICES,
) -> Row:
    """Simulate one point; its efficiency is left to :func:`with_efficiency`."""
    share = (
        balanced_share(point.hardware, point.model, workload, reference_devices=reference_devices)
        if point.mode == "async"
        else 1.0
    )
    config = config_for(point, workload, share, sim_steps=sim_steps, warmup_steps=warmup_steps)
    result = simulate(config, costs_of(point.hardware, point.model, workload))
    return Row(
        hardware=point.hardware,
        model=point.model,
        mode=point.mode,
        comm="shared" if point.shared_comm_domain else "isolated",
        publication=point.weight_publication,
        devices=point.devices,
        supernodes=point.devices / HARDWARE[point.hardware].devices_per_node,
        trainer_ranks=config.trainer_ranks,
        rollout_instances=config.rollout_instances,
        prompts_per_step=config.prompts_per_step,
        samples_per_s=result.samples_per_s,
        samples_per_s_per_device=result.samples_per_s / point.devices,
        step_time_s=result.step_time_s,
        time_split=dict(result.time_split),
        rollout_split=dict(result.rollout_split),
        bottleneck=str(result.bottleneck),
        mean_staleness=result.mean_staleness,
    )


def with_efficiency(rows: Iterable[Row]) -> list[Row]:
    """Each row with its scaling efficiency: samples/s per device over that of the smallest device
    count of its series."""
    rows = list(rows)
    base: dict[tuple[str, str, str, bool, str], Row] = {}
    for row in rows:
        if row.series not in base or row.devices < base[row.series].devices:
            base[row.series] = row
    return [
        replace(row, efficiency=row.samples_per_s_per_device / base[row.series].samples_per_s_per_device)
        for row in rows
    ]


def efficiency_between(rows: Iterable[Row], series: tuple[str, str, str, bool, str], low: int, high: int) -> float:
    """Samples/s per device at ``high`` devices over that at ``low`` devices, in one series (StaleSync's
    "1 to 4 supernodes" is ``low = 384, high = 1536``)."""
    found = {row.devices: row for row in rows if row.series == series}
    for n in (low, high):
        if n not in found:
            raise KeyError(f"no row with {n} devices in series {series}")
    return found[high].samples_per_s_per_device / found[low].samples_per_s_per_device


def sweep(
    grid: Grid,
    workload: Workload | None = None,
    *,
    sim_steps: int = 5,
    warmup_steps: int = 2,
    reference_devices: int = SPLIT_REFERENCE_DEVICES,
    on_row: Callable[[Row], None] | None = None,
) -> list[Row]:
    """Every point of ``grid`` simulated, with efficiencies (``on_row`` sees each row as it is done)."""
    workload = workload or Workload()
    rows = []
    for point in grid.points():
        row = run_point(
            point, workload, sim_steps=sim_steps, warmup_steps=warmup_steps, reference_devices=reference_devices
        )
        if on_row is not None:
            on_row(row)
        rows.append(row)
    return with_efficiency(rows)
