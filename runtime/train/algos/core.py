"""The learning math: small pure functions, tensors in, tensors (or ``(loss, metrics)``) out.

Shapes use these letters: ``N`` sequences in the step, ``B`` sequences in a
micro-batch, ``T`` token positions of a micro-batch (response tokens sit where
``mask`` is 1; the rest is prompt or padding and never contributes).

Sources, and where we deviate:

- GRPO group-normalised advantages: Shao et al. 2024, *DeepSeekMath: Pushing
  the Limits of Mathematical Reasoning in Open Language Models*
  (arXiv:2402.03300), section 4.1 (outcome supervision). Deviation: the group
  std is the population std (``unbiased=False``) plus ``eps``, so a group of
  identical rewards gets advantage exactly 0 instead of 0/0.
- Clipped surrogate: Schulman et al. 2017, *Proximal Policy Optimization
  Algorithms* (arXiv:1707.06347), eq. 7, with an optional asymmetric upper clip.
- GAE: Schulman et al. 2016, *High-Dimensional Continuous Control Using
  Generalized Advantage Estimation* (arXiv:1506.02438), eq. 16, over the
  response tokens of each sequence; the value after the last token is 0.
- k3 KL estimator: J. Schulman, *Approximating KL Divergence* (2020 note),
  ``k3 = (r - 1) - log r`` with ``r = p_ref / p``: unbiased for KL(p || p_ref)
  under samples of ``p`` and never negative.
- Decoupled PPO objective for stale samples: Fu et al. 2025, *AReaL: A
  Large-Scale Asynchronous Reinforcement Learning System for Language
  Reasoning* (arXiv:2505.24298): the ratio is taken against the *proximal*
  policy (the trainer's weights before this step's updates) and the token is
  weighted by ``proximal / behaviour``. Deviation: AReaL drops tokens whose
  weight exceeds the cap; we truncate the weight at the cap
  (``min(w, cap)``, as in truncated importance sampling), which keeps the
  token's gradient bounded instead of discarding it.
- Truncated ratio (``off_policy: truncated``): the ratio is taken directly
  against the behaviour policy (no proximal forward pass) and, for negative
  advantages, bounded by ``cap`` — the dual clip of Ye et al. 2020,
  *Mastering Complex Control in MOBA Games with Deep Reinforcement Learning*
  (arXiv:1912.09729).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
OFF_POLICY_MODES: tuple[str, ...] = ("none", "decoupled", "truncated")


def masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    """Sum of ``values`` where ``mask`` is 1. Any shape; returns a scalar."""
    return (values * mask).sum()


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1 (0 when the mask is empty)."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def aggregate_loss(
    loss: Tensor,
    mask: Tensor,
    mode: str,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    - ``token-mean``: sum over every response token of the batch / number of tokens
      (long responses weigh more, each token counts once — DAPO's choice).
    - ``seq-mean-token-mean``: mean over sequences of each sequence's token mean
      (the original GRPO paper's 1/G Σ 1/|o_i| Σ_t).
    - ``seq-mean-token-sum``: mean over sequences of each sequence's token sum
      (Dr. GRPO-style, no length normalisation).

    ``num_tokens`` / ``num_seqs`` override the denominators: pass the counts
    of the *whole* (mini-)batch, across all micro-batches and ranks, and the
    sum of the micro-batch results equals the full-batch loss — that is how
    gradient accumulation and data parallelism stay exact.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"algorithm.loss_agg: unknown mode {mode!r}; expected one of {', '.join(LOSS_AGG_MODES)}")
    if loss.shape != mask.shape:
        raise ValueError(f"loss {tuple(loss.shape)} and mask {tuple(mask.shape)} must have the same shape")
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        denom = mask.sum().clamp(min=1) if num_tokens is None else max(float(num_tokens), 1.0)
        return (loss * mask).sum() / denom
    seq_tokens = mask.sum(dim=-1)
    seq_sum = (loss * mask).sum(dim=-1)
    per_seq = seq_sum / seq_tokens.clamp(min=1) if mode == "seq-mean-token-mean" else seq_sum
    has_tokens = (seq_tokens > 0).to(loss.dtype)
    denom = has_tokens.sum().clamp(min=1) if num_seqs is None else max(float(num_seqs), 1.0)
    return (per_seq * has_tokens).sum() / denom


def grpo_advantages(rewards: Tensor, group_ids: Tensor, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-normalised outcome advantages (DeepSeekMath §4.1.2).

    ``rewards`` ``[N]`` float, ``group_ids`` ``[N]`` int (samples of one prompt
    share a group). Returns ``[N]``: ``(r - mean_g)`` or, with
    ``normalize_std``, ``(r - mean_g) / (std_g + eps)`` (population std).
    Groups may be of any size and in any order.
    """
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be 1-D of the same length"
        )
    rewards = rewards.to(torch.float64)  # exact group statistics; cast back at the end
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    counts = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, inverse, torch.ones_like(rewards))
    means = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, inverse, rewards) / counts
    centred = rewards - means[inverse]
    if normalize_std:
        var = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, inverse, centred**2) / counts
        centred = centred / (var.sqrt()[inverse] + eps)
    return centred.to(torch.float32)


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over response tokens (Schulman et al. 2016, eq. 16).

    ``rewards``, ``values``, ``mask``: ``[B, T]``. Each row's response tokens
    are the contiguous run where ``mask`` is 1; ``values[b, t]`` is V(state
    before token t); the value after a row's last token is 0 (episode end).
    Returns ``(advantages, returns)``, both ``[B, T]`` and 0 outside the mask;
    ``returns = advantages + values`` are the critic's targets.
    """
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 2:
        raise ValueError("rewards, values and mask must all be [B, T]")
    mask = mask.to(values.dtype)
    values = values * mask
    rewards = rewards * mask
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(values.shape[0], dtype=values.dtype, device=values.device)
    running = torch.zeros_like(next_value)
    for t in range(values.shape[1] - 1, -1, -1):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        # Outside the mask keep nothing, so padding after a row never leaks into it.
        running = running * m
        advantages[:, t] = running
        next_value = torch.where(m > 0, values[:, t], torch.zeros_like(next_value))
    return advantages, (advantages + values) * mask


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || reference): ``exp(d) - d - 1``, ``d = ref - logp``.

    Shapes ``[B, T]`` (any matching shape). Non-negative, 0 where equal.
    ``d`` is clamped to ±20 so a far-off reference cannot overflow ``exp``.
    """
    d = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return torch.exp(d) - d - 1.0


