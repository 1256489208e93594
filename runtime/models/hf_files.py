"""The plain decoder written as a Hugging Face model directory, without transformers.

What ``PreTrainedModel.save_pretrained(dir, safe_serialization=True)`` writes for the same model:
``config.json`` (``DecoderConfig.to_dict`` with the parameters' dtype), ``generation_config.json`` and
``model.safetensors`` (metadata ``{"format": "pt"}``; a tied ``lm_head.weight`` left out, as
transformers leaves it, which re-ties it on load). transformers, vLLM and ``build_policy`` load it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"


def save_directory(model: Any, directory: str | Path) -> Path:
    """Write ``model`` (a ``DecoderForCausalLM``) into ``directory``; returns it."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config.replace(dtype=str(model.dtype).removeprefix("torch."))
    _write_json(directory / CONFIG_FILE, config.to_dict())
    _write_json(directory / GENERATION_FILE, config.generation_dict())
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(_unshared(state), str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return directory


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous tensors, each with storage of its own (safetensors refuses shared storage: an
    engine-owned module's q/k/v are views of one fused tensor)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out
