"""From a validated run spec and a resource group to a plan: the spec's predicted speed in every mode.

The prediction is the capacity model's (``capacity/``, docs/capacity.md): a discrete-event simulation of
the pipeline on the costs of one device. Which costs a group's devices have is a calibration
(:mod:`capacity.calibration`): the one ``settings.TANDEM_CAPACITY_CALIBRATIONS`` names for the group's
device kind (a shipped name or a JSON file), or, for an accelerator kind with none, costs derived from
the hardware preset that matches the group's ``device_model`` and the spec's model shape
(:func:`capacity.hardware.costs_for`). Every plan says which, and that it is an estimate.

The simulation's cost grows with the samples it simulates, so a plan spends at most
:data:`SIMULATION_BUDGET` simulated samples over all its modes (fewer steps per mode, then fewer async
lags, then none: a spec too large is answered "not simulated" rather than slowly), and each
simulation is cached by its exact inputs (the same spec planned twice simulates once).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db.models import Count

from capacity import Config, Costs, InputError, LengthDistribution, ModelError, Result, simulate
from capacity.calibration import Calibration, load, shipped
from capacity.checks import Problems
from capacity.hardware import PRESETS, Accelerator, ModelShape, costs_for
from capacity.lengths import MAX_TOKENS
from capacity.spec_mapping import NotModelled, map_spec
from rlplatform.models import Host, ResourceGroup

ESTIMATE_NOTE = "An estimate: a simulation of the pipeline (docs/capacity.md), not a measurement."
SIMULATION_BUDGET = 48_000
"""Samples one plan may simulate over all its modes and steps: about a second on the project's 2-core
machine, where a simulation costs about 20-25 us per sample (measured over 64-8192 samples a step)."""
GYM_REASON = "the capacity model simulates an LLM workload's token generation; a gym workload is not modelled"
MAX_SIM_STEPS = 8
MIN_SIM_STEPS = 3
WARMUP_STEPS = 1
DEFAULT_MAX_LAG = 3
MAX_PLANNED_LAG = 8
NEAR_BEST = 0.95
"""Modes within 5% of the fastest count as equally fast; of them the one on the fewest devices is recommended."""

# What a spec does not say but the model needs (the request's `inputs` override them; a plan shows them).
DEFAULT_PROMPT_TOKENS = 32
DEFAULT_RESPONSE_SIGMA = 0.5
DEFAULT_PROMPT_SIGMA = 0.5

_BYTES_PER_PARAM = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}


class Unplannable(Exception):
    """The plan cannot be simulated; the message says why (shown to the user, not an error status)."""


@dataclass(frozen=True)
class PlanInputs:
    """The model inputs a spec does not hold, with their defaults (a request may set each). Checked on
    construction: a value out of its physical range raises ``capacity.InputError`` naming ``inputs.<field>``."""

    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    response_tokens: float | None = None
    """Median response length; None: a quarter of ``rollout.max_new_tokens``."""
    response_sigma: float = DEFAULT_RESPONSE_SIGMA
    prompt_sigma: float = DEFAULT_PROMPT_SIGMA
    devices_per_node: int | None = None
    """None: the group's largest host."""
    max_lag: int = DEFAULT_MAX_LAG
    """Async modes are planned at max_policy_lag 1..max_lag (and the spec's own lag)."""
    costs: Costs | None = None
    """Costs given with the request: used instead of the group's calibration."""

    def __post_init__(self) -> None:
        p = Problems(prefix="inputs.")
        p.integer("prompt_tokens", self.prompt_tokens, low=1, high=MAX_TOKENS)
        if self.response_tokens is not None:
            p.number("response_tokens", self.response_tokens, low=0, high=MAX_TOKENS, low_open=True, unit=" tokens")
        p.number("response_sigma", self.response_sigma, low=0, high=5)
        p.number("prompt_sigma", self.prompt_sigma, low=0, high=5)
        if self.devices_per_node is not None:
            p.integer("devices_per_node", self.devices_per_node, low=1, high=1 << 16)
        p.integer("max_lag", self.max_lag, low=1, high=MAX_PLANNED_LAG)
        p.raise_if_any()

    @classmethod
    def from_request(cls, data: dict[str, Any]) -> PlanInputs:
        """Inputs from a request's ``inputs`` object; ``costs`` as ``capacity.Costs`` fields, each bad one named
        ``inputs.costs.<field>``."""
        values = {k: v for k, v in data.items() if v is not None}
        raw_costs = values.pop("costs", None)
        costs = None
        if raw_costs is not None:
            if not isinstance(raw_costs, dict):
                raise InputError([{"field": "inputs.costs", "message": "must be an object of capacity.Costs fields"}])
            try:
                costs = Costs.from_dict(raw_costs)
            except InputError as exc:
                p = Problems(prefix="inputs.costs.")
                p.extend(exc)
                p.raise_if_any()
            except TypeError as exc:
                raise InputError([{"field": "inputs.costs", "message": str(exc)}]) from None
        return cls(**values, costs=costs)

    def lengths(self, max_new_tokens: int) -> LengthDistribution:
        median = self.response_tokens if self.response_tokens is not None else max(1.0, max_new_tokens / 4)
        return LengthDistribution(
            median=min(median, max_new_tokens),
            max_new_tokens=max_new_tokens,
            sigma=self.response_sigma,
            prompt_sigma=self.prompt_sigma,
        )


