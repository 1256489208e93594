"""The sample types that flow between rollout, queue and trainer.

Plain dataclasses of Python lists so they pickle cheaply and cross process
boundaries; the packed transfer format (flat tensors + lengths) is built from
these in ``runtime.sample_queue``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Prompt:
    """One task prompt. ``prompt_id`` is stable across the run (data cursor)."""

    prompt_id: int
    text: str
    answer: str
    size: int = 0  # problem size of a built-in task (drives answer length)


@dataclass
class Sample:
    """One generated response with everything the trainer needs.

    ``logprobs`` are the engine's (behaviour) log-probabilities of
    ``response_ids``; ``versions`` the weight version that produced each
    response token.
    """

    sample_id: int
    prompt_id: int
    group_id: int  # samples of the same prompt in the same step share it
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length"
    reward: float = 0.0
    correct: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def version(self) -> int:
        """Oldest weight version that contributed a token (staleness is measured from it)."""
        return min(self.versions) if self.versions else 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)
