"""The measured costs the pipeline model runs on: per-token compute, bytes to move, and links.

Every figure is per device (one accelerator, or one CPU process on this machine) and in seconds,
bytes and bytes per second. They are meant to come from measurement (a calibration command fits
them from a run's own metrics) or from published hardware figures (:mod:`capacity.hardware`), never
from guesses inside the model.

The engine-step cost is linear in its parameters, ``decode_step_s + decode_s_per_token * live
sequences + prefill_s_per_token * prompt tokens admitted``, and a training step's compute is
``train_s_per_token * tokens + optimizer_step_s`` per update, so a calibration can fit them by least
squares from measured (batch size, step time) and (tokens, train time) pairs.

Construction validates: a value outside its physical range raises :class:`~capacity.checks.InputError`
naming the field (``intra_node.bandwidth_bytes_per_s`` for a link's field when built with
:meth:`Costs.from_dict`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from capacity.checks import InputError, Problems

# Physical ceilings, generous on purpose: a value above them is a unit mistake, not a fast machine.
MAX_BANDWIDTH = 1e14  # bytes/s: 100 TB/s, above any device memory or link today (HBM3e is ~5-8 TB/s)
MAX_LATENCY_S = 10.0
MAX_TOKEN_S = 10.0  # seconds per token: slower than any engine that could finish a run
MAX_FIXED_S = 1e4
MAX_BYTES = 1e14  # 50 T parameters in bf16


@dataclass(frozen=True)
class Link:
    """A point-to-point link as the alpha-beta model sees it: ``latency_s + bytes / bandwidth``."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        problems = Problems()
        problems.number(
            "bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, low=0, high=MAX_BANDWIDTH, low_open=True, unit=" B/s"
        )
        problems.number("latency_s", self.latency_s, low=0, high=MAX_LATENCY_S, unit=" s")
        problems.raise_if_any()

    def time_s(self, nbytes: float) -> float:
        """One message of ``nbytes`` over this link."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class Costs:
    """What one device's work and one link's transfer cost."""

    decode_s_per_token: float
    """Marginal seconds of one engine step per live sequence (its token's compute and KV-cache reads)."""
    prefill_s_per_token: float
    """Seconds per prompt token prefilled when a request is admitted."""
    train_s_per_token: float
    """Seconds per trained token (prompt + response) on one rank: forward and backward, and the
    old-log-prob and reference forwards the algorithm needs."""
    weight_bytes: float
    """Bytes of one published weight version."""
    local: Link
    """Copies within one device or host: staging a weight version, an engine loading it."""
    intra_node: Link
    """One device's link to the others of its node (HCCS, NVLink; shared memory on a CPU host)."""
    inter_node: Link
    """One device's link to other nodes (RoCE, InfiniBand; TCP between CPU hosts)."""
    decode_step_s: float = 0.0
    """Fixed seconds of one engine step whatever its batch (reading the weights once: memory-bound)."""
    optimizer_step_s: float = 0.0
    """Seconds of one optimizer update on one rank holding the whole optimizer state."""
    gradient_bytes: float | None = None
    """Bytes all-reduced per update; None: ``weight_bytes`` (gradients in the parameters' dtype)."""
    sample_bytes_per_token: float = 16.0
    """Bytes a sample carries through the queue per token (ids, log-probs, mask)."""
    queue_op_s: float = 0.0
    """Fixed seconds the sample queue spends on one request (a put or a take)."""
    optimizer_offload_s: float = 0.0
    """Colocated: seconds to move the optimizer state to host memory before generating."""
    optimizer_reload_s: float = 0.0
    """Colocated: seconds to bring it back before training."""
    colocated_switch_s: float = 0.0
    """Colocated: seconds of one switch between generation and training (each direction)."""

    def __post_init__(self) -> None:
        p = Problems()
        p.number("decode_s_per_token", self.decode_s_per_token, low=0, high=MAX_TOKEN_S, low_open=True, unit=" s")
        p.number("prefill_s_per_token", self.prefill_s_per_token, low=0, high=MAX_TOKEN_S, unit=" s")
        p.number("train_s_per_token", self.train_s_per_token, low=0, high=MAX_TOKEN_S, low_open=True, unit=" s")
        p.number("weight_bytes", self.weight_bytes, low=0, high=MAX_BYTES, low_open=True, unit=" B")
        p.number("decode_step_s", self.decode_step_s, low=0, high=MAX_FIXED_S, unit=" s")
        p.number("optimizer_step_s", self.optimizer_step_s, low=0, high=MAX_FIXED_S, unit=" s")
        if self.gradient_bytes is not None:
            p.number("gradient_bytes", self.gradient_bytes, low=0, high=MAX_BYTES, unit=" B")
        p.number("sample_bytes_per_token", self.sample_bytes_per_token, low=0, high=1e6, low_open=True, unit=" B")
        p.number("queue_op_s", self.queue_op_s, low=0, high=MAX_FIXED_S, unit=" s")
        p.number("optimizer_offload_s", self.optimizer_offload_s, low=0, high=MAX_FIXED_S, unit=" s")
        p.number("optimizer_reload_s", self.optimizer_reload_s, low=0, high=MAX_FIXED_S, unit=" s")
        p.number("colocated_switch_s", self.colocated_switch_s, low=0, high=MAX_FIXED_S, unit=" s")
        for name in ("local", "intra_node", "inter_node"):
            if not isinstance(getattr(self, name), Link):
                p.add(name, f"must be a Link, got {type(getattr(self, name)).__name__}")
        p.raise_if_any()

    @property
    def all_reduce_bytes(self) -> float:
        return self.weight_bytes if self.gradient_bytes is None else self.gradient_bytes

    def engine_step_s(self, live: int, prefill_tokens: int = 0) -> float:
        """One engine step: a token for each of ``live`` sequences, plus prefilling ``prefill_tokens``."""
        return self.decode_step_s + self.decode_s_per_token * live + self.prefill_s_per_token * prefill_tokens

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Costs:
        """Costs from plain data (JSON: a calibration file, an API body); every bad field named, links'
        fields as ``intra_node.bandwidth_bytes_per_s``."""
        problems = Problems()
        known = {f.name for f in fields(cls) if f.init}
        for key in sorted(set(data) - known):
            problems.add(key, "unknown field")
        kwargs: dict[str, Any] = {k: v for k, v in data.items() if k in known}
        for name in ("local", "intra_node", "inter_node"):
            raw = data.get(name)
            if raw is None:
                problems.add(name, "required")
                continue
            if isinstance(raw, Link):
                continue
            if not isinstance(raw, dict) or set(raw) - {"bandwidth_bytes_per_s", "latency_s"}:
                problems.add(name, "must be {bandwidth_bytes_per_s, latency_s}")
                continue
            try:
                kwargs[name] = Link(**raw)
            except InputError as exc:
                problems.extend(exc, prefix=f"{name}.")
            except TypeError as exc:
                problems.add(name, str(exc))
        for name in ("decode_s_per_token", "prefill_s_per_token", "train_s_per_token", "weight_bytes"):
            if name not in data:
                problems.add(name, "required")
        problems.raise_if_any()
        return cls(**kwargs)