def importance_weights(proximal_logprobs: Tensor, behaviour_logprobs: Tensor, cap: float) -> Tensor:
    """Truncated behaviour-to-proximal weights ``min(exp(prox - behav), cap)``, ``[B, T]``, no gradient."""
    if cap <= 0:
        raise ValueError("algorithm.is_cap must be positive")
    log_w = (proximal_logprobs - behaviour_logprobs).detach()
    return torch.exp(log_w.clamp(max=torch.log(torch.tensor(cap, dtype=log_w.dtype)).item()))


def clipped_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    weights: Tensor | None = None,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token PPO clipped-surrogate loss (Schulman et al. 2017, eq. 7), negated for descent.

    All inputs ``[B, T]``. ``ratio = exp(logprobs - old_logprobs)``; the
    per-token loss is ``-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``,
    times ``weights`` (detached importance weights) when given. ``dual_clip``
    (> 1) bounds the loss of negative-advantage tokens at ``-dual_clip * A``.
    Returns ``(loss [B, T], metrics)`` where metrics are per-token ``[B, T]``
    tensors: ``clip_fraction`` (1 where the clip changed the objective) and
    ``ratio``. Outside the mask the loss is 0.
    """
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = (clipped > unclipped).to(logprobs.dtype)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual = torch.minimum(loss, bound)
        loss = torch.where(advantages < 0, dual, loss)
        was_clipped = torch.where((advantages < 0) & (bound < torch.maximum(unclipped, clipped)), 1.0, was_clipped)
    if weights is not None:
        loss = loss * weights.detach()
    mask = mask.to(logprobs.dtype)
    return loss * mask, {"clip_fraction": was_clipped.detach() * mask, "ratio": ratio.detach() * mask}


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float) -> tuple[Tensor, dict]:
    """Per-token clipped value loss ``0.5 * max((V - R)^2, (V_clip - R)^2)``, ``[B, T]``.

    ``V_clip = V_old + clamp(V - V_old, -clip, clip)`` (PPO's value clipping,
    as in OpenAI baselines). Returns ``(loss [B, T], {"value_clip_fraction": [B, T]})``.
    """
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (clipped_values - returns) ** 2
    mask = mask.to(values.dtype)
    loss = 0.5 * torch.maximum(loss_unclipped, loss_clipped) * mask
    return loss, {"value_clip_fraction": (loss_clipped > loss_unclipped).to(values.dtype).detach() * mask}


def whiten(values: Tensor, mask: Tensor, mean: Tensor, var: Tensor, eps: float = 1e-8) -> Tensor:
    """``(values - mean) / sqrt(var + eps)`` inside the mask, 0 outside (PPO advantage normalisation)."""
    return (values - mean) * torch.rsqrt(var + eps) * mask.to(values.dtype)
