"""AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019) for every optimizer the runtime
builds, without importing ``torch._dynamo``.

Why not ``torch.optim.AdamW`` itself: torch guards ``Optimizer.add_param_group``, ``zero_grad``, ``state_dict``
and ``load_state_dict`` against torch.compile tracing with wrappers that import ``torch._dynamo`` on their first
call, and ``AdamW.step`` does the same through ``_use_grad_for_differentiable`` and its functional kernel. That
import (about 1 s, sympy and parts of torch.distributed with it) was half of a sync run's start-up. The runtime
never compiles an optimizer, so here the guarded base methods are called undecorated (``__wrapped__``, the
function the guard wraps) and the update is this module's own.

The class is a ``torch.optim.Optimizer`` with ``torch.optim.AdamW``'s state layout (per parameter a CPU float32
``step`` tensor, ``exp_avg``, ``exp_avg_sq``; the same param-group keys), so learning-rate schedulers, the fp16
grad scaler, torch.distributed.checkpoint and checkpoints written with ``torch.optim.AdamW`` work unchanged.
The update is the paper's (bias-corrected moments, weight decay applied to the parameter before the moment
step) with the operations in the order torch's eager AdamW runs them, so it matches ``torch.optim.AdamW`` bit
for bit on CPU (tested). Not supported: amsgrad, maximize, capturable, fused, differentiable, sparse gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

_Base = torch.optim.Optimizer
# The undecorated base methods (``functools.wraps`` keeps them as ``__wrapped__``); a torch whose wrappers no
# longer expose it leaves the decorated method, which is correct, only slower to start.
_add_param_group = getattr(_Base.add_param_group, "__wrapped__", _Base.add_param_group)
_zero_grad = getattr(_Base.zero_grad, "__wrapped__", _Base.zero_grad)
_state_dict = getattr(_Base.state_dict, "__wrapped__", _Base.state_dict)
_load_state_dict = getattr(_Base.load_state_dict, "__wrapped__", _Base.load_state_dict)

# Group keys torch.optim.AdamW writes; kept so a state dict moves between the two either way.
_TORCH_ADAMW_FLAGS = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}


class AdamW(torch.optim.Optimizer):
    """Decoupled-weight-decay Adam; ``torch.optim.AdamW``'s arguments that the runtime uses, its defaults."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must each be in [0, 1), got {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, **_TORCH_ADAMW_FLAGS}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _add_param_group(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _zero_grad(self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return _state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _load_state_dict(self, state_dict)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for group in self.param_groups:
                self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("AdamW does not take sparse gradients")
        grads = [p.grad for p in params]
        states = [self._state(p) for p in params]
        steps = [s["step"] for s in states]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]

        torch._foreach_add_(steps, 1.0)
        if weight_decay != 0:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        counts = [float(t.item()) for t in steps]  # parameters that missed a step have fewer
        step_sizes = [-(lr / (1 - beta1**n)) for n in counts]
        denominators = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denominators, [(1 - beta2**n) ** 0.5 for n in counts])
        torch._foreach_add_(denominators, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denominators, step_sizes)

    def _state(self, p: Tensor) -> dict[str, Tensor]:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)  # on the host, as torch.optim keeps it
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state
