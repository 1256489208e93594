"""Algorithms by name, and the plug-in point.

An :class:`Algorithm` is two callables plus two flags:

- ``loss_fn(batch: PolicyBatch, config: AlgorithmSpec) -> (loss [B, T], metrics)``:
  the per-token policy loss of one micro-batch (the trainer aggregates it with
  :func:`runtime.train.algos.core.aggregate_loss`, so accumulation and data
  parallelism stay exact whatever the loss is). ``metrics`` maps names to
  per-token ``[B, T]`` tensors; the trainer reports their token means.
- ``update_fn(ctx: UpdateContext) -> dict[str, float]``: the parameter-update
  step, called once per mini-batch after gradients are accumulated and
  all-reduced across ranks. :func:`adamw_update` is the default.

Built-ins are registered by name (``grpo``, ``ppo``). A user algorithm is
named by import path, ``algorithm.name: "my_pkg.my_mod:factory"``, where
``factory()`` returns an :class:`Algorithm` or a ``(loss_fn, update_fn)``
pair. Scheduling, micro-batching and distribution never change.
"""

from __future__ import annotations

import importlib
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
    and train a value model.
    """

    name: str
    loss_fn: LossFn
    update_fn: UpdateFn
    advantages: Literal["group", "gae"] = "group"
    needs_critic: bool = False


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


_REGISTRY: dict[str, Callable[[], Algorithm]] = {}


def register_algorithm(name: str, factory: Callable[[], Algorithm]) -> None:
    """Make ``factory`` available as ``algorithm.name: <name>``."""
    if ":" in name:
        raise AlgorithmError(f"algorithm.name: a registered name may not contain ':' ({name!r})")
    _REGISTRY[name] = factory


def registered_algorithms() -> list[str]:
    _ensure_builtins()
    return sorted(_REGISTRY)


def _ensure_builtins() -> None:
    # Imported lazily: grpo/ppo import this module to register themselves.
    from runtime.train.algos import grpo, ppo  # noqa: F401


def _coerce(name: str, made: Any) -> Algorithm:
    if isinstance(made, Algorithm):
        return made
    if isinstance(made, tuple) and len(made) == 2 and all(callable(f) for f in made):
        return Algorithm(name=name, loss_fn=made[0], update_fn=made[1])
    raise AlgorithmError(
        f"algorithm.name: factory {name!r} returned {type(made).__name__}; expected an Algorithm or (loss_fn, update_fn)"
    )


def get_algorithm(name: str) -> Algorithm:
    """An algorithm by registered name or ``package.module:factory`` import path."""
    _ensure_builtins()
    if ":" not in name:
        if name not in _REGISTRY:
            known = ", ".join(sorted(_REGISTRY))
            raise AlgorithmError(
                f"algorithm.name: unknown algorithm {name!r}; known: {known}, or `package.module:factory`"
            )
        return _coerce(name, _REGISTRY[name]())
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise AlgorithmError(f"algorithm.name: {name!r} must look like `package.module:factory`")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AlgorithmError(f"algorithm.name: cannot import module {module_name!r}: {exc}") from None
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise AlgorithmError(f"algorithm.name: module {module_name!r} has no callable {attr!r}")
    return _coerce(name, factory())
