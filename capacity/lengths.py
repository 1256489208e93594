"""Response lengths: a long-tailed distribution clipped at ``max_new_tokens``, sampled with a seed.

RL response lengths are long-tailed: most answers are short, a few run to the generation limit
(DAPO, Yu et al. 2025, figure 7; the Tandem design's three bubbles come from that tail). The model
draws them from a log-normal distribution clipped at ``max_new_tokens`` — a sample that would be
longer stops at the limit, as a truncated generation does.

A prompt's answers resemble each other: each prompt draws its own median
(``median * exp(N(0, prompt_sigma))``) and its ``group_size`` answers scatter around it with
``sigma``. With ``prompt_sigma = 0`` every length is independent; with ``sigma = 0`` and
``prompt_sigma = 0`` every length is the median (:func:`fixed_lengths`), the deterministic case the
tests compare against closed forms.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from capacity.checks import Problems

MAX_TOKENS = 1 << 20


@dataclass(frozen=True)
class LengthDistribution:
    """Log-normal response lengths in tokens, clipped to ``[1, max_new_tokens]``."""

    median: float
    """Median response length in tokens (before clipping)."""
    max_new_tokens: int
    """The generation limit: longer draws are cut here."""
    sigma: float = 0.0
    """Spread of a prompt's answers around its own median (log-space standard deviation)."""
    prompt_sigma: float = 0.0
    """Spread of prompts' medians around ``median`` (log-space standard deviation)."""

    def __post_init__(self) -> None:
        p = Problems()
        p.number("median", self.median, low=0, high=MAX_TOKENS, low_open=True, unit=" tokens")
        p.integer("max_new_tokens", self.max_new_tokens, low=1, high=MAX_TOKENS)
        p.number("sigma", self.sigma, low=0, high=5)
        p.number("prompt_sigma", self.prompt_sigma, low=0, high=5)
        p.raise_if_any()

    def group(self, rng: np.random.Generator, size: int) -> list[int]:
        """The response lengths of one prompt's ``size`` samples."""
        centre = np.log(self.median) + (rng.normal(0.0, self.prompt_sigma) if self.prompt_sigma else 0.0)
        logs = centre + (rng.normal(0.0, self.sigma, size) if self.sigma else np.zeros(size))
        lengths = np.clip(np.rint(np.exp(logs)), 1, self.max_new_tokens)
        return [int(x) for x in lengths]

    def sample(self, seed: int, groups: int, size: int) -> list[list[int]]:
        """``groups`` groups of ``size`` lengths, the same for the same seed."""
        rng = np.random.default_rng(seed)
        return [self.group(rng, size) for _ in range(groups)]


def fixed_lengths(length: int, max_new_tokens: int | None = None) -> LengthDistribution:
    """Every response exactly ``length`` tokens."""
    return LengthDistribution(median=length, max_new_tokens=max_new_tokens or length)
