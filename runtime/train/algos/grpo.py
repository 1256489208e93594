"""GRPO: Group Relative Policy Optimization (Shao et al. 2024, *DeepSeekMath*, arXiv:2402.03300).

Each prompt is sampled ``group_size`` times; a response's advantage is its
reward normalised within its group (:func:`runtime.train.algos.core.grpo_advantages`),
broadcast to every response token. The policy loss is PPO's clipped surrogate
(Schulman et al. 2017) with an optional k3 KL penalty to a frozen reference
(Schulman's KL note) and an optional entropy bonus.

Deviations from the paper: the KL term is added to the per-token loss and
reduced with the configured ``loss_agg`` (the paper uses the per-sequence token
mean, our ``seq-mean-token-mean``; the default here is ``token-mean``, as in
DAPO, which does not down-weight long responses); stale samples get the
off-policy correction described in :mod:`runtime.train.algos.core`.
"""

from __future__ import annotations

from torch import Tensor

from runtime.train.algos.core import clipped_surrogate, kl_k3
from runtime.train.algos.interface import Algorithm, PolicyBatch, adamw_update


def policy_loss(batch: PolicyBatch, config) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token clipped-surrogate loss with KL and entropy terms; ``[B, T]`` in, ``([B, T], metrics)`` out.

    ``config`` is an ``AlgorithmSpec`` (``clip_eps``, ``clip_eps_high``,
    ``off_policy``, ``is_cap``, ``kl_coef``, ``entropy_coef``). Metrics are
    per-token tensors: ``clip_fraction``, ``kl_ref`` (when a reference is
    given), ``entropy`` (when computed).
    """
    clip_high = config.clip_eps_high if config.clip_eps_high is not None else config.clip_eps
    dual_clip = config.is_cap if config.off_policy == "truncated" else None
    loss, metrics = clipped_surrogate(
        batch.logprobs,
        batch.old_logprobs,
        batch.advantages,
        batch.mask,
        clip_low=config.clip_eps,
        clip_high=clip_high,
        weights=batch.is_weights,
        dual_clip=dual_clip,
    )
    out = {"clip_fraction": metrics["clip_fraction"]}
    mask = batch.mask.to(loss.dtype)
    if batch.ref_logprobs is not None:
        kl = kl_k3(batch.logprobs, batch.ref_logprobs) * mask
        out["kl_ref"] = kl.detach()
        if config.kl_coef > 0:
            loss = loss + config.kl_coef * kl
            out["loss/kl"] = (config.kl_coef * kl).detach()
    if batch.entropy is not None:
        out["entropy"] = batch.entropy.detach() * mask
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * batch.entropy * mask
    return loss, out


def make_grpo() -> Algorithm:
    return Algorithm(name="grpo", loss_fn=policy_loss, update_fn=adamw_update, advantages="group")
