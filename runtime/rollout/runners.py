"""Forward passes for the generation engine over a fixed set of *slots* (rows of a static KV cache).

Each slot holds one sequence whose token ``j`` lives at cache column ``j`` and has position ``j``, so
sequences of different lengths share one cache without padding, and a slot whose sequence
finished is refilled with a new prompt (continuous batching) without touching the others. Two runners
share one interface:

- ``allocate(slots, max_len, device)`` sizes the cache; ``grow(max_len)`` widens it keeping contents.
- ``load_weights()`` reads the model's current parameters (after a weight update).
- ``prefill(prompts, slots, pad)`` writes the prompts into ``slots`` at columns [0, len) and returns
  each prompt's next-token logits ``[n, V]`` and the token positions it computed (padding included).
- ``decode(tokens [b], cols [b])`` writes token ``r`` at column ``cols[r]`` of slot ``r`` for slots
  ``0..b-1`` and returns next-token logits ``[b, V]``; a slot attends to columns ``<= cols[r]``.
- ``move(src, dst)`` copies a slot's cache to another slot (compaction).
- ``share_prefix(src, dsts, length)`` copies columns [0, length) of slot ``src``'s cache into slots
  ``dsts``: a prompt prefilled once serves every request of a group that repeats it.

:class:`FastRunner`, for Llama-family models (``llama``, ``qwen2``), uses the same parameters and math
as the model's modules (RMSNorm, rotary tables from the model's own module, q/k/v/o, gated MLP,
lm_head) as a lean loop: q/k/v and gate/up each one matmul, additive masks built once per step, no per-step
module dispatch. That skips what makes ``model.generate()`` slow on small models — per-step mask
construction, cache concatenation, logits processors — and log-probabilities agree with the
trainer's to float rounding. Attention reads little more than the cache columns each row can see:
decode rows are split into ranges by length, prefill prompts into blocks. :class:`HFRunner`, for any other causal LM, runs the model's own forward
with one KV cache per slot (the model's own: slower, always correct).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
import torch.nn.functional as F

from runtime.models.lora import is_lora, merged_weight

FAST_MODEL_TYPES = ("llama", "qwen2")


def make_runner(model: Any, owns_model: bool = False) -> FastRunner | HFRunner:
    """The fast runner when the architecture is one it knows, otherwise the generic one. ``owns_model``:
    nothing but this runner uses the module (see :class:`FastRunner`)."""
    return FastRunner(model, owns_model) if FastRunner.supports(model) else HFRunner(model)


class _Layer:
    """One decoder layer's weights, with q/k/v and gate/up concatenated so each is one matmul."""

    def __init__(self, layer: Any):
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1 = (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
        self.ln2 = (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.qkv_w = _joined([_weight(m) for m in projs])
        self.qkv_b = _joined([m.bias for m in projs]) if projs[0].bias is not None else None
        self.o_w, self.o_b = _weight(attn.o_proj), attn.o_proj.bias
        self.gate_up_w = _joined([_weight(mlp.gate_proj), _weight(mlp.up_proj)])
        self.gate_up_b = _joined([mlp.gate_proj.bias, mlp.up_proj.bias]) if mlp.gate_proj.bias is not None else None
        self.down_w, self.down_b = _weight(mlp.down_proj), mlp.down_proj.bias
        # The module call costs more than SiLU itself on small batches; call the function directly.
        self.act = F.silu if isinstance(mlp.act_fn, torch.nn.SiLU) else mlp.act_fn

    def alias_module(self, layer: Any) -> None:
        """Point the layer's q/k/v and gate/up parameters at row slices of the fused tensors, so one copy
        of those weights exists, and a weight update copied into the parameters lands in the fused ones."""
        qkv = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
        gate_up = (layer.mlp.gate_proj, layer.mlp.up_proj)
        pairs: tuple[tuple[torch.Tensor | None, tuple[Any, ...], str], ...] = (
            (self.qkv_w, qkv, "weight"),
            (self.qkv_b, qkv, "bias"),
            (self.gate_up_w, gate_up, "weight"),
            (self.gate_up_b, gate_up, "bias"),
        )
        for fused, modules, attr in pairs:
            if fused is None:
                continue
            start = 0
            for m in modules:
                param = getattr(m, attr)
                param.data = fused[start : start + param.shape[0]]
                start += param.shape[0]


def _weight(m: Any) -> torch.Tensor:
    """A projection's weight as the engine multiplies by it: a LoRA layer's with its adapters merged in (a new
    tensor each weight version: the base stays as it is), any other the parameter itself."""
    return merged_weight(m) if hasattr(m, "lora_A") else m.weight


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` (along rows); a view, no copy, when the parts already lie one after the other in one
    storage — parameters bound to the weight service's shared buffer (runtime.weights.service.shared_layout)."""
    first = parts[0]
    offset = first.storage_offset()
    for part in parts:
        adjacent = (
            part.is_contiguous()
            and part.dtype == first.dtype
            and part.shape[1:] == first.shape[1:]
            and part.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and part.storage_offset() == offset
        )
        if not adjacent:
            return torch.cat(parts)
        offset += part.numel()
    rows = sum(part.shape[0] for part in parts)
    size = (rows, *first.shape[1:])
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), size, first.stride())


def _rms_norm(x: torch.Tensor, weight_eps: tuple[torch.Tensor, float]) -> torch.Tensor:
    # The transformers Llama/Qwen2 RMSNorm: normalise in float32, cast back, then scale.
    weight, eps = weight_eps
    # Written out because it beats F.rms_norm on small CPU batches; the casts are skipped in float32.
    if x.dtype == torch.float32:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding as transformers' Llama/Qwen2 apply it: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class FastRunner:
    """Static-KV-cache slots over a Llama-family model's parameters.

    The fused q/k/v and gate/up weights are copies, so :meth:`load_weights` must run after the
    model's parameters change (the engine calls it whenever its weight version moves). With
    ``owns_model`` — the engine built the module and nothing else uses it, as in a rollout process or
    the evaluator — the module's q/k/v and gate/up parameters become views of the fused tensors
    instead: the process holds one copy of those weights, not two, and an update copied into the
    parameters in place needs no re-fusing. A module the trainer shares is never aliased.
    """

    name = "fast"
    uses_modules = False  # pure functions of the weights: no dropout, train/eval mode does not matter

    def __init__(self, model: Any, owns_model: bool = False):
        self.model = model
        self.owns_model = owns_model
        self._aliased = False
        # LoRA: each weight version's adapters are merged into the fused weights (one matmul per projection,
        # as without adapters), so they are copies even in a module the engine owns: its base stays unmerged.
        self.merges_adapters = is_lora(model)
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
        self.max_len = 0
        # Prefill: a forward pass takes at most this many prompt tokens (bounds activation memory), and
        # attention runs in blocks of whole prompts of about this many tokens (see prefill).
        self.forward_tokens = 16 * cfg.hidden_size
        self.attn_block = cfg.hidden_size // 2
        # Decode attention splits its rows into ranges when that saves reading more than this many cache
        # (row, column) pairs: about 48 K key and value elements, what one more kernel call costs.
        self.split_penalty = 24576 // (self.n_kv * self.head_dim)

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

    def load_weights(self) -> None:
        """Read the model's current parameters (fusing q/k/v and gate/up; once, when aliased)."""
        if self._aliased:
            return  # updates were copied into the parameters, which are views of the fused tensors
        base = self.model.base_model
        self.embed = base.embed_tokens.weight
        self.norm = (base.norm.weight, base.norm.variance_epsilon)
        self.lm_head = (self.model.lm_head.weight, self.model.lm_head.bias)
        if not self.owns_model or self.merges_adapters:
            with torch.inference_mode():  # the fused copies must not be autograd tensors: that slows every matmul
                self.layers = [_Layer(layer) for layer in base.layers]
            return
        with torch.no_grad():  # not inference tensors: the engine copies updates into them in place
            self.layers = [_Layer(layer) for layer in base.layers]
            for fused, layer in zip(self.layers, base.layers, strict=True):
                fused.alias_module(layer)
        self._aliased = True

    def allocate(self, slots: int, max_len: int, device: torch.device) -> None:
        """A cache of ``slots`` rows by at least ``max_len`` columns, and rotary tables for every position.

        The previous cache is reused when it is big enough: its stale contents are finite and every
        read is masked to columns the new sequences wrote.
        """
        if not self.layers:
            self.load_weights()
        if (
            self.k_cache
            and self.k_cache[0].shape[0] == slots
            and self.max_len >= max_len
            and self.k_cache[0].device == torch.device(device)
            and self.k_cache[0].dtype == self.embed.dtype
        ):
            return
        dtype = self.embed.dtype
        shape = (slots, self.n_kv, max_len, self.head_dim)
        # Zeros, not empty: masked-out columns still enter attention's probability x value product
        # (with weight 0), and 0 x a NaN left in uninitialised memory would be NaN.
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self._rotary(max_len, device)

    def _rotary(self, max_len: int, device: torch.device) -> None:
        base = self.model.base_model
        positions = torch.arange(max_len, device=device)[None]
        cos, sin = base.rotary_emb(torch.empty(1, 1, 1, dtype=self.embed.dtype, device=device), positions)
        if cos.shape[-1] != self.head_dim:
            raise ValueError(f"partial rotary embeddings ({cos.shape[-1]} of {self.head_dim} dims) are not supported")
        self.cos, self.sin = cos[0], sin[0]
        self.columns = torch.arange(max_len, device=device)
        self.kv_heads = torch.arange(self.n_kv, device=device)
        self.max_len = max_len

    def grow(self, max_len: int) -> None:
        """Widen the cache to ``max_len`` columns, keeping what the slots hold."""
        if max_len <= self.max_len:
            return
        extra = max_len - self.max_len
        for caches in (self.k_cache, self.v_cache):
            for i, c in enumerate(caches):
                caches[i] = torch.cat([c, c.new_zeros(c.shape[0], c.shape[1], extra, c.shape[3])], dim=2)
        self._rotary(max_len, self.k_cache[0].device)

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s cache into slot ``dst`` (compaction: the caller then treats ``src`` as free)."""
        for caches in (self.k_cache, self.v_cache):
            for c in caches:
                c[dst].copy_(c[src])

    def share_prefix(self, src: int, dsts: list[int], length: int) -> None:
        """Copy columns [0, length) of slot ``src``'s cache into every slot of ``dsts``."""
        rows = torch.tensor(dsts, device=self.k_cache[0].device)
        for caches in (self.k_cache, self.v_cache):
            for c in caches:
                c[rows, :, :length] = c[src, :, :length]

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, attend: Any) -> torch.Tensor:
        """Hidden states after the last layer for ``ids [B, T]``; ``attend(i, q, k, v)`` stores k/v, returns o."""
        bsz, t = ids.shape
        h = F.embedding(ids, self.embed)
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]  # [B, T, 1, head_dim]
        nq, nqk = self.n_heads, self.n_heads + self.n_kv
        for i, w in enumerate(self.layers):
            qkv = F.linear(_rms_norm(h, w.ln1), w.qkv_w, w.qkv_b).view(bsz, t, nqk + self.n_kv, self.head_dim)
            qk = _rotate(qkv[:, :, :nqk], cos, sin)  # q and k heads rotated together: half the ops
            q = qk[:, :, :nq].transpose(1, 2)
            k = qk[:, :, nq:].transpose(1, 2)
            v = qkv[:, :, nqk:].transpose(1, 2)
            o = attend(i, q, k, v)
            h = h + F.linear(o.transpose(1, 2).reshape(bsz, t, -1), w.o_w, w.o_b)
            gate, up = F.linear(_rms_norm(h, w.ln2), w.gate_up_w, w.gate_up_b).chunk(2, dim=-1)
            h = h + F.linear(w.act(gate) * up, w.down_w, w.down_b)
        return h

    def _bias(self, keep: torch.Tensor) -> torch.Tensor:
        """An additive attention mask: 0 where ``keep``, -inf elsewhere."""
        return torch.zeros(keep.shape, dtype=self.embed.dtype, device=keep.device).masked_fill_(~keep, float("-inf"))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(_rms_norm(h, self.norm), *self.lm_head)

    def prefill(self, prompts: list[list[int]], slots: list[int], pad: int) -> tuple[torch.Tensor, int]:
        """Prompts written into ``slots`` at columns [0, len) -> (next-token logits [n, V], positions computed).

        No padding: prompts are packed into one row per forward pass, so the linear layers run on all their
        tokens at once. Attention, whose work grows with the square of the tokens it spans, runs in blocks
        of whole prompts with a block-diagonal causal mask: a block of ``B`` tokens costs about ``2 hidden B``
        multiply-adds per token against ``12 hidden^2`` for the linear layers, so blocks of ``hidden / 2``
        tokens keep attention under a tenth of that (attention over one packed row of all the prompts cost
        as much as the linear layers; a masked-out pair costs as much as a real one).
        """
        logits = []
        for group in _pack(list(map(len, prompts)), self.forward_tokens):
            logits.append(self._prefill_packed([prompts[j] for j in group], [slots[j] for j in group]))
        return torch.cat(logits), sum(map(len, prompts))

    def _prefill_packed(self, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
        device = self.k_cache[0].device
        lengths = [len(p) for p in prompts]
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)[None]
        pos = torch.cat([self.columns[:n] for n in lengths])
        seg = torch.repeat_interleave(torch.arange(len(prompts), device=device), torch.tensor(lengths, device=device))
        rows = torch.tensor(slots, device=device)[seg]
        flat = ((rows[:, None] * self.n_kv + self.kv_heads[None]) * self.max_len + pos[:, None]).reshape(-1)
        blocks, start = [], 0  # (first token, end token, block-diagonal causal mask), shared by all layers
        for group in _pack(lengths, self.attn_block):
            end = start + sum(lengths[j] for j in group)
            s, p = seg[start:end], pos[start:end]
            blocks.append((start, end, self._bias((s[:, None] == s[None, :]) & (p[None, :] <= p[:, None]))))
            start = end
        gqa = self.n_kv != self.n_heads

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            for cache, new in ((self.k_cache[i], k), (self.v_cache[i], v)):  # new: [1, n_kv, T, head_dim]
                cache.view(-1, self.head_dim).index_copy_(0, flat, new[0].transpose(0, 1).reshape(-1, self.head_dim))
            outs = [
                F.scaled_dot_product_attention(
                    q[:, :, a:z], k[:, :, a:z], v[:, :, a:z], attn_mask=mask, scale=self.scale, enable_gqa=gqa
                )
                for a, z, mask in blocks
            ]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

        h = self._forward(ids, pos[None], attend)
        last = torch.tensor(lengths, device=device).cumsum(0) - 1
        return self._logits(h[0, last])

    def decode(self, tokens: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Token ``tokens[r]`` at column ``cols[r]`` of slot ``r`` (slots 0..b-1) -> logits [b, V]."""
        b = tokens.shape[0]
        rows = torch.arange(b, device=tokens.device)
        groups = self.n_heads // self.n_kv
        # Attention over the cache reads every row up to the column of the longest row in its range; one
        # long row among short ones would make them all read (and mask) its length. So rows are split into
        # contiguous ranges, each reading only up to its own longest column. Masked columns add exactly 0:
        # the split changes float rounding only, and it depends on the columns alone (deterministic).
        ranges, col_list = [], cols.tolist()
        for lo, hi in _split_rows(col_list, self.split_penalty):
            end = max(col_list[lo:hi]) + 1
            ranges.append((lo, hi, end, self._bias(self.columns[None, :end] <= cols[lo:hi, None])[:, None, None]))

        # Row r's kv heads go to flat cache rows ((r * n_kv + head) * max_len + cols[r]): one index_copy_
        # per cache and layer, cheaper than advanced-index assignment.
        flat = ((rows[:, None] * self.n_kv + self.kv_heads[None]) * self.max_len + cols[:, None]).reshape(-1)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_cache, v_cache = self.k_cache[i], self.v_cache[i]
            k_cache.view(-1, self.head_dim).index_copy_(0, flat, k.reshape(-1, self.head_dim))
            v_cache.view(-1, self.head_dim).index_copy_(0, flat, v.reshape(-1, self.head_dim))
            # One query per row: fold the query heads that share a kv head into the query-length axis,
            # so attention reads the cache as it is instead of expanding it to every query head.
            q = q.reshape(b, self.n_kv, groups, self.head_dim)
            outs = [
                F.scaled_dot_product_attention(
                    q[lo:hi], k_cache[lo:hi, :, :end], v_cache[lo:hi, :, :end], attn_mask=mask, scale=self.scale
                )
                for lo, hi, end, mask in ranges
            ]
            o = outs[0] if len(outs) == 1 else torch.cat(outs)
            return o.reshape(b, self.n_heads, 1, self.head_dim)

        h = self._forward(tokens[:, None], cols[:, None], attend)
        return self._logits(h[:, 0])


def _pack(lengths: list[int], limit: int) -> list[list[int]]:
    """Indices of consecutive items grouped so that a group's lengths sum to at most ``limit`` (a longer
    item is a group of its own)."""
    groups: list[list[int]] = []
    total = limit + 1
    for j, n in enumerate(lengths):
        if total + n > limit:
            groups.append([])
            total = 0
        groups[-1].append(j)
        total += n
    return groups


def _split_rows(cols: list[int], penalty: int) -> list[tuple[int, int]]:
    """Contiguous ranges ``[lo, hi)`` of rows 0..len(cols)-1 for decode attention, which reads
    ``(hi - lo) x (max(cols[lo:hi]) + 1)`` cache columns per range: a range is cut in two where that saves
    the most, as long as the saving exceeds ``penalty`` (what one more attention call costs)."""
    out = []
    todo = [(0, len(cols))]
    while todo:
        lo, hi = todo.pop()
        prefix, m = [], 0  # prefix[j - lo]: columns read by rows lo..j
        for c in cols[lo:hi]:
            m = max(m, c + 1)
            prefix.append(m)
        best, cut, m = prefix[-1] * (hi - lo) - penalty, None, 0
        for j in range(hi - 1, lo, -1):  # cut before row j; m: columns read by rows j..hi-1
            m = max(m, cols[j] + 1)
            cost = prefix[j - 1 - lo] * (j - lo) + m * (hi - j)
            if cost < best:
                best, cut = cost, j
        if cut is None:
            out.append((lo, hi))
        else:
            todo += [(cut, hi), (lo, cut)]
    return sorted(out)


class HFRunner:
    """Any causal LM (transformers' or the plain decoder) through its own forward, one KV cache per slot
    (slow, always correct)."""

    name = "hf"
    uses_modules = True  # the model's own forward: must run in eval mode (no dropout)

    def __init__(self, model: Any):
        self.model = model
        # transformers 5 renamed `past_key_values` to `cache`; pass whichever this version takes.
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.caches: list[Any] = []
        self.device = torch.device("cpu")

    def load_weights(self) -> None:
        """Nothing to do: the model's own forward always reads its current parameters."""

    def allocate(self, slots: int, max_len: int, device: torch.device) -> None:
        self.caches = [None] * slots
        self.device = device

    def grow(self, max_len: int) -> None:
        """Dynamic caches grow by themselves."""

    def move(self, src: int, dst: int) -> None:
        self.caches[dst], self.caches[src] = self.caches[src], None

    def share_prefix(self, src: int, dsts: list[int], length: int) -> None:
        for dst in dsts:  # a slot holds exactly its prompt after prefill: the whole cache is the prefix
            self.caches[dst] = copy.deepcopy(self.caches[src])

    def _run(self, slot: int, ids: list[int], start: int) -> torch.Tensor:
        ids_t = torch.tensor([ids], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(ids), device=self.device)[None]
        mask = torch.ones((1, start + len(ids)), dtype=torch.long, device=self.device)
        out = self.model(
            input_ids=ids_t, attention_mask=mask, position_ids=positions, use_cache=True,
            **{self.cache_kw: self.caches[slot]},
        )  # fmt: skip
        # A prefill passes no cache: the model makes its own (transformers' DynamicCache, or the plain
        # decoder's) and returns it; decoding continues it.
        self.caches[slot] = getattr(out, "cache", None) or out.past_key_values
        return out.logits[0, -1]

    def prefill(self, prompts: list[list[int]], slots: list[int], pad: int) -> tuple[torch.Tensor, int]:
        for s in slots:
            self.caches[s] = None
        logits = torch.stack([self._run(s, p, 0) for p, s in zip(prompts, slots, strict=True)])
        return logits, sum(map(len, prompts))  # one prompt at a time: no padding

    def decode(self, tokens: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        out = []
        for r, (tok, col) in enumerate(zip(tokens.tolist(), cols.tolist(), strict=True)):
            if self.caches[r] is None or self.caches[r].get_seq_length() != col:
                out.append(torch.zeros(self.model.config.vocab_size, device=self.device))  # an idle slot
                continue
            out.append(self._run(r, [tok], col))
        return torch.stack(out)
