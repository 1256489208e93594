"""What the runtime adds to every vLLM worker (``worker_extension_cls``): loading the trainer's weights.

vLLM mixes this class into its worker class, in the worker's process (with the engine core in the
trainer's process and one device, that is the trainer's process). ``LLM.collective_rpc`` calls
:meth:`PolicyWeightLoader.load_policy_weights` by name on every worker.

Checked against vllm 0.30.0's source: ``vllm/v1/worker/worker_base.py`` appends the class to the worker's
bases and refuses any attribute name the worker already has (``load_policy_weights`` is not one);
``vllm/v1/worker/gpu_worker.py`` builds ``model_runner`` as Model Runner V2 (``vllm/v1/worker/gpu/
model_runner.py``, 0.30's default) or V1 (``vllm/v1/worker/gpu_model_runner.py``); both have
``get_model()``, which on V1 unwraps the CUDA-graph wrapper. vllm-ascend 0.23.0's ``NPUWorker`` has the
same ``model_runner`` (``NPUModelRunner``, a ``GPUModelRunner`` with its own ``get_model()``). Never run on
hardware (module docstring of vllm_adapter).
"""

from __future__ import annotations

from typing import Any

import torch


class PolicyWeightLoader:
    """Mixed into vLLM's worker: ``model_runner`` is the worker's own attribute."""

    model_runner: Any  # declared for the type checker (an annotation only: no attribute to clash); vLLM sets it

    def load_policy_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the served model (vLLM's loader fuses q/k/v, gate/up)."""
        self.model_runner.get_model().load_weights(weights)
