"""Input checks shared by the capacity model's inputs: one error type that names every bad field.

The error's shape is the run spec's (``runtime.spec.SpecError``): ``errors`` is a list of
``{"field": "costs.decode_s_per_token", "message": "..."}`` dicts, so the platform can show a
planner's bad input the way it shows a submission's.
"""

from __future__ import annotations

import math
from collections.abc import Collection


class InputError(ValueError):
    """A capacity-model input is out of its physical or logical range. ``errors`` names each field."""

    def __init__(self, errors: list[dict[str, str]]):
        self.errors = errors
        super().__init__("; ".join(f"{e['field']}: {e['message']}" for e in errors))

    @property
    def fields(self) -> list[str]:
        return [e["field"] for e in self.errors]


class Problems:
    """Collects field problems, then raises them together (a form shows every bad field at once)."""

    def __init__(self, prefix: str = ""):
        self.prefix = prefix
        self.errors: list[dict[str, str]] = []

    def add(self, field: str, message: str) -> None:
        self.errors.append({"field": f"{self.prefix}{field}", "message": message})

    def extend(self, error: InputError, prefix: str = "") -> None:
        for e in error.errors:
            self.errors.append({"field": f"{self.prefix}{prefix}{e['field']}", "message": e["message"]})

    def number(
        self,
        field: str,
        value: float,
        *,
        low: float,
        high: float,
        low_open: bool = False,
        unit: str = "",
    ) -> None:
        """``value`` must be a finite real number in ``[low, high]`` (``(low, high]`` when ``low_open``)."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.add(field, f"must be a number, got {value!r}")
            return
        if not math.isfinite(value):
            self.add(field, f"must be finite, got {value!r}")
            return
        below = value <= low if low_open else value < low
        if below or value > high:
            bracket = "(" if low_open else "["
            self.add(field, f"{value!r}{unit} is outside the physical range {bracket}{low:g}, {high:g}]{unit}")

    def integer(self, field: str, value: int, *, low: int, high: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            self.add(field, f"must be an integer, got {value!r}")
        elif not low <= value <= high:
            self.add(field, f"{value} is outside [{low}, {high}]")

    def choice(self, field: str, value: object, allowed: Collection[str]) -> None:
        if value not in allowed:
            self.add(field, f"{value!r} is not one of {', '.join(sorted(allowed))}")

    def raise_if_any(self) -> None:
        if self.errors:
            raise InputError(self.errors)
