"""Sampling parameters, the completion record, and the vectorised sampler shared by the engine's loops.

Log-probabilities are those of the temperature-scaled distribution ``softmax(logits / temperature)``
*before* top-k / top-p truncation — exactly what the trainer recomputes with
``token_logprobs(..., temperature=T)``, so engine and trainer are compared on the same math. With
top-k/top-p the token was actually drawn from the renormalised truncated distribution; the difference
is the truncation mass, which the trainer's off-policy correction treats like any other mismatch.
Greedy decoding (``temperature=0``) reports temperature-1 log-probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.models.logprobs import logprobs_from_logits


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``top_k=0`` and ``top_p=1`` switch those filters off; ``temperature=0`` is greedy."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_ids: tuple[int, ...] = ()
    n: int = 1
    ignore_eos: bool = False  # benchmarks: force exactly max_new_tokens tokens

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")


@dataclass
class Completion:
    """One sampled response to prompt number ``prompt_index`` of the ``generate`` call (a request's tag when streaming)."""

    prompt_index: int
    token_ids: list[int]  # includes the stop token when finish_reason == "stop"
    logprobs: list[float]
    versions: list[int]  # weight version that produced each token
    finish_reason: str  # "stop" | "length"


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from ``logits [B, V]``; returns (tokens [B], logprobs [B]) — see module doc."""
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, logprobs_from_logits(logits, tokens, 1.0)
    scaled = logits / params.temperature if params.temperature != 1.0 else logits
    logp = scaled.log_softmax(-1)
    filtered = scaled
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(filtered, params.top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = probs.cumsum(-1) - probs >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(filtered, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logp.exp() if filtered is scaled else filtered.softmax(-1)
    # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws exactly from p in a few cheap ops
    # (torch.multinomial and Tensor.exponential_ cost several times more per step on CPU).
    race = torch.rand(probs.shape, generator=generator, device=probs.device).log_().neg_()
    tokens = (probs / race).argmax(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