@dataclass(frozen=True)
class CostSource:
    """The costs a plan simulates on, with where they come from."""

    calibration: Calibration
    kind: str
    """measured (a calibration file), derived (a hardware preset and the model's shape) or request."""

    def describe(self) -> dict[str, str]:
        c = self.calibration
        return {"name": c.name, "source": c.source, "kind": self.kind, "measured_at": c.measured_at, "notes": c.notes}


@dataclass
class Group:
    """What a plan needs of a resource group: its kind, device model and size."""

    id: int
    name: str
    kind: str
    device_model: str
    devices: int
    largest_host: int
    max_devices: int | None = None
    """The experiment's quota limit, when planning for an experiment."""

    @classmethod
    def of(cls, group: ResourceGroup, max_devices: int | None = None) -> Group:
        """One query: the devices of each of the group's hosts."""
        per_host = list(Host.objects.filter(group=group).annotate(n=Count("devices")).values_list("n", flat=True))
        return cls(
            group.pk, group.name, group.kind, group.device_model, sum(per_host), max(per_host or [1]), max_devices
        )

    @property
    def usable(self) -> int:
        return self.devices if self.max_devices is None else min(self.devices, self.max_devices)


@dataclass
class ModePlan:
    mode: str
    max_policy_lag: int | None
    as_submitted: bool
    devices: int
    fits: bool
    samples_per_s: float | None = None
    step_time_s: float | None = None
    run_time_s: float | None = None
    device_hours: float | None = None
    time_split: dict[str, float] = field(default_factory=dict)
    bottleneck: str | None = None
    mean_staleness: float | None = None
    problem: str = ""

    def as_dict(self) -> dict[str, Any]:
        """Plain data; a figure that is not finite (nothing measured) is None, as JSON has no infinity."""
        data = {k: _finite(v) if isinstance(v, float) else v for k, v in self.__dict__.items()}
        data["time_split"] = {k: v for k, v in self.time_split.items() if math.isfinite(v)}
        return data


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


# --- costs ----------------------------------------------------------------------------------------------


def _configured(kind: str) -> str | None:
    return dict(getattr(settings, "TANDEM_CAPACITY_CALIBRATIONS", {})).get(kind)


@lru_cache(maxsize=32)
def _read_calibration(ref: str, mtime: float) -> Calibration:
    # mtime in the key: a calibration file written again is read again
    return load(Path(ref)) if ref.endswith(".json") or "/" in ref else shipped(ref)


def _calibration_file(ref: str) -> Calibration:
    path = Path(ref)
    mtime = path.stat().st_mtime if path.is_file() else 0.0
    try:
        return _read_calibration(ref, mtime)
    except InputError as exc:
        raise Unplannable(f"calibration {ref!r} cannot be used: {exc}") from None


def _preset_for(group: Group) -> tuple[str, Accelerator, str]:
    """(preset name, preset, note) for an accelerator group, by its device model."""
    model = group.device_model.lower().replace(" ", "")
    for key, words in (("h200-sxm", ("h200",)), ("h100-sxm", ("h100",)), ("ascend-910b", ("910", "ascend"))):
        if any(w in model for w in words):
            return key, PRESETS[key], ""
    key = "ascend-910b" if group.kind == "npu" else "h100-sxm"
    return key, PRESETS[key], f"no preset matches device model {group.device_model!r}: assumed {key}"


