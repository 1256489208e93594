"""Build or load the policy: a built-in decoder or a Hugging Face causal LM plus its tokenizer, and save
it back in HF format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from runtime.contract import ADAPTER_DIR
from runtime.models.configs import DecoderConfig, builtin_config
from runtime.models.decoder import DecoderForCausalLM
from runtime.models.errors import ModelError
from runtime.models.hf_files import WEIGHTS_FILE, plain_config, weight_files
from runtime.models.implementation import choose_implementation
from runtime.models.lora import apply_lora, is_lora, load_adapter, merged_state, save_adapter
from runtime.models.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_model_path(path: str | Path) -> Path:
    """Fail early, before any work starts, when ``model.path`` is not a loadable HF directory."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelError(f"model.path: no such model directory: {p}")
    if not (p / "config.json").is_file():
        raise ModelError(f"model.path: {p} has no config.json (not a Hugging Face model directory)")
    return p


def plain_decoder(config: DecoderConfig, dtype: torch.dtype) -> DecoderForCausalLM:
    """The plain decoder of ``config`` with parameters in ``dtype`` (recorded in its config, as config.json
    records it). Built under ``torch.device("meta")`` it is a storage-less skeleton; elsewhere its weights
    are drawn from the global RNG."""
    return DecoderForCausalLM(config.replace(dtype=str(dtype).removeprefix("torch.")), dtype=dtype)


def build_builtin(name: str, dtype: torch.dtype, tokenizer: CharTokenizer) -> DecoderForCausalLM:
    """The built-in architecture ``name`` as the plain decoder (weights drawn from the global RNG)."""
    config = builtin_config(name, tokenizer.vocab_size, tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id)
    return plain_decoder(config, dtype)


def load_checkpoint(
    path: Path, dtype: torch.dtype, implementation: str = "auto", attn_implementation: str | None = None
) -> Any:
    """An HF model directory in ``implementation``: the plain decoder (``auto``: where it computes the model
    exactly as transformers does, ``hf_files.plain_config``), or transformers' ``from_pretrained
    (local_files_only=True)`` with ``attn_implementation`` (its default when None)."""
    if implementation != "transformers":
        config = plain_config(path)
        if config is not None:
            return load_directory(path, config, dtype)
        if implementation == "plain":
            raise ValueError(f"{path} is not a model the plain decoder computes (model.implementation: plain)")
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype, **kwargs)


def transformers_builtin(config: DecoderConfig, dtype: torch.dtype, attn_implementation: str | None) -> Any:
    """A built-in architecture as transformers' Qwen2 / Llama class (weights drawn from the global RNG, the
    same draws the plain decoder makes for a seed)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.to_dict().items() if k not in ("architectures", "dtype", "model_type")}
    hf_config = AutoConfig.for_model(config.model_type, **fields)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return AutoModelForCausalLM.from_config(hf_config, dtype=dtype, **kwargs)


def load_directory(directory: str | Path, config: DecoderConfig, dtype: torch.dtype) -> DecoderForCausalLM:
    """The plain decoder with ``directory``'s weights in ``dtype`` (``config`` from ``hf_files.plain_config``).
    Raises ValueError when the weights are not the ones ``config`` describes."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for part in weight_files(directory):  # one file, or the shards of an index
        state.update(load_file(str(part)))
    with torch.device("meta"):
        model = plain_decoder(config, dtype)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # transformers ties it to the embedding whatever the file holds
    expected = {k for k in model.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unknown:
        raise ValueError(f"{WEIGHTS_FILE} does not fit its config.json: missing {missing[:5]}, unknown {unknown[:5]}")
    for name, tensor in state.items():
        want = model.get_parameter(name).shape
        if tensor.shape != want:
            raise ValueError(f"{WEIGHTS_FILE}: {name} is {tuple(tensor.shape)}, config.json says {tuple(want)}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    model.tie_weights()
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config)  # its frequencies are computed, not saved: off the meta device
    return model


def build_policy(model_spec: Any, device: torch.device | str, seed: int = 0) -> tuple[Any, CharTokenizer | HFTokenizer]:
    """The policy model and tokenizer described by ``model_spec`` (a runtime.spec.ModelSpec), on ``device``.

    ``model.implementation`` picks the plain decoder or transformers (``runtime.models.implementation``).
    With ``path`` set the directory is loaded by :func:`load_checkpoint`; otherwise the named built-in
    architecture (the plain decoder, ``runtime.models.decoder``: no transformers import, unless transformers
    is asked for) is initialised from ``seed`` without disturbing the global RNG, with the weights
    transformers would draw for that seed.
    """
    dtype = DTYPES[model_spec.dtype]
    model: Any  # a transformers PreTrainedModel or a DecoderForCausalLM
    attention = model_spec.attn_implementation
    if model_spec.path:
        path = check_model_path(model_spec.path)
    implementation = choose_implementation(model_spec, torch.device(device).type)
    if model_spec.path:
        try:
            tokenizer = CharTokenizer() if model_spec.tokenizer == "char" else load_tokenizer(path)
        except ValueError as exc:
            raise ModelError(str(exc)) from None
        try:
            model = load_checkpoint(path, dtype, implementation, attention)
        except (OSError, ValueError) as exc:
            raise ModelError(f"model.path: cannot load {path}: {exc}") from None
    else:
        tokenizer = CharTokenizer()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if implementation == "transformers":
                config = builtin_config(
                    model_spec.builtin, tokenizer.vocab_size, tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id
                )
                model = transformers_builtin(config.replace(dtype=str(dtype).removeprefix("torch.")), dtype, attention)
            else:
                model = build_builtin(model_spec.builtin, dtype, tokenizer)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ModelError(
            f"model.tokenizer: tokenizer has {tokenizer.vocab_size} tokens but the model only {model.config.vocab_size}"
        )
    if model_spec.lora is not None:
        with torch.random.fork_rng(devices=[]):  # every process draws the same initial adapters
            torch.manual_seed(seed)
            apply_lora(model, model_spec.lora)
        if model_spec.lora.init_path:
            load_adapter(model, model_spec.lora.init_path)
    return model.to(device), tokenizer


def save_hf(
    model: Any, tokenizer: CharTokenizer | HFTokenizer, directory: str | Path, base_model: str | None = None
) -> Path:
    """Save ``model`` (safetensors + config) and ``tokenizer`` so transformers, vLLM and build_policy load it.

    A model with LoRA adapters is saved merged (a plain model of the base architecture), and its adapters
    beside it in ``adapter/`` as a PEFT adapter directory for ``base_model`` (the base it adapts)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if is_lora(model):
        model.save_pretrained(str(directory), safe_serialization=True, state_dict=merged_state(model))
        save_adapter(model, directory / ADAPTER_DIR, base_model)
    else:
        model.save_pretrained(str(directory), safe_serialization=True)
    tokenizer.save(directory)
    return directory
