"""What the runtime adds to every vLLM worker (``worker_extension_cls``): loading the trainer's weights.

vLLM mixes this class into its worker class, in the worker's process (with the engine core in the
trainer's process and one device, that is the trainer's process). ``LLM.collective_rpc`` calls
:meth:`PolicyWeightLoader.load_policy_weights` by name on every worker. vllm-ascend's NPU worker has
the same ``model_runner.model``. Never run on hardware (module docstring of vllm_adapter).
"""

from __future__ import annotations

from typing import Any

import torch


class PolicyWeightLoader:
    """Mixed into vLLM's worker: ``model_runner`` is the worker's own attribute."""

    model_runner: Any  # declared for the type checker; vLLM's worker sets it

    def load_policy_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the served model (vLLM's loader fuses q/k/v, gate/up)."""
        self.model_runner.model.load_weights(weights=weights)
