"""The plain decoder written as, and read from, a Hugging Face model directory, without transformers.

Writing: what ``PreTrainedModel.save_pretrained(dir, safe_serialization=True)`` writes for the same
model: ``config.json`` (``DecoderConfig.to_dict`` with the parameters' dtype), ``generation_config.json``
and ``model.safetensors`` (metadata ``{"format": "pt"}``; a tied ``lm_head.weight`` left out, as
transformers leaves it, which re-ties it on load). transformers, vLLM and ``build_policy`` load it.

Reading (:func:`plain_config`; ``runtime.models.loading.load_directory`` loads the weights): a
``model.path`` directory whose config.json is one the plain decoder computes exactly as transformers does — a Qwen2 or Llama decoder with the default
RoPE, SiLU, no sliding window, biases where the architecture has them, every key known — and whose
weights are safetensors (one ``model.safetensors`` or its shards). The built-ins' exports, SFT checkpoints
(the demo's model), and Qwen2.5 and TinyLlama as published are such directories; anything else (another
architecture, RoPE scaling, a key this module does not know) needs transformers, so nothing is ever
computed differently. ``runtime.models.implementation`` decides which of the two a run uses.
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


def save_directory(model: Any, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``model`` (a ``DecoderForCausalLM``; its weights, or ``state_dict`` under its names) into
    ``directory``; returns it."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config.replace(dtype=str(model.dtype).removeprefix("torch."))
    _write_json(directory / CONFIG_FILE, config.to_dict())
    _write_json(directory / GENERATION_FILE, config.generation_dict())
    state = dict(model.state_dict() if state_dict is None else state_dict)
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


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files holding the directory's weights: ``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` names; [] when it has neither."""
    directory = Path(directory)
    index = directory / (WEIGHTS_FILE + ".index.json")
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return []
        files = [directory / name for name in shards]
        return files if all(f.is_file() and f.parent == directory for f in files) else []
    return [directory / WEIGHTS_FILE] if (directory / WEIGHTS_FILE).is_file() else []


def plain_config(directory: str | Path) -> DecoderConfig | None:
    """The directory's config as a :class:`DecoderConfig` when the plain decoder computes this model exactly
    as transformers would and can read its weights; None otherwise (transformers loads it then)."""
    found = plain_config_or_reason(directory)
    return found if isinstance(found, DecoderConfig) else None


def plain_config_or_reason(directory: str | Path) -> DecoderConfig | str:
    """:func:`plain_config`, or why the plain decoder does not compute this directory's model.

    Only what the model computes decides, never how the directory was saved: a single weights file or
    shards, and a ``sliding_window`` size beside ``use_sliding_window: false`` (as Qwen2.5 is published;
    transformers re-saves it as null) give the same answer.
    """
    directory = Path(directory)
    if not weight_files(directory):
        return f"no {WEIGHTS_FILE} (or a complete safetensors index): the plain decoder reads safetensors only"
    try:
        data = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"{CONFIG_FILE} is unreadable ({exc})"
    if not isinstance(data, dict) or data.get("model_type") not in ARCHITECTURES:
        kind = data.get("model_type") if isinstance(data, dict) else None
        return f"model_type {kind!r} is not one of {', '.join(ARCHITECTURES)}"
    model_type = data["model_type"]
    if data.get("architectures", [ARCHITECTURES[model_type]]) != [ARCHITECTURES[model_type]]:
        return f"architectures {data.get('architectures')} is not [{ARCHITECTURES[model_type]}]"
    windowed = bool(data.get("use_sliding_window", False))
    for key, value in data.items():
        if key in _FIELDS or key in _DESCRIPTIVE:
            continue
        if key == "sliding_window" and not windowed:
            continue  # read only with use_sliding_window: any size, or null, computes the same
        if key not in _NEUTRAL or (_NEUTRAL[key] and value not in _NEUTRAL[key]):
            return f"{key}={value!r} in {CONFIG_FILE} is not computed by the plain decoder"
    if any(t != "full_attention" for t in data.get("layer_types") or ()):
        return "some layers are not full attention"
    rope = data.get("rope_parameters") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default" or set(rope) - _DEFAULT_ROPE:
        return f"rope_parameters {rope!r} are not the default RoPE"
    if not _REQUIRED <= set(data) or ("rope_theta" not in data and "rope_theta" not in rope):
        # a default left out: transformers' defaults per architecture are not the plain config's
        return f"{CONFIG_FILE} leaves out {sorted(_REQUIRED - set(data)) or ['rope_theta']}"
    fields = {k: v for k, v in data.items() if k in _FIELDS}
    if "rope_theta" in rope:  # transformers 5 keeps it there; 4 at the top level (one of _FIELDS)
        fields["rope_theta"] = rope["rope_theta"]
    try:
        config = DecoderConfig(**fields)
    except (TypeError, ValueError) as exc:
        return str(exc)
    if data.get("head_dim") not in (None, config.head_dim) or config.attention_dropout != 0:
        return "a head_dim other than hidden_size / num_attention_heads, or attention dropout"
    return config
