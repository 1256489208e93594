"""The resolved spec as a tracker's run parameters: flat dotted keys with text values."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

TRUNCATED = "…[{n} more characters]"


def flat_params(resolved: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"trainer": {"lr": 0.001}}`` -> ``{"trainer.lr": "0.001"}``: nested mappings become dotted keys;
    every other value is its JSON text (lists, true / false, null), strings as they are."""
    out: dict[str, str] = {}
    for key, value in resolved.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, f"{path}."))
        else:
            out[path] = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return out


def clipped(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, saying how much was cut (a tracker that refuses longer
    values would otherwise refuse the whole batch of parameters)."""
    if len(text) <= limit:
        return text
    keep = max(0, limit - len(TRUNCATED.format(n=len(text))))  # the longest the marker can be
    return (text[:keep] + TRUNCATED.format(n=len(text) - keep))[:limit]
