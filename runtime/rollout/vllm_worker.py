"""What the runtime adds to every vLLM worker (``worker_extension_cls``): loading the trainer's weights.

vLLM mixes this class into its worker class, in the worker's process (with the engine core in the
trainer's process and one device, that is the trainer's process). ``LLM.collective_rpc`` calls
:meth:`PolicyWeightLoader.load_policy_weights` by name on every worker.

How a running engine takes new weights (vllm 0.30.0, run on its CPU build in tests/vllm/): a model's
``load_weights`` works once only. After the first load each layer's ``process_weights_after_loading``
turns its parameters into the kernel's format: on CPU ``dispatch_cpu_unquantized_gemm`` packs every
linear layer's weight for oneDNN and replaces ``layer.weight`` by an empty parameter without a
``weight_loader``; on GPUs quantised layers do the same. A second ``load_weights`` then fails
(``'Parameter' object has no attribute 'weight_loader'``), as TRL's colocated vLLM path does on that build.
vLLM's own answer is its layerwise reload (``vllm/model_executor/model_loader/reload/``, driven by
``GPUModelRunner.reload_weights``, which the CPU model runner inherits and ``Worker.reload_weights`` wraps
in the worker's config): the checkpoint-format parameters recorded when the model was built are restored,
the new tensors go through the original loaders (q/k/v and gate/up fused there), each layer is processed
again as soon as all its weights have arrived, and the results are copied into the kernel tensors the
engine already holds (so CUDA graphs keep their addresses). This class calls exactly that, so GPU, NPU and
CPU workers take one path.

``weights`` may be any iterable of ``(hf_name, tensor)``: the adapter passes a generator that casts each
tensor to the engine's dtype as it is consumed, so at most one converted tensor exists at a time beyond
what the engine holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class PolicyWeightLoader:
    """Mixed into vLLM's worker: ``reload_weights`` is the worker's own method (vLLM's layerwise reload)."""

    reload_weights: Any  # declared for the type checker (an annotation only: no attribute to clash); vLLM's

    def load_policy_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors into the served model through vLLM's layerwise reload."""
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
