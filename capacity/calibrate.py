"""Fitting the model's costs from measurements of real runs, and mapping the measured runs to configurations.

Pure functions over plain records (no torch, no runtime import): ``bench/capacity_calibration.py``
measures, this module fits. Every cost of :class:`~capacity.costs.Costs` is linear in what it
multiplies (see ``costs.py``), so each is an ordinary least-squares fit of measured seconds on
measured quantities, with non-negative coefficients (Lawson and Hanson, *Solving Least Squares
Problems*, 1974, chapter 23: with three unknowns the active set is found by trying every subset):

* engine step seconds on (1, sequences decoded, prompt tokens prefilled): ``decode_step_s``,
  ``decode_s_per_token``, ``prefill_s_per_token`` (:func:`fit_engine`);
* train seconds per update on (tokens per update, 1): ``train_s_per_token``, ``optimizer_step_s``
  (:func:`fit_train`; when the steps' token counts barely differ the fixed part cannot be told from
  the per-token part, and the fit goes through the origin — said in its note);
* copy seconds on (1, bytes): a :class:`~capacity.costs.Link`'s ``latency_s`` and
  ``1 / bandwidth_bytes_per_s`` (:func:`fit_link`);
* a generator's work per sample outside engine steps (scoring, decoding text) is added to the
  admission cost (``prefill_s_per_token``): the model charges nothing else per sample.

A record that cannot be a measurement (negative seconds, a count that is not an integer) raises
:class:`~capacity.checks.InputError` naming it (``engine_steps[3].seconds``).

:class:`EmpiricalLengths` replays measured response lengths group by group, and :func:`bench_config`
maps one of ``bench/pipeline.py``'s runs to a :class:`~capacity.config.Config` over them.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from capacity.checks import InputError, Problems
from capacity.config import Config
from capacity.costs import Costs, Link
from capacity.lengths import LengthDistribution

MIN_TOKEN_SPREAD = 0.2
"""Smallest relative spread (max / min - 1) of tokens per update that separates optimizer_step_s."""


# ---------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class EngineStep:
    """One measured engine step: ``decoded`` sequences each made a token, ``prefill_tokens`` were prefilled."""

    decoded: int
    prefill_tokens: int
    seconds: float


@dataclass(frozen=True)
class TrainStep:
    """One measured training step: ``tokens`` trained (prompt + response, every sample) in ``updates``."""

    tokens: float
    seconds: float
    updates: int = 1


@dataclass(frozen=True)
class Copy:
    """``nbytes`` moved in ``seconds`` (a weight staging, a shared-memory copy, a socket transfer)."""

    nbytes: float
    seconds: float


@dataclass(frozen=True)
class Fit:
    """How well one least-squares fit explains its points."""

    name: str
    coefficients: dict[str, float]
    points: int
    rms_s: float
    """Root-mean-square residual, seconds."""
    relative_rms: float
    """``rms_s`` over the mean measured seconds."""
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "coefficients": dict(self.coefficients),
            "points": self.points,
            "rms_s": self.rms_s,
            "relative_rms": self.relative_rms,
            "note": self.note,
        }


@dataclass(frozen=True)
class Measurements:
    """What one device (one process with its threads) was measured doing, and its host's links."""

    engine_steps: Sequence[EngineStep]
    train_steps: Sequence[TrainStep]
    weight_bytes: float
    staging: Sequence[Copy]
    """Copies of one weight version: the runtime's ``time/weight_sync`` (into the engine, or into shared memory)."""
    intra_node: Sequence[Copy]
    """Copies between processes of the host (shared memory)."""
    inter_node: Sequence[Copy]
    """Transfers over the host's network stack (loopback TCP on one machine)."""
    queue_takes_s: Sequence[float] = ()
    """Seconds of sample-queue takes that found their batch waiting (async ``time/wait`` at its least)."""
    sample_bytes_per_token: float = 16.0
    colocated_switch_s: Sequence[float] = ()
    """Measured seconds of one switch between generation and training (colocated)."""
    sample_overhead_s: float = 0.0
    """Seconds a generator spends on each sample outside engine steps (decoding its text, scoring it,
    building the sample). The model has no term of its own for it: it is charged to the sample's
    admission, as ``sample_overhead_s / prompt_tokens`` more ``prefill_s_per_token``."""
    prompt_tokens: float = 1.0
    """Mean prompt tokens of the measured workload (spreads ``sample_overhead_s`` over a prompt)."""


