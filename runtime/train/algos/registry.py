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
from collections.abc import Callable
from typing import Any

from runtime.train.algos.grpo import make_grpo
from runtime.train.algos.interface import Algorithm, AlgorithmError
from runtime.train.algos.ppo import make_ppo

_REGISTRY: dict[str, Callable[[], Algorithm]] = {"grpo": make_grpo, "ppo": make_ppo}


def register_algorithm(name: str, factory: Callable[[], Algorithm]) -> None:
    """Make ``factory`` available as ``algorithm.name: <name>``."""
    if ":" in name:
        raise AlgorithmError(f"algorithm.name: a registered name may not contain ':' ({name!r})")
    _REGISTRY[name] = factory


def registered_algorithms() -> list[str]:
    return sorted(_REGISTRY)


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
