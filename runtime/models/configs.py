"""Named built-in model architectures: small Qwen2 / Llama configs a 2-core CPU trains in minutes.

Sizes (parameters with the 100-token char vocabulary): tiny-qwen2 and
tiny-llama ~0.4 M (2 layers, hidden 128), small-qwen2 ~3 M (4 layers, hidden
256). The vocabulary and special ids come from the tokenizer.
"""

from __future__ import annotations

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
}  # fmt: skip

MAX_POSITIONS = 1024  # prompt + response tokens; the synthetic tasks stay far below


def builtin_config(name: str, vocab_size: int, pad_id: int, bos_id: int | None, eos_id: int) -> Any:
    """A transformers config object for the built-in architecture ``name``."""
    from transformers import LlamaConfig, Qwen2Config

    if name not in BUILTIN_CONFIGS:
        raise ValueError(f"model.builtin: unknown built-in model {name!r}; choose one of {', '.join(BUILTIN_CONFIGS)}")
    params = dict(BUILTIN_CONFIGS[name])
    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[params.pop("model_type")]
    return cls(
        vocab_size=vocab_size,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        **params,
    )