@dataclass(frozen=True)
class Calibrated:
    """Fitted costs and the fits behind them."""

    costs: Costs
    fits: list[Fit] = field(default_factory=list)

    def diagnostics(self) -> list[dict[str, Any]]:
        return [f.as_dict() for f in self.fits]


# ---------------------------------------------------------------------------------------- checks


def _check_records(problems: Problems, name: str, records: Sequence[Any], *, at_least: int = 1) -> None:
    if len(records) < at_least:
        problems.add(name, f"needs at least {at_least} record(s), got {len(records)}")
    for i, record in enumerate(records):
        at = f"{name}[{i}]."
        for key, value in vars(record).items():
            if key in ("decoded", "prefill_tokens", "updates"):
                low = 1 if key == "updates" else 0
                problems.integer(at + key, value, low=low, high=1 << 40)
            else:
                problems.number(at + key, value, low=0, high=1e15)


def _check_measurements(m: Measurements) -> None:
    p = Problems()
    _check_records(p, "engine_steps", m.engine_steps, at_least=3)
    _check_records(p, "train_steps", m.train_steps)
    _check_records(p, "staging", m.staging)
    _check_records(p, "intra_node", m.intra_node)
    _check_records(p, "inter_node", m.inter_node)
    p.number("weight_bytes", m.weight_bytes, low=0, high=1e14, low_open=True, unit=" B")
    p.number("sample_bytes_per_token", m.sample_bytes_per_token, low=0, high=1e6, low_open=True, unit=" B")
    for i, s in enumerate(m.queue_takes_s):
        p.number(f"queue_takes_s[{i}]", s, low=0, high=1e4, unit=" s")
    p.number("sample_overhead_s", m.sample_overhead_s, low=0, high=1e4, unit=" s")
    p.number("prompt_tokens", m.prompt_tokens, low=0, high=1 << 20, low_open=True)
    for i, s in enumerate(m.colocated_switch_s):
        p.number(f"colocated_switch_s[{i}]", s, low=0, high=1e4, unit=" s")
    p.raise_if_any()
    if all(r.seconds == 0 for r in m.engine_steps):
        raise InputError([{"field": "engine_steps", "message": "every step took 0 s: nothing to fit"}])
    if all(r.tokens == 0 for r in m.train_steps):
        raise InputError([{"field": "train_steps", "message": "no step trained a token: nothing to fit"}])


# ---------------------------------------------------------------------------------------- fits


