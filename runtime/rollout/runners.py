"""Forward passes for the generation engine: prefill a left-padded batch, then decode one token per step.

Two runners share one interface (``start``, ``prefill``, ``decode``):

- :class:`FastRunner`, for Llama-family models (``llama``, ``qwen2``): the same parameters and the
  same math as the model's modules (RMSNorm, rotary tables from the model's own module, q/k/v/o,
  gated MLP, lm_head), written as a lean loop: a preallocated static KV cache, q/k/v and gate/up each
  one matmul, masks built once per step, no per-step module dispatch. That skips what makes
  ``model.generate()`` slow on small models — per-step mask construction, cache concatenation,
  logits processors — and log-probabilities still agree with the trainer's to float rounding.
- :class:`HFRunner`, for any other causal LM: the model's full forward with a transformers DynamicCache.

Masks are per row (``key_valid [B, S]``) and positions are per row, so a later continuous-batching
engine can refill a finished row with a new prompt without changing the runners.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F

FAST_MODEL_TYPES = ("llama", "qwen2")


def make_runner(model: Any) -> FastRunner | HFRunner:
    """The fast runner when the architecture is one it knows, otherwise the generic one."""
    return FastRunner(model) if FastRunner.supports(model) else HFRunner(model)


class _Layer:
    """One decoder layer's weights, with q/k/v and gate/up concatenated so each is one matmul."""

    def __init__(self, layer: Any):
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1 = (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
        self.ln2 = (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.qkv_w = torch.cat([m.weight for m in projs])
        self.qkv_b = torch.cat([m.bias for m in projs]) if projs[0].bias is not None else None
        self.o_w, self.o_b = attn.o_proj.weight, attn.o_proj.bias
        self.gate_up_w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        self.gate_up_b = torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias]) if mlp.gate_proj.bias is not None else None
        self.down_w, self.down_b = mlp.down_proj.weight, mlp.down_proj.bias
        self.act = mlp.act_fn


