"""A vLLM engine's LoRA adapters, one per weight version (``model.lora`` with ``rollout.engine: vllm``).

vLLM serves a LoRA adapter from a PEFT adapter directory named by a ``LoRARequest`` (name, a positive
integer id, the path) that each request carries (``LLMEngine.add_request(..., lora_request=...)``,
``add_lora`` / ``remove_lora``: ``vllm/v1/engine/llm_engine.py``, vLLM 0.30; its CPU build serves them with
``PunicaWrapperCPU``). A weight update here is therefore the adapters written as such a directory and
registered under the version's id; requests admitted from then on carry it. A request keeps the adapter it
was admitted with to its end (vLLM cannot switch a running request's adapter), so its tokens are tagged
with that version, and an adapter is dropped only once no live request uses it. Version 0's adapters are
the zero update (peft's B starts at 0): the base model, no request.
"""

from __future__ import annotations

import shutil
import tempfile
import typing
import weakref
from pathlib import Path
from typing import Any

import torch

from runtime.models.lora import lora_config, state_bytes, write_adapter


def vllm_lora_rank(r: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds rank ``r`` (vLLM's ``MaxLoRARanks``)."""
    from vllm.config.lora import MaxLoRARanks

    ranks = sorted(typing.get_args(MaxLoRARanks))
    fitting = [rank for rank in ranks if rank >= r]
    if not fitting:
        raise ValueError(f"model.lora.r: {r} is above the largest rank vLLM serves ({ranks[-1]})")
    return fitting[0]


class VLLMAdapters:
    """The adapter directories and ``LoRARequest`` of each weight version an engine was sent."""

    def __init__(self, llm: Any, lora: Any, base_model: str):
        from vllm.lora.request import LoRARequest

        self._request_type = LoRARequest
        self.llm = llm
        self.config = lora_config(lora)
        self.base_model = base_model
        self.root = Path(tempfile.mkdtemp(prefix="tandem-vllm-lora-"))
        weakref.finalize(self, shutil.rmtree, str(self.root), True)
        self.requests: dict[int, Any] = {}  # version -> its LoRARequest
        self.current: Any = None  # the newest version's request (None: version 0, the base model)

    def load(self, adapters: dict[str, torch.Tensor], version: int, in_use: set[int]) -> int:
        """Register ``adapters`` (the trainer's adapter state) as ``version``; returns the bytes written.
        Versions neither current nor in ``in_use`` (live requests') are dropped."""
        directory = write_adapter(self.root / f"v{version}", self.config, adapters, self.base_model)
        request = self._request_type(f"v{version}", version + 1, str(directory))
        self.llm.llm_engine.add_lora(request)  # loaded now: a bad adapter fails the update, not a request
        self.requests[version] = request
        self.current = request
        self.prune(in_use)
        return state_bytes(adapters)

    def prune(self, in_use: set[int]) -> None:
        """Drop every adapter but the current one and those live requests still generate with."""
        for version in [v for v, req in self.requests.items() if req is not self.current and v not in in_use]:
            request = self.requests.pop(version)
            self.llm.llm_engine.remove_lora(request.lora_int_id)
            shutil.rmtree(request.lora_path, ignore_errors=True)

    def version_of(self, request: Any) -> int | None:
        return None if request is None else request.lora_int_id - 1
