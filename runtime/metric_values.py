"""Metric values and event payloads as plain JSON data, and the error a reporter raises.

Every reporter uses these: :mod:`runtime.metrics` (progress, JSONL, fan-out), the platform's HTTP reporter
and the experiment trackers (:mod:`runtime.trackers`), which import them from here so that they need not
import :mod:`runtime.metrics`, which builds them. Standard library only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any


class ReporterError(Exception):
    """A reporter cannot be built or used as asked (missing package, bad path, bad value)."""


def clean_metrics(metrics: Mapping[str, Any]) -> dict[str, float | int | None]:
    """Metric values as plain JSON numbers: ints stay ints, tensors / numpy scalars become floats,
    NaN and infinities become None (JSON has no spelling for them)."""
    out: dict[str, float | int | None] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise ReporterError(f"metric name {key!r} is not a string")
        if isinstance(value, bool):
            out[key] = int(value)
        elif isinstance(value, int):
            out[key] = value
        else:
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise ReporterError(f"metric {key!r}: {value!r} is not a number") from None
            out[key] = number if math.isfinite(number) else None
    return out


def plain_json(payload: Mapping[str, Any]) -> dict[str, Any]:
    """An event payload as strict JSON data: odd objects (paths, …) become strings, NaN and
    infinities become None."""

    def finite(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: finite(v) for k, v in value.items()}
        if isinstance(value, list):
            return [finite(v) for v in value]
        return value

    return finite(json.loads(json.dumps(dict(payload), default=str)))
