"""Named built-in model architectures: small Qwen2 / Llama configs a 2-core CPU trains in minutes.

Sizes (parameters with the 100-token char vocabulary): tiny-qwen2 and
tiny-llama ~0.4 M (2 layers, hidden 128), small-qwen2 ~3 M (4 layers, hidden
256), medium-qwen2 ~12.6 M (8 layers, hidden 384, head_dim 64: a step is matrix multiplies, not
dispatch). The vocabulary and special ids come from the tokenizer.

:class:`DecoderConfig` is what the plain decoder (``runtime.models.decoder``) reads, with the attribute
names of transformers' ``Qwen2Config`` / ``LlamaConfig`` (FastRunner, the engine and the critic read
those names). :meth:`DecoderConfig.to_dict` is the ``config.json`` transformers writes for the same model,
key for key, so an exported built-in loads in transformers and vLLM as a ``Qwen2ForCausalLM`` /
``LlamaForCausalLM``. No transformers import: a built-in run never loads it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-qwen2": dict(
        model_type="qwen2", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=384,
    ),
    "tiny-llama": dict(
        model_type="llama", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=384,
    ),
    "small-qwen2": dict(
        model_type="qwen2", hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, intermediate_size=768,
    ),
    # Where compute dominates a step on CPU: head_dim 64 as in Qwen2.5, 12.6 M parameters.
    "medium-qwen2": dict(
        model_type="qwen2", hidden_size=384, num_hidden_layers=8, num_attention_heads=6,
        num_key_value_heads=2, intermediate_size=1024,
    ),
}  # fmt: skip

MAX_POSITIONS = 1024  # prompt + response tokens; the synthetic tasks stay far below

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


@dataclass
class DecoderConfig:
    """A Qwen2- or Llama-style causal decoder. Defaults are transformers' for both (the built-ins set the rest).

    Qwen2 has biases on q/k/v (not o); Llama none. ``dtype``: the parameters' dtype name, written to
    config.json as transformers does.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = MAX_POSITIONS
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    hidden_act: str = "silu"
    attention_dropout: float = 0.0
    use_cache: bool = True
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise ValueError(
                f"DecoderConfig: model_type must be one of {', '.join(ARCHITECTURES)}, not {self.model_type!r}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"DecoderConfig: only the silu activation is built in, not {self.hidden_act!r}")

    # What FastRunner and the modules read, fixed for these architectures.
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention"] * self.num_hidden_layers  # no sliding-window layers

    @property
    def pretraining_tp(self) -> int:
        return 1

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2"

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` transformers writes for this model (its non-default keys, sorted)."""
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "attention_dropout": self.attention_dropout,
            "bos_token_id": self.bos_token_id,
            "dtype": self.dtype,
            "eos_token_id": self.eos_token_id,
            "hidden_act": self.hidden_act,
            "hidden_size": self.hidden_size,
            "initializer_range": self.initializer_range,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "model_type": self.model_type,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "pad_token_id": self.pad_token_id,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_cache": self.use_cache,
            "vocab_size": self.vocab_size,
        }
        if self.model_type == "qwen2":  # Qwen2Config's own fields (no sliding window)
            out.update(
                layer_types=self.layer_types, max_window_layers=28, sliding_window=None, use_sliding_window=False
            )
        else:  # LlamaConfig's
            out.update(attention_bias=False, head_dim=self.head_dim, mlp_bias=False, pretraining_tp=1)
        version = _transformers_version()
        if version is not None:
            out["transformers_version"] = version
        return dict(sorted(out.items()))

    def generation_dict(self) -> dict[str, Any]:
        """The ``generation_config.json`` transformers writes beside it (vLLM reads the stop ids there)."""
        out: dict[str, Any] = {
            "_from_model_config": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "output_attentions": False,
            "output_hidden_states": False,
            "pad_token_id": self.pad_token_id,
            "use_cache": self.use_cache,
        }
        version = _transformers_version()
        if version is not None:
            out["transformers_version"] = version
        return dict(sorted(out.items()))

    def replace(self, **changes: Any) -> DecoderConfig:
        return dataclasses.replace(self, **changes)


def _transformers_version() -> str | None:
    """The installed transformers' version, read from its metadata (no import): config.json records it."""
    from importlib import metadata

    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def builtin_config(name: str, vocab_size: int, pad_id: int, bos_id: int | None, eos_id: int) -> DecoderConfig:
    """The config of the built-in architecture ``name``."""
    if name not in BUILTIN_CONFIGS:
        raise ValueError(f"model.builtin: unknown built-in model {name!r}; choose one of {', '.join(BUILTIN_CONFIGS)}")
    return DecoderConfig(
        vocab_size=vocab_size,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        **BUILTIN_CONFIGS[name],
    )