def nonnegative_least_squares(columns: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``x >= 0`` minimising ``|columns @ x - y|``: the best unconstrained fit over every subset of
    columns whose coefficients all come out non-negative (exact for the few columns used here)."""
    n = columns.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for size in range(n, 0, -1):
        for subset in itertools.combinations(range(n), size):
            sub = columns[:, subset]
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(coef < 0):
                continue
            x = np.zeros(n)
            x[list(subset)] = coef
            residual = float(np.sum((columns @ x - y) ** 2))
            if best is None or residual < best[0] - 1e-18:
                best = (residual, x)
    return best[1] if best is not None else np.zeros(n)


def _fit(name: str, names: list[str], columns: np.ndarray, y: np.ndarray, note: str = "") -> tuple[np.ndarray, Fit]:
    x = nonnegative_least_squares(columns, y)
    rms = math.sqrt(float(np.mean((columns @ x - y) ** 2)))
    mean = float(np.mean(y))
    fit = Fit(
        name, dict(zip(names, (float(v) for v in x), strict=True)), len(y), rms, rms / mean if mean else 0.0, note
    )
    return x, fit


def fit_engine(steps: Sequence[EngineStep]) -> tuple[dict[str, float], Fit]:
    """``decode_step_s``, ``decode_s_per_token``, ``prefill_s_per_token`` from measured engine steps."""
    names = ["decode_step_s", "decode_s_per_token", "prefill_s_per_token"]
    columns = np.array([[1.0, s.decoded, s.prefill_tokens] for s in steps])
    y = np.array([s.seconds for s in steps])
    x, fit = _fit("engine step", names, columns, y)
    if x[1] <= 0:  # Costs needs a positive marginal cost: a flat fit means the batch never changed
        raise InputError([{"field": "engine_steps", "message": "step time does not grow with the batch: vary it"}])
    return dict(zip(names, (float(v) for v in x), strict=True)), fit


def fit_train(steps: Sequence[TrainStep], min_spread: float = MIN_TOKEN_SPREAD) -> tuple[dict[str, float], Fit]:
    """``train_s_per_token`` and ``optimizer_step_s`` from measured training steps (per update)."""
    per_update = np.array([s.tokens / s.updates for s in steps])
    y = np.array([s.seconds / s.updates for s in steps])
    low = float(per_update.min())
    spread = float(per_update.max()) / low - 1 if low > 0 else math.inf
    if spread < min_spread:
        note = (
            f"tokens per update varied by {spread:.1%} (< {min_spread:.0%}): the fixed part is not separable, "
            "fitted through the origin (optimizer_step_s = 0)"
        )
        x, fit = _fit("train step", ["train_s_per_token"], per_update[:, None], y, note)
        values = {"train_s_per_token": float(x[0]), "optimizer_step_s": 0.0}
        return values, Fit(fit.name, values, fit.points, fit.rms_s, fit.relative_rms, note)
    x, fit = _fit(
        "train step", ["train_s_per_token", "optimizer_step_s"], np.stack([per_update, np.ones_like(y)], 1), y
    )
    return {"train_s_per_token": float(x[0]), "optimizer_step_s": float(x[1])}, fit


def fit_link(name: str, copies: Sequence[Copy]) -> tuple[Link, Fit]:
    """A link's latency and bandwidth from measured copies; one size of copy gives the bandwidth alone."""
    nbytes = np.array([c.nbytes for c in copies])
    y = np.array([c.seconds for c in copies])
    if float(nbytes.max()) == float(nbytes.min()):
        x, fit = _fit(name, ["s_per_byte"], nbytes[:, None], y, "one copy size: latency taken as 0")
        s_per_byte, latency = float(x[0]), 0.0
    else:
        x, fit = _fit(name, ["latency_s", "s_per_byte"], np.stack([np.ones_like(y), nbytes], 1), y)
        latency, s_per_byte = float(x[0]), float(x[1])
    if s_per_byte <= 0:
        raise InputError([{"field": name, "message": "copy time does not grow with the bytes: copy more"}])
    return Link(bandwidth_bytes_per_s=1.0 / s_per_byte, latency_s=latency), fit


def fit_costs(m: Measurements) -> Calibrated:
    """Every cost of one device from its measurements (checked first: a bad record is named)."""
    _check_measurements(m)
    engine, engine_fit = fit_engine(m.engine_steps)
    train, train_fit = fit_train(m.train_steps)
    local, local_fit = fit_link("staging", m.staging)
    intra, intra_fit = fit_link("intra_node", m.intra_node)
    inter, inter_fit = fit_link("inter_node", m.inter_node)
    queue_op_s = min(m.queue_takes_s) if m.queue_takes_s else 0.0
    switch_s = statistics.median(m.colocated_switch_s) if m.colocated_switch_s else 0.0
    engine["prefill_s_per_token"] += m.sample_overhead_s / m.prompt_tokens
    costs = Costs(
        **engine,
        **train,
        weight_bytes=float(m.weight_bytes),
        local=local,
        intra_node=intra,
        inter_node=inter,
        sample_bytes_per_token=float(m.sample_bytes_per_token),
        queue_op_s=float(queue_op_s),
        colocated_switch_s=float(switch_s),
    )
    return Calibrated(costs, [engine_fit, train_fit, local_fit, intra_fit, inter_fit])


# ---------------------------------------------------------------------------------------- lengths


@dataclass(frozen=True)
class EmpiricalLengths(LengthDistribution):
    """Measured response lengths replayed: each prompt draws one measured group whole (a prompt's
    answers resemble each other), or, for another group size, that many measured lengths."""

    groups: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        p = Problems()
        if not self.groups or not all(self.groups):
            p.add("groups", "needs at least one non-empty group of measured lengths")
        for i, group in enumerate(self.groups):
            for j, length in enumerate(group):
                p.integer(f"groups[{i}][{j}]", length, low=1, high=self.max_new_tokens)
        p.raise_if_any()

    def group(self, rng: np.random.Generator, size: int) -> list[int]:
        drawn = self.groups[int(rng.integers(len(self.groups)))]
        if len(drawn) == size:
            return list(drawn)
        flat = [x for g in self.groups for x in g]
        return [int(flat[i]) for i in rng.integers(len(flat), size=size)]

    @property
    def mean(self) -> float:
        return statistics.fmean(x for g in self.groups for x in g)


def empirical_lengths(groups: Sequence[Sequence[int]], max_new_tokens: int) -> EmpiricalLengths:
    """The measured groups' lengths (each list one prompt's samples), as a length distribution."""
    frozen = tuple(tuple(int(x) for x in g) for g in groups)
    flat = [x for g in frozen for x in g] or [1]
    return EmpiricalLengths(median=float(statistics.median(flat)), max_new_tokens=max_new_tokens, groups=frozen)


# ---------------------------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class BenchRun:
    """One run of ``bench/pipeline.py``'s kind, in its own knobs."""

    name: str
    mode: str
    """The runtime's ``pipeline.mode``: sync, async, colocated."""
    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    steps: int
    warmup_steps: int
    rollout_instances: int = 1
    max_policy_lag: int = 1
    on_lag_exceeded: str = "throttle"
    max_batch_size: int = 64
    max_batch_tokens: int = 16384
    queue_capacity: int | None = None
    length_prediction: str = "from_stats"


def bench_config(
    run: BenchRun,
    lengths: LengthDistribution,
    prompt_tokens: int,
    host_cores: int | None = None,
    host_background: float = 0.0,
    seed: int = 0,
) -> Config:
    """The configuration ``run`` is, for the model: its mode and knobs, the measured lengths and prompt
    tokens, one trainer rank, its rollout instances (async: each a process of its own; sync and
    colocated: the one engine in the trainer's process), simulated over the run's own steps and
    warm-up so both measure the same window. ``host_cores``: the async processes (one thread each)
    share a host of this many cores, with ``host_background`` cores' worth of other work computing
    meanwhile; sync and colocated run one process on all the cores, which the model does not share."""
    if lengths.max_new_tokens != run.max_new_tokens:
        raise InputError(
            [
                {
                    "field": "lengths.max_new_tokens",
                    "message": f"{lengths.max_new_tokens} is not the run's {run.max_new_tokens}",
                }
            ]
        )
    return Config(
        mode=run.mode,
        prompts_per_step=run.prompts_per_step,
        group_size=run.group_size,
        prompt_tokens=prompt_tokens,
        lengths=lengths,
        max_policy_lag=run.max_policy_lag,
        on_lag_exceeded=run.on_lag_exceeded,
        queue_capacity=run.queue_capacity,
        rollout_instances=run.rollout_instances if run.mode == "async" else 1,
        max_batch_size=run.max_batch_size,
        max_batch_tokens=run.max_batch_tokens,
        dispatch="longest_first" if run.length_prediction == "from_stats" else "fifo",
        trainer_ranks=1,
        host_cores=host_cores if run.mode == "async" else None,
        host_background=host_background if run.mode == "async" and host_cores is not None else 0.0,
        run_steps=run.steps,
        sim_steps=run.steps,
        warmup_steps=run.warmup_steps,
        seed=seed,
    )


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured."""
    if measured <= 0:
        raise InputError([{"field": "measured", "message": f"must be > 0, got {measured!r}"}])
    return (predicted - measured) / measured
