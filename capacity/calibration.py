"""A named set of costs and where it came from: what a prediction says it is based on.

A calibration is the :class:`~capacity.costs.Costs` one machine was measured at (or a hardware
preset was derived into), with its name, its source (the command that measured it, or the cited
figures) and when. Predictions carry the calibration's name and source so a user can tell an
estimate from this machine's measurements from one projected off a datasheet.

Stored as JSON (``capacity/calibrations/<name>.json`` for the ones the project ships)::

    {"name": "cpu-2core", "source": "python bench/capacity_calibration.py", "measured_at": "2026-12-01T23:40:00Z",
     "notes": "...", "costs": {...Costs.as_dict()...}, "variants": {"all-cores": {...}}}

``variants`` (optional) holds other devices measured on the same machine: ``cpu-2core``'s ``costs``
are one process with one thread (the split placement's device), its ``all-cores`` variant one
process with both threads (where ``bench/pipeline.py`` runs sync and colocated).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capacity.checks import InputError, Problems
from capacity.costs import Costs

SHIPPED_DIR = Path(__file__).resolve().parent / "calibrations"
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class Calibration:
    """Costs with their provenance."""

    name: str
    source: str
    """How the costs were obtained: a command that measured them, or the figures they derive from."""
    costs: Costs
    measured_at: str = ""
    """ISO 8601 time of the measurement; empty for costs derived from published figures."""
    notes: str = ""
    variants: dict[str, Costs] = field(default_factory=dict)
    """Other devices measured on the same machine, by name (e.g. one process using every core), for
    configurations that run on them; ``costs`` is the device a plan counts by default."""

    def __post_init__(self) -> None:
        problems = Problems()
        if not isinstance(self.name, str) or not NAME_PATTERN.match(self.name):
            problems.add("name", f"must match {NAME_PATTERN.pattern}, got {self.name!r}")
        if not isinstance(self.source, str) or not self.source.strip():
            problems.add("source", "must say how the costs were obtained")
        if not isinstance(self.costs, Costs):
            problems.add("costs", f"must be Costs, got {type(self.costs).__name__}")
        if not isinstance(self.variants, dict):
            problems.add("variants", f"must be a dict of name: Costs, got {type(self.variants).__name__}")
        else:
            for key, value in self.variants.items():
                if not isinstance(key, str) or not NAME_PATTERN.match(key):
                    problems.add("variants", f"name must match {NAME_PATTERN.pattern}, got {key!r}")
                elif not isinstance(value, Costs):
                    problems.add(f"variants.{key}", f"must be Costs, got {type(value).__name__}")
        problems.raise_if_any()

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "measured_at": self.measured_at,
            "notes": self.notes,
            "costs": self.costs.as_dict(),
            "variants": {key: value.as_dict() for key, value in sorted(self.variants.items())},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        """A calibration from plain data; a bad cost is named as ``costs.<field>``."""
        problems = Problems()
        if not isinstance(data, dict):
            raise InputError([{"field": "calibration", "message": "must be a JSON object"}])
        for key in sorted(set(data) - {"name", "source", "measured_at", "notes", "costs", "variants"}):
            problems.add(key, "unknown field")
        costs: Costs | None = None
        raw_costs = data.get("costs")
        if not isinstance(raw_costs, dict):
            problems.add("costs", "required, a JSON object of Costs fields")
        else:
            try:
                costs = Costs.from_dict(raw_costs)
            except InputError as exc:
                problems.extend(exc, prefix="costs.")
        variants: dict[str, Costs] = {}
        raw_variants = data.get("variants", {})
        if not isinstance(raw_variants, dict):
            problems.add("variants", "must be a JSON object of name: Costs fields")
        else:
            for key, raw in raw_variants.items():
                if not isinstance(raw, dict):
                    problems.add(f"variants.{key}", "must be a JSON object of Costs fields")
                    continue
                try:
                    variants[key] = Costs.from_dict(raw)
                except InputError as exc:
                    problems.extend(exc, prefix=f"variants.{key}.")
        problems.raise_if_any()
        assert costs is not None
        return cls(
            name=data.get("name", ""),
            source=data.get("source", ""),
            costs=costs,
            measured_at=str(data.get("measured_at", "")),
            notes=str(data.get("notes", "")),
            variants=variants,
        )

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_dict(), indent=2, sort_keys=True) + "\n")


def load(path: Path) -> Calibration:
    """Read one calibration file; an unreadable or invalid one raises :class:`InputError` naming it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InputError([{"field": "calibration", "message": f"cannot read {path}: {exc}"}]) from exc
    return Calibration.from_dict(data)


def shipped(name: str) -> Calibration:
    """One of the calibrations in ``capacity/calibrations/`` by name."""
    if not NAME_PATTERN.match(name):
        raise InputError([{"field": "calibration", "message": f"unknown calibration {name!r}"}])
    path = SHIPPED_DIR / f"{name}.json"
    if not path.is_file():
        raise InputError([{"field": "calibration", "message": f"unknown calibration {name!r}"}])
    return load(path)


def shipped_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.json"))
