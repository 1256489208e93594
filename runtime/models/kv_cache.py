"""The plain decoder's KV cache and attention mask.

:class:`KVCache` has the parts of transformers' ``DynamicCache`` the runtime uses: ``layers[i].keys`` /
``.values`` (``[B, kv_heads, T, head_dim]``), construction from ``ddp_cache_data=[(k, v), ...]`` (the
trainer's shared-prefix layout expands a prompt's cache that way, keeping its autograd graph),
``get_seq_length()`` and ``update``, which appends a forward's keys and values.

:func:`causal_mask` is the boolean mask transformers' SDPA path builds from a 2-D padding mask, and
``None`` exactly where it leaves the mask out (SDPA's ``is_causal``, or a single query, gives the same):
the two forwards then run the same kernels on the same inputs.

:func:`packed_causal_mask` is the mask of a packed row (several sequences one after another, each with
positions counting from 0, no padding mask): block-diagonal causal, the rule transformers' masking utilities
apply to the same inputs (a new sequence starts wherever a position is not its predecessor's plus one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class CacheLayer:
    def __init__(self, keys: Tensor | None = None, values: Tensor | None = None):
        self.keys, self.values = keys, values


class KVCache:
    def __init__(self, ddp_cache_data: list[tuple[Tensor, Tensor]] | None = None):
        self.layers = [CacheLayer(k, v) for k, v in ddp_cache_data or ()]

    def update(self, keys: Tensor, values: Tensor, layer_idx: int) -> tuple[Tensor, Tensor]:
        """Append ``keys`` / ``values`` (this forward's columns) to layer ``layer_idx``; returns all its columns."""
        while len(self.layers) <= layer_idx:
            self.layers.append(CacheLayer())
        layer = self.layers[layer_idx]
        if layer.keys is None or layer.values is None:
            layer.keys, layer.values = keys, values
        else:
            layer.keys = torch.cat([layer.keys, keys], dim=-2)
            layer.values = torch.cat([layer.values, values], dim=-2)
        return layer.keys, layer.values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= len(self.layers) or self.layers[layer_idx].keys is None:
            return 0
        return int(self.layers[layer_idx].keys.shape[-2])  # type: ignore[union-attr]


def causal_mask(
    attention_mask: Tensor | None, batch: int, q_len: int, past: int, device: torch.device
) -> Tensor | None:
    """``[B, 1, q_len, past + q_len]``, True where query ``i`` (cache column ``past + i``) may attend column
    ``j``: ``j <= past + i`` and ``attention_mask[b, j]`` (a mask shorter than the columns is padded with
    False). None where no mask is needed: no padding and a square or single-row attention, or an empty
    cache and padding only after the queries' columns."""
    kv_len = past + q_len
    pad = None
    if attention_mask is not None:
        pad = attention_mask.to(device=device, dtype=torch.bool)
        if pad.shape[-1] < kv_len:
            pad = F.pad(pad, (0, kv_len - pad.shape[-1]))
        elif pad.shape[-1] > kv_len:
            pad = pad[:, :kv_len]
    if (q_len == 1 or kv_len == q_len) and (pad is None or bool(pad.all())):
        return None
    if past == 0 and (pad is None or (bool(pad[:, :q_len].all()) and not bool(pad[:, q_len:].any()))):
        return None
    rows = torch.arange(q_len, device=device) + past
    cols = torch.arange(kv_len, device=device)
    mask = cols[None, None, None, :] <= rows[None, None, :, None]
    if pad is not None:
        mask = mask & pad[:, None, None, :]
    return mask.expand(batch, -1, q_len, kv_len)


def sequence_ids(position_ids: Tensor) -> Tensor:
    """``[B, T]`` index of the packed sequence each column belongs to: a new one wherever the position is not
    the previous column's plus one (the first column starts sequence 0)."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first) != 1).cumsum(-1)


def packed_causal_mask(position_ids: Tensor) -> Tensor | None:
    """``[B, 1, T, T]``, True where column ``i`` may attend column ``j``: ``j <= i`` within one packed
    sequence. None when every row holds one sequence (plain causal attention)."""
    seq = sequence_ids(position_ids)
    if not bool(seq[:, -1].any()):
        return None
    t = position_ids.shape[1]
    cols = torch.arange(t, device=position_ids.device)
    causal = cols[None, :] <= cols[:, None]
    return (causal[None] & (seq[:, :, None] == seq[:, None, :]))[:, None]


def shared_prompt_mask(segments: Tensor, branches: Tensor) -> Tensor:
    """``[B, 1, T, T]``, True where column ``i`` may attend column ``j`` in rows of *units*: a prompt followed
    by several responses to it (``segments``: the unit of each column; ``branches``: 0 on the prompt, ``k`` on
    the unit's ``k``-th response). ``j <= i`` in the same unit, and ``j`` on the prompt or on ``i``'s own
    response: each response sees its prompt and itself, as if it followed the prompt alone."""
    t = segments.shape[1]
    cols = torch.arange(t, device=segments.device)
    causal = cols[None, :] <= cols[:, None]
    same_unit = segments[:, :, None] == segments[:, None, :]
    visible = (branches[:, None, :] == 0) | (branches[:, :, None] == branches[:, None, :])
    return (causal[None] & same_unit & visible)[:, None]