def _shape_from_dims(name: str, dims: dict[str, Any], bytes_per_value: float) -> ModelShape:
    """Parameters and KV-cache bytes per token of a decoder-only transformer (Qwen2/Llama layout:
    q, k, v, o projections, a gated MLP of three matrices, two norms per layer; embeddings tied unless
    the config says otherwise)."""
    hidden, layers = int(dims["hidden_size"]), int(dims["num_hidden_layers"])
    heads = int(dims["num_attention_heads"])
    kv_heads = int(dims.get("num_key_value_heads") or heads)
    head_dim = int(dims.get("head_dim") or hidden // heads)
    vocab = int(dims["vocab_size"])
    per_layer = (
        2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * int(dims["intermediate_size"])
    )
    embeddings = vocab * hidden * (1 if dims.get("tie_word_embeddings", True) else 2)
    params = layers * (per_layer + 2 * hidden) + embeddings + hidden
    return ModelShape(name, float(params), 2 * layers * kv_heads * head_dim * bytes_per_value)


# runtime/models/configs.py's built-in architectures with the char tokenizer's 100 symbols
# (tests/platform/test_plan_api.py checks they agree).
BUILTIN_DIMS: dict[str, dict[str, Any]] = {
    "tiny-qwen2": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=384, vocab_size=100),
    "tiny-llama": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=384, vocab_size=100),
    "small-qwen2": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                        intermediate_size=768, vocab_size=100),
    "medium-qwen2": dict(hidden_size=384, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2,
                         intermediate_size=1024, vocab_size=100),
}  # fmt: skip


def model_shape(spec: dict[str, Any]) -> ModelShape:
    """The spec's model as the hardware derivation needs it: a built-in's dims, or a model directory's
    ``config.json`` (a path the submit checks already confined to what the team may read)."""
    model = spec.get("model") or {}
    bytes_per_value = _BYTES_PER_PARAM.get(model.get("dtype", "float32"), 4.0)
    if model.get("path"):
        config = Path(model["path"]) / "config.json"
        try:
            dims = json.loads(config.read_text())
            return _shape_from_dims(Path(model["path"]).name, dims, bytes_per_value)
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
            raise Unplannable(f"model.path: the model's shape cannot be read from {config}: {exc}") from None
    name = model.get("builtin") or "tiny-qwen2"
    return _shape_from_dims(name, BUILTIN_DIMS[name], bytes_per_value)


def cost_source(group: Group, spec: dict[str, Any], inputs: PlanInputs) -> CostSource:
    """The costs the plan of ``spec`` on ``group`` simulates on (see the module's docstring)."""
    if inputs.costs is not None:
        calibration = Calibration("request", "costs given in the request", inputs.costs)
        return CostSource(calibration, "request")
    configured = _configured(group.kind)
    if configured:
        return CostSource(_calibration_file(configured), "measured")
    if group.kind == "cpu":
        raise Unplannable(
            "no calibration is configured for cpu devices (settings.TANDEM_CAPACITY_CALIBRATIONS): "
            "there is nothing to predict from"
        )
    key, hardware, note = _preset_for(group)
    shape = model_shape(spec)
    lengths = inputs.lengths(int((spec.get("rollout") or {}).get("max_new_tokens", 32)))
    context = inputs.prompt_tokens + lengths.median / 2  # a sequence's mean context while it decodes
    bytes_per_param = _BYTES_PER_PARAM.get((spec.get("model") or {}).get("dtype", "float32"), 4.0)
    costs = costs_for(
        hardware,
        shape,
        context_tokens=context,
        bytes_per_param=bytes_per_param,
        gradient_bytes_per_param=bytes_per_param,
    )
    source = (
        f"derived from {hardware.name} published figures and {shape.name} ({shape.params:.3g} parameters) by "
        f"capacity.hardware.costs_for with its assumed efficiencies; {hardware.source}"
    )
    slug = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in shape.name.lower())[:40] or "model"
    return CostSource(Calibration(f"{key}.{slug}", source, costs, notes=note), "derived")


# --- simulation --------------------------------------------------------------------------------------------


@lru_cache(maxsize=1024)
def _simulate(config: Config, costs: Costs) -> Result:
    """One simulation, cached by its exact inputs (both frozen, hashable dataclasses)."""
    return simulate(config, costs)


