"""The optimizer every trainer builds: ``torch.optim.AdamW`` on torch's fused kernel wherever torch has one.

``torch.optim.AdamW(fused=True)`` runs the whole update in one kernel per device and dtype: on CUDA, on Ascend
(torch_npu registers it for the ``npu`` device) and on CPU. On CPU it is 3-7x faster a step than the
multi-tensor (``foreach``) update, the runtime's own AdamW before it included (``bench/optimizer_step.py``,
RESULTS.md), so there is one optimizer on every device. The runtime's own AdamW avoided importing
``torch._dynamo`` (about 1 s of start-up); start-up is no longer worth a slower step, nor a second copy of
the optimizer.

torch_npu's ``NpuFusedAdamW`` is not used: it packs every parameter into one combined buffer, so it needs
parameters that are never reallocated and keeps its state in its own layout, which FSDP2's sharded
parameters and torch.distributed.checkpoint do not fit; ``fused=True`` keeps torch's per-parameter state.

Checkpoints: the state layout is torch's (per parameter ``step``, ``exp_avg``, ``exp_avg_sq``), which is also
what the runtime's own AdamW wrote. A loaded state dict carries the kernel flags it was saved with (torch
restores a group's ``fused`` and ``foreach`` from the file); :class:`AdamW` puts back its own choice, so a
checkpoint written before the change (``fused: None``) resumes on the fused kernel, with each ``step``
counter on its parameter's device as the fused kernel wants it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

# Device types whose fused AdamW kernel the runtime uses (its device layer's three); anything else, the
# multi-tensor update.
FUSED_DEVICE_TYPES = frozenset({"cpu", "cuda", "npu"})


def _first_device(params: list[Any]) -> torch.device:
    for entry in params:
        tensors = entry["params"] if isinstance(entry, dict) else [entry]
        for t in tensors:
            return t.device
    raise ValueError("optimizer got an empty parameter list")


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` with the fused kernel on cpu, cuda and npu, kept across ``load_state_dict``."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        entries: list[Any] = list(params)
        fused = _first_device(entries).type in FUSED_DEVICE_TYPES
        super().__init__(
            entries, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True if fused else None,
            foreach=None if fused else True,
        )  # fmt: skip

    @property
    def fused(self) -> bool:
        return bool(self.defaults["fused"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group.update(fused=self.defaults["fused"], foreach=self.defaults["foreach"])
            if not self.fused:
                continue
            for p in group["params"]:
                state = self.state.get(p)
                if state and "step" in state and state["step"].device != p.device:
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
