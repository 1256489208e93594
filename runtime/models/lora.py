"""LoRA adapters on the policy (``model.lora``), through peft.

peft's LoRA layers are injected into the model in place (:func:`apply_lora`): every targeted ``nn.Linear``
becomes a ``lora.Linear`` holding the frozen base layer and the adapter's ``lora_A`` / ``lora_B``, and only
the adapters keep ``requires_grad``. The module tree and every other name stay as they were, so the
trainer's parallel wrappers, the engine and the checkpoint code see the same model with a few more
parameters:

- training and its optimizer: the parameters that require gradients, which are the adapters;
- the KL reference: the same module with its adapters switched off (:func:`adapters_disabled`), no copy;
- weight sync and checkpoints: the adapter tensors only (:func:`adapter_state`), under the model's own
  state-dict names, so an engine whose model was built from the same spec loads them by name;
- the HF export: the merged weights under the base model's names (:func:`merged_state`) and a PEFT adapter
  directory (:func:`save_adapter`) that ``peft.PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` read.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from runtime.models.errors import ModelError

ADAPTER = "default"  # peft's adapter name; one adapter per model
_ADAPTER_PARTS = (".lora_A.", ".lora_B.")
PEFT_PREFIX = "base_model.model."  # how a PEFT adapter file names a parameter of the model it adapts


def _config_of(model: nn.Module) -> Any:
    """The ``LoraConfig`` peft's injection recorded on the model."""
    return getattr(model, "peft_config")[ADAPTER]  # noqa: B009  # an attribute nn.Module's typing does not know


def lora_config(spec: Any) -> Any:
    """peft's ``LoraConfig`` for a ``runtime.spec.LoraSpec``."""
    from peft import LoraConfig

    return LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        bias="none",
    )


def _adaptable(model: nn.Module) -> list[str]:
    """The names of the linear layers an adapter may target: all but the LM head (often tied to the
    embedding, and computed outside the engine's fused decoder layers)."""
    return [
        name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] != "lm_head"
    ]


def linear_names(model: nn.Module) -> list[str]:
    """The distinct last name parts of the linear layers adapters may target (``q_proj``, ...)."""
    return sorted({name.rsplit(".", 1)[-1] for name in _adaptable(model)})


def check_targets(model: nn.Module, spec: Any) -> None:
    """Each of ``spec.target_modules`` must name at least one adaptable linear layer of ``model`` (peft
    itself only refuses a list of which none matches)."""
    linear = _adaptable(model)
    for target in spec.target_modules:
        if not any(name == target or name.endswith("." + target) for name in linear):
            raise ModelError(
                f"model.lora.target_modules: {target!r} matches no linear layer of the model; its linear layers "
                f"are {', '.join(linear_names(model))}"
            )


def apply_lora(model: nn.Module, spec: Any) -> nn.Module:
    """Inject LoRA adapters described by ``spec`` into ``model`` in place and freeze everything else.

    The adapters' initial ``A`` is drawn from the global RNG (``B`` is zero, so the model computes the base
    model's function until it trains): callers seed it so that every process builds the same adapters.
    """
    from peft import inject_adapter_in_model

    check_targets(model, spec)
    inject_adapter_in_model(lora_config(spec), model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_key(name))
    return model


def inject_like(source: nn.Module, target: nn.Module) -> None:
    """Give ``target`` (a model of ``source``'s architecture, e.g. an empty shell on the meta device) the
    same LoRA layers as ``source``."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(copy.deepcopy(_config_of(source)), target, adapter_name=ADAPTER)


def adapter_layers(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """``(name, layer)`` of every LoRA layer in ``model``. peft is not imported for a model without: importing
    it imports transformers' model classes (seconds), and nothing can hold its layers before it is imported."""
    if "peft" not in sys.modules:
        return
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def is_lora(model: nn.Module) -> bool:
    return next(adapter_layers(model), None) is not None


def is_adapter_key(name: str) -> bool:
    """Whether a parameter / state-dict name is an adapter's."""
    return any(part in name for part in _ADAPTER_PARTS)