def _variants(max_lag: int, own_lag: int | None) -> list[tuple[str, int | None]]:
    lags = sorted({*range(1, max_lag + 1), *([own_lag] if own_lag is not None else [])})
    return [("sync", None), ("colocated", None), *(("async", lag) for lag in lags)]


def _budgeted(
    base: Config, variants: list[tuple[str, int | None]], own_lag: int | None = None
) -> tuple[list[tuple[str, int | None]], int]:
    """The variants to simulate and the steps each simulates, within :data:`SIMULATION_BUDGET`: fewer steps
    first, then the async lags beyond 1 and the spec's own."""
    per_step = max(1, base.samples_per_step)
    steps = min(MAX_SIM_STEPS, SIMULATION_BUDGET // (len(variants) * per_step))
    while steps < MIN_SIM_STEPS:
        extra = [v for v in variants if v[0] == "async" and v[1] not in (1, own_lag)]
        if not extra:
            break
        variants = [v for v in variants if v != extra[-1]]
        steps = min(MAX_SIM_STEPS, SIMULATION_BUDGET // (len(variants) * per_step))
    if steps < MIN_SIM_STEPS:
        raise Unplannable(
            f"{per_step} samples per step is more than the planner simulates within its budget "
            f"({SIMULATION_BUDGET} simulated samples over {len(variants)} modes)"
        )
    return variants, steps


def _base_config(spec: dict[str, Any], group: Group, inputs: PlanInputs) -> Config:
    """The spec as a sync configuration (valid whatever the spec's own mode: one engine on the trainer's
    first device), the other modes derived from it by :func:`_config_for`."""
    lock_step = {
        **spec,
        "pipeline": {**(spec.get("pipeline") or {}), "mode": "sync"},
        "resources": {**(spec.get("resources") or {}), "rollout_workers": 1, "remote_rollout_workers": 0},
    }
    max_new = int((spec.get("rollout") or {}).get("max_new_tokens", 32))
    try:
        config, _ = Config.from_spec(
            lock_step,
            prompt_tokens=inputs.prompt_tokens,
            lengths=inputs.lengths(max_new),
            devices_per_node=inputs.devices_per_node or group.largest_host,
            sim_steps=MAX_SIM_STEPS,
            warmup_steps=WARMUP_STEPS,
        )
    except (InputError, TypeError) as exc:
        raise Unplannable(f"the model cannot represent this spec with these inputs: {exc}") from None
    return config


def _config_for(base: Config, spec: dict[str, Any], mode: str, lag: int | None) -> Config:
    if mode != "async":
        return base.with_(mode=mode)
    resources, rollout = spec.get("resources") or {}, spec.get("rollout") or {}
    return base.with_(
        mode="async",
        max_policy_lag=lag,
        rollout_instances=max(1, int(resources.get("rollout_workers", 1))),
        remote_rollout_instances=int(resources.get("remote_rollout_workers", 0)),
        dispatch="fifo" if rollout.get("length_prediction") == "off" else "longest_first",
    )


def _predict(config: Config, costs: Costs, group: Group, *, as_submitted: bool) -> ModePlan:
    lag = config.max_policy_lag if config.mode == "async" else None
    row = ModePlan(config.mode, lag, as_submitted, config.devices, config.devices <= group.usable)
    if not row.fits:
        row.problem = f"needs {config.devices} devices; {group.usable} are available to this experiment in {group.name}"
    try:
        result = _simulate(config, costs)
    except (ModelError, InputError, ValueError) as exc:
        row.problem = f"the model cannot simulate this mode: {exc}"
        return row
    row.samples_per_s = result.samples_per_s
    row.step_time_s = result.step_time_s
    row.run_time_s = result.run_time_s
    row.device_hours = config.devices * result.run_time_s / 3600
    row.time_split = dict(result.time_split)
    row.bottleneck = str(result.bottleneck)
    row.mean_staleness = result.mean_staleness
    return row


def recommend(rows: list[ModePlan]) -> dict[str, Any] | None:
    """Among the modes that fit, those within 5% of the fastest count as equally fast (the model's own
    error is larger); of them the one on the fewest devices, then with the freshest samples (smallest lag)."""
    usable = [r for r in rows if r.fits and r.samples_per_s and not r.problem]
    if not usable:
        return None
    best = max(r.samples_per_s or 0.0 for r in usable)
    near = [r for r in usable if (r.samples_per_s or 0.0) >= NEAR_BEST * best]
    pick = min(near, key=lambda r: (r.devices, r.max_policy_lag or 0))
    why = (
        f"{pick.samples_per_s:.3g} samples/s on {pick.devices} devices, within 5% of the fastest mode that fits "
        f"({best:.3g} samples/s) on the fewest devices"
    )
    return {"mode": pick.mode, "max_policy_lag": pick.max_policy_lag, "bottleneck": pick.bottleneck, "why": why}


def _own_mode(spec: dict[str, Any]) -> tuple[str, int | None]:
    pipeline = spec.get("pipeline") or {}
    mode = pipeline.get("mode", "sync")
    return mode, int(pipeline.get("max_policy_lag", 1)) if mode == "async" else None


def _not_modelled(items: list[NotModelled]) -> list[dict[str, str]]:
    return [{"field": n.field, "reason": n.reason} for n in items]


def plan(spec: dict[str, Any], group: Group, inputs: PlanInputs | None = None) -> dict[str, Any]:
    """The plan of a resolved spec (``RunSpec.resolved()``) on ``group``: see docs/control-plane-api.md.

    Raises ``capacity.InputError`` (field-named) for bad ``inputs``; anything the model cannot plan is
    answered in the plan (``modelled: false`` and its ``reason``), never raised.
    """
    inputs = inputs or PlanInputs()
    mapping = map_spec(spec)
    answer: dict[str, Any] = {
        "estimate": True,
        "note": ESTIMATE_NOTE,
        "modelled": True,
        "reason": "",
        "group": {"id": group.id, "name": group.name, "kind": group.kind, "devices": group.devices},
        "calibration": None,
        "inputs": {},
        "modes": [],
        "recommended": None,
        "not_modelled": _not_modelled(mapping.not_modelled),
    }
    if spec.get("workload", "llm") != "llm":
        answer.update(modelled=False, reason=f"workload {spec.get('workload')!r}: {GYM_REASON}")
        return answer
    own_mode, own_lag = _own_mode(spec)
    try:
        base = _base_config(spec, group, inputs)
        source = cost_source(group, spec, inputs)
        variants, steps = _budgeted(base, _variants(inputs.max_lag, own_lag), own_lag)
    except Unplannable as exc:
        answer.update(modelled=False, reason=str(exc))
        return answer
    costs = source.calibration.costs
    answer["calibration"] = source.describe()
    answer["note"] = f"{ESTIMATE_NOTE} Costs: calibration {source.calibration.name} ({source.kind})."
    answer["inputs"] = {
        "prompt_tokens": base.prompt_tokens,
        "response_tokens": base.lengths.median,
        "response_sigma": base.lengths.sigma,
        "prompt_sigma": base.lengths.prompt_sigma,
        "devices_per_node": base.devices_per_node,
        "sim_steps": steps,
        "warmup_steps": WARMUP_STEPS,
    }
    base = base.with_(sim_steps=steps)
    rows = []
    for mode, lag in variants:
        as_submitted = (mode, lag) == (own_mode, own_lag)
        try:
            config = _config_for(base, spec, mode, lag)
        except InputError as exc:
            rows.append(ModePlan(mode, lag, as_submitted, 0, False, problem=f"not a valid {mode} run: {exc}"))
            continue
        rows.append(_predict(config, costs, group, as_submitted=as_submitted))
    answer["modes"] = [r.as_dict() for r in rows]
    answer["recommended"] = recommend(rows)
    return answer


def step_time(spec: dict[str, Any], group: Group) -> tuple[float, CostSource]:
    """The predicted step time of ``spec`` in its own mode (default inputs), for queue estimates; raises
    :class:`Unplannable` with the reason when there is none."""
    if spec.get("workload", "llm") != "llm":
        raise Unplannable(GYM_REASON)
    inputs = PlanInputs()
    mode, lag = _own_mode(spec)
    base = _base_config(spec, group, inputs)
    source = cost_source(group, spec, inputs)
    _, steps = _budgeted(base, [(mode, lag)])
    try:
        result = _simulate(_config_for(base.with_(sim_steps=steps), spec, mode, lag), source.calibration.costs)
    except (InputError, ModelError, ValueError) as exc:
        raise Unplannable(f"the model cannot simulate this run: {exc}") from None
    return result.step_time_s, source
