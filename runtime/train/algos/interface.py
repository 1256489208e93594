"""What an algorithm is: the batch its loss sees, the context of its update step, and the default update.

An :class:`Algorithm` is two callables plus two flags (see :mod:`runtime.train.algos.registry` for how
one is named in a spec). Kept apart from the registry so that the built-in algorithms and the registry
both build on it without importing each other.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor


class AlgorithmError(ValueError):
    """``algorithm.name`` does not name a usable algorithm."""


@dataclass
class PolicyBatch:
    """The tensors one micro-batch's policy loss needs; every tensor is ``[B, T]``.

    ``logprobs`` carry gradient; everything else is detached. ``old_logprobs``
    is what the ratio is taken against (proximal policy for ``none`` /
    ``decoupled``, behaviour for ``truncated``); ``is_weights`` the truncated
    behaviour-to-proximal weights (``decoupled`` only, else None).
    ``entropy`` has gradient only when ``algorithm.entropy_coef > 0``.
    """

    logprobs: Tensor
    old_logprobs: Tensor
    behaviour_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    is_weights: Tensor | None = None
    ref_logprobs: Tensor | None = None
    entropy: Tensor | None = None


@dataclass
class UpdateContext:
    """What a parameter-update step may touch: gradients are already summed over micro-batches and ranks."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # torch.optim.lr_scheduler.LRScheduler
    grad_clip: float
    step: int


LossFn = Callable[[PolicyBatch, Any], tuple[Tensor, dict[str, Tensor]]]
UpdateFn = Callable[[UpdateContext], dict[str, float]]


@dataclass(frozen=True)
class Algorithm:
    """A named RL objective.

    ``advantages``: ``group`` (GRPO group-normalised outcome advantages) or
    ``gae`` (needs a critic; PPO). ``needs_critic`` makes the trainer require
    and train a value model. ``needs_full_weights`` refuses it with ``model.lora``.
    """

    name: str
    loss_fn: LossFn
    update_fn: UpdateFn
    advantages: Literal["group", "gae"] = "group"
    needs_critic: bool = False
    # An update step that reads or writes every weight (not only those that require gradients): refused
    # with model.lora, whose base weights are frozen and never synced.
    needs_full_weights: bool = False


def adamw_update(ctx: UpdateContext) -> dict[str, float]:
    """Default update: clip the global gradient norm, step the optimizer and the LR schedule, clear gradients.

    A non-finite gradient norm skips the optimizer step (one bad batch must
    not turn every weight into NaN); the schedule still advances so that
    resumed and uninterrupted runs stay aligned. The norm is reported as is.
    """
    params = [p for p in ctx.model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, ctx.grad_clip)
    lr = ctx.optimizer.param_groups[0]["lr"]
    if torch.isfinite(grad_norm):
        ctx.optimizer.step()
        ctx.scheduler.step()
    else:
        with warnings.catch_warnings():  # torch warns about a schedule step without an optimizer step: intended
            warnings.simplefilter("ignore", UserWarning)
            ctx.scheduler.step()
    ctx.optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": float(grad_norm), "lr": float(lr)}
