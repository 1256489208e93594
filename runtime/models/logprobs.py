"""Scoring sequences: the one definition of per-token log-probabilities that trainer, engine and tests share."""

from __future__ import annotations

from typing import Any

import torch


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count only real tokens, so left- and right-padded rows get the same positions."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def logprobs_from_logits(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature), computed in float32. logits [..., V], token_ids [...].

    temperature <= 0 (greedy decoding) scores with temperature 1.
    """
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    return logits.log_softmax(-1).gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)


def token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probability of each next token: ``out[b, t] = log p(input_ids[b, t+1] | input_ids[b, :t+1])``.

    input_ids, attention_mask [B, T] -> [B, T-1] (float32; entries at padding are meaningless, mask them).
    Position ids default to counting real tokens, matching the generation engine's left-padded prefill.
    """
    if position_ids is None:
        position_ids = positions_from_mask(attention_mask)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).logits
    return logprobs_from_logits(logits[:, :-1], input_ids[:, 1:], temperature)
