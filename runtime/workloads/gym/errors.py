"""The gym workload's input errors, importable without gymnasium or torch (the CLI classes them as bad
input, exit 2, before it knows a run's workload)."""

from __future__ import annotations


class EnvSpecError(ValueError):
    """A bad ``env`` section: ``field`` is the spec field at fault (``env.id``, ``env.entry_point``, ``env.kwargs``)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class LearnerError(ValueError):
    """Bad learner configuration or state (the message names the field)."""


class SamplerError(ValueError):
    """A vector env the sampler cannot drive, or a state that is not this sampler's."""