def _rms_norm(x: torch.Tensor, weight_eps: tuple[torch.Tensor, float]) -> torch.Tensor:
    # The transformers Llama/Qwen2 RMSNorm: normalise in float32, cast back, then scale.
    weight, eps = weight_eps
    xf = x.float()  # a no-op in float32; written out because it beats F.rms_norm on small CPU batches
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding as transformers' Llama/Qwen2 apply it: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class FastRunner:
    """Static-KV-cache decode loop over a Llama-family model's parameters.

    It reads the model's parameters at every ``start`` (a batch boundary), concatenating q/k/v and
    gate/up weights so a layer costs four matmuls; the rotary embedding is the model's own module,
    evaluated once per batch for every position. Nothing is cached across batches, so a co-located
    trainer's in-place updates are picked up at the next batch.
    """

    name = "fast"

    def __init__(self, model: Any):
        self.model = model
        base = model.base_model
        attn = base.layers[0].self_attn
        cfg = model.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.scale = getattr(attn, "scaling", self.head_dim**-0.5)
        self.layers: list[_Layer] = []
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.cos = self.sin = torch.empty(0)

    @staticmethod
    def supports(model: Any) -> bool:
        cfg = getattr(model, "config", None)
        if cfg is None or getattr(cfg, "model_type", None) not in FAST_MODEL_TYPES:
            return False
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
            return False  # sliding-window layers need their own masks
        if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
            return False
        base = getattr(model, "base_model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if base is None or not all(hasattr(base, a) for a in needed) or not hasattr(model, "lm_head"):
            return False
        layer = base.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        if any(hasattr(attn, a) for a in ("q_norm", "k_norm")):
            return False
        norms_ok = all(hasattr(n, "variance_epsilon") for n in (layer.input_layernorm, layer.post_attention_layernorm))
        return (
            norms_ok
            and hasattr(base.norm, "variance_epsilon")
            and all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj"))
            and all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        )

    def start(self, batch: int, max_len: int, device: torch.device) -> None:
        """Read the current weights and allocate the static cache for ``batch`` rows of ``max_len`` tokens."""
        base = self.model.base_model
        self.embed = base.embed_tokens.weight
        self.norm = (base.norm.weight, base.norm.variance_epsilon)
        self.lm_head = self.model.lm_head
        self.layers = [_Layer(layer) for layer in base.layers]
        dtype = self.embed.dtype
        shape = (batch, self.n_kv, max_len, self.head_dim)
        self.k_cache = [torch.empty(shape, dtype=dtype, device=device) for _ in self.layers]
        self.v_cache = [torch.empty(shape, dtype=dtype, device=device) for _ in self.layers]
        # cos/sin for every position once per batch; decode steps index into the table.
        positions = torch.arange(max_len, device=device)[None]
        cos, sin = base.rotary_emb(torch.empty(1, 1, 1, dtype=dtype, device=device), positions)
        if cos.shape[-1] != self.head_dim:
            raise ValueError(f"partial rotary embeddings ({cos.shape[-1]} of {self.head_dim} dims) are not supported")
        self.cos, self.sin = cos[0], sin[0]

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, col: int) -> torch.Tensor:
        """Run ``ids [B, T]`` written at cache columns [col, col+T); ``mask [B, 1, T, col+T]`` (True = attend)."""
        bsz, t = ids.shape
        end = col + t
        h = F.embedding(ids, self.embed)
        # An additive float mask takes a faster CPU attention kernel than a boolean one; built once per step.
        bias = torch.zeros(mask.shape, dtype=h.dtype, device=h.device).masked_fill_(~mask, float("-inf"))
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]  # [B, T, 1, head_dim]
        gqa = self.n_kv != self.n_heads
        nq, nqk = self.n_heads, self.n_heads + self.n_kv
        for i, w in enumerate(self.layers):
            qkv = F.linear(_rms_norm(h, w.ln1), w.qkv_w, w.qkv_b).view(bsz, t, nqk + self.n_kv, self.head_dim)
            qk = _rotate(qkv[:, :, :nqk], cos, sin)  # q and k heads rotated together: half the ops
            q = qk[:, :, :nq].transpose(1, 2)
            k = qk[:, :, nq:].transpose(1, 2)
            v = qkv[:, :, nqk:].transpose(1, 2)
            self.k_cache[i][:, :, col:end] = k
            self.v_cache[i][:, :, col:end] = v
            o = F.scaled_dot_product_attention(
                q,
                self.k_cache[i][:, :, :end],
                self.v_cache[i][:, :, :end],
                attn_mask=bias,
                scale=self.scale,
                enable_gqa=gqa,
            )
            h = h + F.linear(o.transpose(1, 2).reshape(bsz, t, -1), w.o_w, w.o_b)
            gate, up = F.linear(_rms_norm(h, w.ln2), w.gate_up_w, w.gate_up_b).chunk(2, dim=-1)
            h = h + F.linear(w.act(gate) * up, w.down_w, w.down_b)
        return self.lm_head(_rms_norm(h[:, -1], self.norm))

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
        """Left-padded prompts ``ids [B, P]`` -> next-token logits [B, V]."""
        p = ids.shape[1]
        causal = torch.ones(p, p, dtype=torch.bool, device=ids.device).tril()
        mask = causal[None, None] & key_valid[:, None, None, :p]
        # A padding query would attend to nothing (NaN); let it see itself — its output is never used.
        mask |= torch.eye(p, dtype=torch.bool, device=ids.device)[None, None]
        return self._forward(ids, positions, mask, 0)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor, col: int) -> torch.Tensor:
        """One new token per row ``tokens [B]`` at cache column ``col`` -> logits [B, V]."""
        mask = key_valid[:, None, None, : col + 1]
        return self._forward(tokens[:, None], positions[:, None], mask, col)


class HFRunner:
    """Any transformers causal LM through its own forward and a DynamicCache (slower, always correct)."""

    name = "hf"

    def __init__(self, model: Any):
        self.model = model
        # transformers 5 renamed `past_key_values` to `cache`; pass whichever this version takes.
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.cache: Any = None

    def start(self, batch: int, max_len: int, device: torch.device) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=ids,
            attention_mask=attention_mask.long(),
            position_ids=positions,
            use_cache=True,
            **{self.cache_kw: self.cache},
        )
        return out.logits[:, -1]

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
        return self._run(ids, positions, key_valid[:, : ids.shape[1]])

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor, col: int) -> torch.Tensor:
        return self._run(tokens[:, None], positions[:, None], key_valid[:, : col + 1])
