"""Which implementation computes a run's model (``model.implementation``), decided once per run and recorded.

- ``plain``: the runtime's own decoder (``runtime.models.decoder``): the built-ins, and a ``model.path``
  directory it computes exactly as transformers does (``hf_files.plain_config_or_reason``); asked for a
  directory it does not compute, a ``model.implementation`` error says why.
- ``transformers``: ``AutoModelForCausalLM`` with ``model.attn_implementation`` (sdpa by default,
  flash_attention_2 where the ``flash_attn`` package is installed); a built-in then runs as transformers'
  Qwen2 / Llama class with the same initial weights.
- ``auto``: the built-ins in the plain decoder everywhere; a directory in the plain decoder on CPU when it
  computes it (measured faster there: no transformers dispatch), in transformers otherwise and on
  accelerators (where its attention kernels are the fast path the plain decoder has not been measured
  against). The answer depends on what the model computes and the device, never on how the directory was
  saved (``plain_config_or_reason``), and the driver writes it into the resolved spec.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from runtime.models.errors import ModelError
from runtime.models.hf_files import plain_config_or_reason

IMPLEMENTATIONS = ("plain", "transformers")
ACCELERATORS = ("cuda", "npu")


class ImplementationError(ModelError):
    """``model.implementation`` / ``model.attn_implementation`` cannot act as asked (message names the field)."""


def choose_implementation(model_spec: Any, device_type: str) -> str:
    """``plain`` or ``transformers`` for ``model_spec`` (a runtime.spec.ModelSpec) on a ``device_type`` device."""
    asked = model_spec.implementation
    path = model_spec.path
    if asked == "plain":
        if path:
            found = plain_config_or_reason(path)
            if isinstance(found, str):
                raise ImplementationError(
                    f"model.implementation: the plain decoder does not compute {path} as transformers does "
                    f"({found}); use transformers or auto"
                )
        return "plain"
    if asked == "transformers":
        _check_attention(model_spec)
        return "transformers"
    if not path:
        return "plain"  # the built-ins
    if model_spec.attn_implementation is not None or device_type in ACCELERATORS:
        _check_attention(model_spec)
        return "transformers"
    return "plain" if not isinstance(plain_config_or_reason(path), str) else "transformers"


def _check_attention(model_spec: Any) -> None:
    if model_spec.attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ImplementationError(
            "model.attn_implementation: flash_attention_2 needs the flash_attn package, which is not installed "
            "here; use sdpa"
        )


def pinned(model_spec: Any, device_type: str) -> Any:
    """``model_spec`` with ``implementation`` set to what :func:`choose_implementation` gives (a copy)."""
    return model_spec.model_copy(update={"implementation": choose_implementation(model_spec, device_type)})
