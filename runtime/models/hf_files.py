"""The plain decoder written as, and read from, a Hugging Face model directory, without transformers.

Writing: what ``PreTrainedModel.save_pretrained(dir, safe_serialization=True)`` writes for the same
model: ``config.json`` (``DecoderConfig.to_dict`` with the parameters' dtype), ``generation_config.json``
and ``model.safetensors`` (metadata ``{"format": "pt"}``; a tied ``lm_head.weight`` left out, as
transformers leaves it, which re-ties it on load). transformers, vLLM and ``build_policy`` load it.

Reading (:func:`plain_config`; ``runtime.models.loading.load_directory`` loads the weights): a
``model.path`` directory whose config.json is one the plain decoder computes exactly as transformers does — a Qwen2 or Llama decoder with the default
RoPE, SiLU, no sliding window, biases where the architecture has them, every key known — and whose
weights are one ``model.safetensors`` file. The built-ins' exports and SFT checkpoints (the demo's
model) are such directories; anything else (another architecture, RoPE scaling, sharded weights, a key
this module does not know) is loaded by transformers, so nothing is ever computed differently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from runtime.models.configs import ARCHITECTURES, DecoderConfig

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


# config.json keys that only describe (the decoder reads them, or they change nothing it computes)
_FIELDS = {f for f in DecoderConfig.__dataclass_fields__ if f != "dtype"}
_DESCRIPTIVE = {"architectures", "transformers_version", "_name_or_path", "dtype", "torch_dtype"}
_DEFAULT_ROPE = {"rope_type", "rope_theta"}  # rope_parameters' keys with the default RoPE (transformers 5)
_REQUIRED = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings",
}  # fmt: skip
# keys with the one value (or absence) at which the plain decoder computes what transformers does
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "rope_scaling": (None,),
    "use_sliding_window": (False,),
    "sliding_window": (None,),  # transformers writes None without a sliding window; a number with one
    "max_window_layers": (),  # read only with a sliding window (any value)
    "layer_types": (),  # checked below: every layer full attention
    "attention_bias": (False,),  # Llama's; Qwen2's q/k/v biases are the architecture's
    "mlp_bias": (False,),
    "pretraining_tp": (1,),
    "head_dim": (),  # checked below: the default one
    "rope_parameters": (),  # checked below: the default RoPE
}


def plain_config(directory: str | Path) -> DecoderConfig | None:
    """The directory's config as a :class:`DecoderConfig` when the plain decoder computes this model exactly
    as transformers would and can read its weights; None otherwise (transformers loads it then)."""
    directory = Path(directory)
    if not (directory / WEIGHTS_FILE).is_file() or (directory / (WEIGHTS_FILE + ".index.json")).exists():
        return None
    try:
        data = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # transformers gives its own error for an unreadable config
    if not isinstance(data, dict) or data.get("model_type") not in ARCHITECTURES:
        return None
    model_type = data["model_type"]
    if data.get("architectures", [ARCHITECTURES[model_type]]) != [ARCHITECTURES[model_type]]:
        return None
    for key, value in data.items():
        if key in _FIELDS or key in _DESCRIPTIVE:
            continue
        if key not in _NEUTRAL or (_NEUTRAL[key] and value not in _NEUTRAL[key]):
            return None
    if any(t != "full_attention" for t in data.get("layer_types") or ()):
        return None
    rope = data.get("rope_parameters") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default" or set(rope) - _DEFAULT_ROPE:
        return None
    if not _REQUIRED <= set(data) or ("rope_theta" not in data and "rope_theta" not in rope):
        return None  # a default left out: transformers' defaults per architecture are not the plain config's
    fields = {k: v for k, v in data.items() if k in _FIELDS}
    if "rope_theta" in rope:  # transformers 5 keeps it there; 4 at the top level (one of _FIELDS)
        fields["rope_theta"] = rope["rope_theta"]
    try:
        config = DecoderConfig(**fields)
    except (TypeError, ValueError):
        return None
    if data.get("head_dim") not in (None, config.head_dim) or config.attention_dropout != 0:
        return None
    return config
