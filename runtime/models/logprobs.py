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


# Rows of logits per chunk in :func:`logprobs_and_entropy`: about 2**22 float32 elements (16 MiB) at a time.
CHUNK_ELEMENTS = 1 << 22


def logprobs_and_entropy(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0, entropy_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(token), entropy)`` of ``softmax(logits / temperature)`` for flat ``logits [n, V]``, ``token_ids
    [n]``, both float32 ``[n]``: :func:`logprobs_from_logits` and the distribution's entropy, to float rounding.

    Computed a chunk of rows at a time in float32, never a whole-vocabulary float32 tensor: forward keeps only
    each row's log-sum-exp and mean logit for backward, which recomputes the softmax chunk by chunk and writes
    the gradient in ``logits``' own dtype (with Qwen's 152k vocabulary a float32 ``log_softmax`` is 0.6 MB a
    token, and today's path keeps several). ``entropy_grad=False``: the entropy is a metric only (no gradient
    flows through it). temperature <= 0 scores with temperature 1, as :func:`logprobs_from_logits`.
    """
    logp, entropy = _ChunkedLogprobs.apply(logits, token_ids, _scale(logits, token_ids, temperature), True)
    return logp, entropy if entropy_grad else entropy.detach()


def chunked_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The log-probs of :func:`logprobs_and_entropy` alone, without the entropy's extra pass over each chunk."""
    return _ChunkedLogprobs.apply(logits, token_ids, _scale(logits, token_ids, temperature), False)[0]


def _scale(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float) -> float:
    """1 / temperature (1 for greedy's temperature <= 0), once the shapes are checked."""
    if logits.dim() != 2 or token_ids.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be [n, V] and token_ids [n], got {list(logits.shape)} and {list(token_ids.shape)}"
        )
    return 1.0 / temperature if temperature > 0 else 1.0


def _rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


class _ChunkedLogprobs(torch.autograd.Function):
    """z = logits * scale, p = softmax(z): log p_c = z_c - lse(z), H = lse(z) - sum_j p_j z_j.
    Gradients per row: d log p_c / dz_j = [j = c] - p_j; dH / dz_j = -p_j (z_j - E_p[z])."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, token_ids: torch.Tensor, scale: float, with_entropy: bool):  # type: ignore[override]
        n = logits.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        mean_z = torch.zeros_like(lse)  # E_p[z], for the entropy and its gradient (left 0 without the entropy)
        chosen = torch.empty_like(lse)
        step = _rows_per_chunk(logits.shape[1])
        for start in range(0, n, step):
            rows = slice(start, start + step)
            z = logits[rows].float() * scale
            lse[rows] = torch.logsumexp(z, dim=-1)
            if with_entropy:
                mean_z[rows] = (torch.exp(z - lse[rows].unsqueeze(-1)) * z).sum(-1)
            chosen[rows] = z.gather(-1, token_ids[rows].unsqueeze(-1)).squeeze(-1)
        ctx.save_for_backward(logits, token_ids, lse, mean_z)
        ctx.scale = scale
        ctx.mark_non_differentiable(token_ids)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no pass for it in backward
        return chosen - lse, lse - mean_z

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None):  # type: ignore[override]
        logits, token_ids, lse, mean_z = ctx.saved_tensors
        scale = ctx.scale
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None
        grad = torch.empty_like(logits)
        step = _rows_per_chunk(logits.shape[1])
        for start in range(0, logits.shape[0], step):
            rows = slice(start, start + step)
            z = logits[rows].float() * scale
            p = torch.exp(z - lse[rows].unsqueeze(-1))
            g = torch.zeros_like(z)
            if grad_logp is not None:
                g1 = grad_logp[rows].float().unsqueeze(-1)
                g -= g1 * p
                g.scatter_add_(-1, token_ids[rows].unsqueeze(-1), g1)
            if grad_entropy is not None:
                g -= grad_entropy[rows].float().unsqueeze(-1) * p * (z - mean_z[rows].unsqueeze(-1))
            grad[rows] = (g * scale).to(logits.dtype)
        return grad, None, None, None