def adapter_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The adapter entries of a model state dict (the model's own names)."""
    return {k: v for k, v in state.items() if is_adapter_key(k)}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model: every LoRA layer computes its base layer alone while inside.

    Sets peft's flag directly rather than through ``enable_adapters(False)``, which also flips the
    adapters' ``requires_grad``: DDP and FSDP2 registered those parameters as trained when they wrapped them.
    """
    layers = [layer for _, layer in adapter_layers(model)]
    before = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, was in zip(layers, before, strict=True):
            layer._disable_adapters = was


def _on_cpu(tensor: Tensor) -> Tensor:
    """A tensor's value on the CPU (the HF export reads an unsharded module: no fsdp shards here)."""
    return tensor.detach().to("cpu")


def merged_weight(layer: Any) -> Tensor:
    """A LoRA layer's base weight with its active adapters merged in (``W + scaling * B A``, computed in float32
    by one ``addmm`` per adapter), a new tensor in the weight's dtype; the base weight itself when its adapters
    are off."""
    weight = layer.get_base_layer().weight
    if layer.disable_adapters:
        return weight
    merged = weight.detach().float()
    for name in layer.active_adapters:
        a, b = layer.lora_A[name].weight.detach().float(), layer.lora_B[name].weight.detach().float()
        scale = layer.scaling[name]
        if getattr(layer, "fan_in_fan_out", False):  # the base stores W transposed
            merged = torch.addmm(merged, a.T, b.T, alpha=scale)
        else:
            merged = torch.addmm(merged, b, a, alpha=scale)
    return merged.to(weight.dtype)


def merged_state(model: nn.Module) -> dict[str, Tensor]:
    """The model's weights with the adapters merged in, under the base model's names, on the CPU: what a
    model without adapters loads (an unsharded module: with fsdp, ``ParallelModel.unsharded``'s). The base
    weights themselves are not modified."""
    layers = dict(adapter_layers(model))
    state: dict[str, Tensor] = {}
    for key, value in model.state_dict().items():
        if is_adapter_key(key):
            continue
        owner, _, leaf = key.rpartition(".base_layer.")
        if not owner:
            state[key] = _on_cpu(value)
            continue
        state[f"{owner}.{leaf}"] = _on_cpu(merged_weight(layers[owner]) if leaf == "weight" else value)
    return state


def peft_adapter_state(adapters: dict[str, Tensor]) -> dict[str, Tensor]:
    """Adapter tensors under the names a PEFT adapter file uses (``base_model.model.<module>.lora_A.weight``)."""
    return {_peft_name(key): _on_cpu(value).contiguous() for key, value in adapters.items()}


def _peft_name(key: str) -> str:
    """A model state-dict name of an adapter tensor as a PEFT adapter file names it (no adapter name, prefixed)."""
    return PEFT_PREFIX + key.replace(f".{ADAPTER}.", ".")


def save_adapter(model: nn.Module, directory: str | Path, base_model: str | None = None) -> Path:
    """Write the model's adapters as a PEFT adapter directory, which ``peft.PeftModel.from_pretrained`` and
    vLLM's ``LoRARequest`` load onto the base model."""
    config = _config_of(model)
    return write_adapter(directory, config, adapter_state(model.state_dict()), base_model)


def write_adapter(
    directory: str | Path, config: Any, adapters: dict[str, Tensor], base_model: str | None = None
) -> Path:
    """A PEFT adapter directory: ``adapter_config.json`` (peft's own ``LoraConfig``, for a causal LM over
    ``base_model``) and ``adapter_model.safetensors`` (``adapters``, a model state dict's adapter entries)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(config)
    config.base_model_name_or_path = base_model
    config.task_type = "CAUSAL_LM"
    config.save_pretrained(str(directory))
    save_file(peft_adapter_state(adapters), str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    return directory


def load_adapter(model: nn.Module, directory: str | Path) -> None:
    """Start the model's adapters from a PEFT adapter directory (:func:`save_adapter`'s, on the same base):
    ``model.lora.init_path``. The adapters must be the ones ``model.lora`` describes (rank, scale, targets)."""
    from safetensors.torch import load_file

    field = "model.lora.init_path"
    directory = Path(directory)
    weights, config_file = directory / "adapter_model.safetensors", directory / "adapter_config.json"
    if not weights.is_file() or not config_file.is_file():
        raise ModelError(
            f"{field}: {directory} is not a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)"
        )
    saved = json.loads(config_file.read_text())
    config = _config_of(model)
    for key, want in (("r", config.r), ("lora_alpha", config.lora_alpha)):
        if saved.get(key) != want:
            raise ModelError(f"{field}: the adapter has {key} {saved.get(key)!r}, model.lora asks for {want!r}")
    tensors = load_file(str(weights))
    own = adapter_state(model.state_dict())
    names = {_peft_name(key): key for key in own}
    missing, unknown = sorted(set(names) - set(tensors)), sorted(set(tensors) - set(names))
    if missing or unknown:
        raise ModelError(
            f"{field}: the adapter does not fit model.lora.target_modules on this model: missing {missing[:3]}, "
            f"unexpected {unknown[:3]}"
        )
    with torch.no_grad():
        for name, key in names.items():
            if tensors[name].shape != own[key].shape:
                raise ModelError(f"{field}: {name} is {tuple(tensors[name].shape)}, expected {tuple(own[key].shape)}")
            own[key].copy_(tensors[name])


def state_bytes(state: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())
