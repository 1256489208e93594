"""The built-in models as plain PyTorch: a Qwen2 / Llama causal decoder without transformers.

Importing transformers' model classes costs a run seconds of start-up (they pull in
torch.distributed.tensor, sympy and torch._dynamo), which a 0.4 M-parameter model does not need. This
module is the same network with Hugging Face's module tree and parameter names (``model.embed_tokens``,
``model.layers[i].self_attn.q_proj``, ..., ``lm_head`` tied to the embedding), so state dicts, FSDP's
per-layer wrapping (``model.layers``), FastRunner's fused weights, vLLM and the HF export see what they
saw before. Its forward computes what transformers' SDPA path computes, operation for operation (the
same mask and kernel choices), so logits agree bit for bit; :func:`init_weights` draws the same initial
weights for the same seed. ``runtime.models.hf_files`` writes it as an HF directory.

Calling convention (what the trainer, the critic and the engines pass): ``input_ids [B, T]``, a 2-D
``attention_mask`` (1 at real tokens, covering the cache's columns and these), ``position_ids``,
``cache`` (a :class:`KVCache`, continued in place), ``use_cache``, ``logits_to_keep``. Without an
``attention_mask`` and with ``position_ids`` restarting at 0 inside a row, the row is several sequences
packed one after another (the trainer's packed layout): each attends only to itself, as transformers' SDPA
path reads the same inputs. A 4-D boolean ``attention_mask`` ``[B, 1, T, past + T]`` is used as given (True
where attended), as transformers uses a prepared one: the packed layout's rows of a prompt shared by several
responses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from runtime.models.configs import DecoderConfig
from runtime.models.kv_cache import KVCache, causal_mask, packed_causal_mask


@dataclass
class BackboneOutput:
    last_hidden_state: Tensor
    cache: KVCache | None = None

    @property
    def past_key_values(self) -> KVCache | None:  # transformers 4's name for it
        return self.cache


@dataclass
class CausalLMOutput:
    logits: Tensor
    cache: KVCache | None = None

    @property
    def past_key_values(self) -> KVCache | None:
        return self.cache


class RMSNorm(nn.Module):
    """Normalised in float32, cast back, then scaled (as Llama / Qwen2 do)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """``(x, position_ids) -> (cos, sin)`` tables ``[B, T, head_dim]`` in x's dtype (the default RoPE).

    ``inv_freq`` is float32 and not saved (rebuilt from the config: ``RotaryEmbedding(config)``, which
    ``PublishedPolicy`` relies on for a meta-device skeleton).
    """

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        dim = config.head_dim
        # On the meta device (a skeleton) computed on the host: a meta arange runs torch's Python reference,
        # which imports sympy and more (start-up); the skeleton's owner rebuilds this module anyway.
        where = "cpu" if _building_on_meta() else None
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=where) / dim))
        self.inv_freq: Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    b, n_kv, t, d = x.shape
    return x[:, :, None].expand(b, n_kv, groups, t, d).reshape(b, n_kv * groups, t, d)


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """Grouped-query attention ``[B, heads, T, d]`` through SDPA, choosing as transformers' SDPA path does
    (same kernels, same rounding): without a mask SDPA's own GQA and ``is_causal`` for T > 1; with one a
    single query folds its head groups into the query axis, and longer queries repeat k/v per head."""
    b, heads, t, d = q.shape
    groups = heads // k.shape[1]
    kwargs: dict[str, Any] = {}
    if groups > 1:
        if mask is None:
            kwargs["enable_gqa"] = True
        elif t == 1:
            q = q.reshape(b, heads // groups, groups, d)
        else:
            k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale, is_causal=t > 1 and mask is None, **kwargs
    )
    return out.reshape(b, -1, t, d)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig, layer_idx: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5  # FastRunner reads it
        h, q_out = config.hidden_size, config.num_attention_heads * self.head_dim
        kv_out = config.num_key_value_heads * self.head_dim
        bias = config.qkv_bias
        # construction order = parameter order = the order the initial weights are drawn in
        self.q_proj = nn.Linear(h, q_out, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(h, kv_out, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(h, kv_out, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(q_out, h, bias=False, dtype=dtype)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache: KVCache | None) -> Tensor:
        b, t = x.shape[:2]
        shape = (b, t, -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out = sdpa(q, k, v, mask, self.scaling).transpose(1, 2).contiguous()
        return self.o_proj(out.reshape(b, t, -1).contiguous())


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig, dtype: torch.dtype | None = None):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(h, i, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=False, dtype=dtype)
        self.act_fn = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, layer_idx: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.self_attn = Attention(config, layer_idx, dtype)
        self.mlp = MLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.gradient_checkpointing = False
        # set by activation_checkpointing_enable (transformers' attribute name: tests wrap it to count calls)
        self._gradient_checkpointing_func: Callable[..., Tensor] | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache: KVCache | None) -> Tensor:
        # Checkpointed inside forward, not around the module call, so module hooks (FSDP2's all-gather) stay
        # outside the recomputation. A recomputed layer must not write the cache twice: no cache then (the
        # trainer does not use one with checkpointing).
        run = self._gradient_checkpointing_func
        if self.gradient_checkpointing and run is not None and self.training and torch.is_grad_enabled():
            return run(self._block, x, cos, sin, mask, None)
        return self._block(x, cos, sin, mask, cache)

    def _block(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache: KVCache | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Checkpointable:
    """``activation_checkpointing_enable`` under transformers' name and signature (train/parallel.py calls it)."""

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict[str, Any] | None = None) -> None:
        run = functools.partial(checkpoint, **(activation_checkpointing_kwargs or {"use_reentrant": False}))
        for layer in self.modules():  # type: ignore[attr-defined]
            if isinstance(layer, DecoderLayer):
                layer.gradient_checkpointing, layer._gradient_checkpointing_func = True, run

    def activation_checkpointing_disable(self) -> None:
        for layer in self.modules():  # type: ignore[attr-defined]
            if isinstance(layer, DecoderLayer):
                layer.gradient_checkpointing = False

    @property
    def is_gradient_checkpointing(self) -> bool:
        return any(getattr(m, "gradient_checkpointing", False) for m in self.modules())  # type: ignore[attr-defined]


def _building_on_meta() -> bool:
    """Whether modules are being built on the meta device (``with torch.device("meta")``: a skeleton)."""
    return torch.empty(0).is_meta


def _embedding(rows: int, width: int, padding_idx: int | None, dtype: torch.dtype | None) -> nn.Embedding:
    """``nn.Embedding``; built on the meta device (a skeleton) without its default initialisation: a meta
    ``normal_`` runs torch's Python reference of it, which imports ``torch._dynamo`` (a second of start-up).
    Elsewhere its default draws stay: they keep the random stream, and so the weights, transformers'."""
    if _building_on_meta():
        return nn.Embedding(rows, width, padding_idx, _weight=torch.empty(rows, width, dtype=dtype))
    return nn.Embedding(rows, width, padding_idx, dtype=dtype)


class DecoderModel(_Checkpointable, nn.Module):
    """The backbone (HF's ``Qwen2Model`` / ``LlamaModel``): embeddings, layers, final norm -> hidden states."""

    def __init__(self, config: DecoderConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = _embedding(config.vocab_size, config.hidden_size, config.pad_token_id, dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(config)

    @property
    def base_model(self) -> DecoderModel:
        return self

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: KVCache | None = None,
        use_cache: bool = False,
    ) -> BackboneOutput:
        x = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = KVCache()
        past = cache.get_seq_length() if cache is not None else 0
        mask: Tensor | None
        if attention_mask is not None and attention_mask.dim() == 4:
            mask = attention_mask  # prepared ([B, 1, T, past + T], True where attended), as transformers takes one
        elif attention_mask is None and position_ids is not None and past == 0 and x.shape[1] > 1:
            mask = packed_causal_mask(position_ids.expand(x.shape[0], -1))  # sequences packed into rows
        else:
            mask = causal_mask(attention_mask, x.shape[0], x.shape[1], past, x.device)
        if position_ids is None:
            position_ids = (torch.arange(x.shape[1], device=x.device) + past)[None]
        cos, sin = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache)
        return BackboneOutput(self.norm(x), cache if use_cache else None)


class DecoderForCausalLM(_Checkpointable, nn.Module):
    """The policy (HF's ``Qwen2ForCausalLM`` / ``LlamaForCausalLM``): the backbone plus the LM head.

    ``DecoderForCausalLM(config)`` under ``torch.device("meta")`` is a storage-less skeleton (the weights
    are not drawn there); elsewhere the weights are initialised as :func:`init_weights` says.
    """

    def __init__(self, config: DecoderConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, dtype)
        initialise = not self.model.embed_tokens.weight.is_meta
        if initialise:
            init_weights(self.model, config.initializer_range)
        tied = config.tie_word_embeddings
        # A tied head is the embedding: built without storage or random draws, then pointed at it.
        self.lm_head = nn.Linear(
            config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device="meta" if tied else None
        )
        if tied:
            self.tie_weights()
        elif initialise:
            init_weights(self.lm_head, config.initializer_range)

    @property
    def base_model(self) -> DecoderModel:
        return self.model

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: KVCache | None = None,
        use_cache: bool = False,
        logits_to_keep: int | Tensor = 0,
    ) -> CausalLMOutput:
        """``logits_to_keep``: an int keeps the last that many positions (0: all), a 1-D tensor those columns."""
        out = self.model(input_ids, attention_mask, position_ids, cache, use_cache)
        hidden = out.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return CausalLMOutput(self.lm_head(hidden[:, keep, :]), out.cache)

    def save_pretrained(
        self, directory: Any, safe_serialization: bool = True, state_dict: dict[str, Tensor] | None = None
    ) -> None:
        """An HF model directory (config.json, generation_config.json, model.safetensors) of the model's
        weights, or of ``state_dict`` (transformers' ``save_pretrained`` argument of that name)."""
        from runtime.models.hf_files import save_directory

        save_directory(self, directory, state_dict)


@torch.no_grad()
def init_weights(module: nn.Module, std: float) -> None:
    """Draw ``module``'s weights as transformers' ``from_config`` does, from the global RNG.

    transformers builds the modules (torch's default initialisation draws from the RNG), then redraws
    every Linear and Embedding weight from N(0, initializer_range) in module order, zeroing biases and
    the padding row; norms stay at one. The tied LM head is built and drawn after the backbone and then
    replaced by the embedding, so its draws change nothing kept. Doing the same draws in the same order
    gives bit-identical weights for a seed (tests/runtime/models/test_decoder.py checks it).
    """
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m.weight.normal_(mean=0.0, std=std)
            if m.bias is not None:
                m.bias.zero_()
        elif isinstance(m, nn.Embedding):
            m.weight.normal_(mean=0.0, std=std)
            if m.padding_idx is not None:
                m.weight[m.padding_idx].zero_()
