"""How the trainer lays a step's samples out for its forward passes.

Three layouts, one interface (:class:`ResponseLayout`: where each response token sits in a ``[B, W]``
grid, one row per sample, then token order), so the loss code does not know which ran:

- :class:`PackedBatch` — units packed one after another into rows: a unit is a prompt and the continuations
  of the samples answering it (one sample: a sequence; several: a GRPO group sharing one copy of its prompt).
  Positions restart at 0 for each unit. Rows of single-sample units pass no mask (the model attends
  block-diagonally, each sequence to itself; the plain decoder, transformers' attention and flash-attention's
  varlen path read the positions so); rows of shared units pass an explicit mask where each response sees its
  prompt and itself. Nearly no padding, and a group's prompt computed once per unit, in one forward.
  Micro-batches come from :func:`plan_packed_units` (a token budget; sequences through :func:`plan_packed`,
  rows one to two times as wide as the micro-batch's longest sequence, filled first-fit longest first; a
  group's samples into the rows holding its prompt, at the row width that costs least with attention).
- :class:`PaddedBatch` — each sample's prompt and response as one right-padded row; one forward.
  Micro-batches come from :func:`make_micro_batches` (length-sorted, a token budget).
- :class:`SharedPrefixBatch` — the samples of one prompt (a GRPO group) share it: the prompt runs
  once per group, right-padded, keeping its KV cache *with its autograd graph*; the cache is expanded
  to the group's rows and the responses continue from it in a second forward. Gradients reach the
  prompt's positions through the cache, so the loss and its gradient equal the padded layout's up to
  float rounding, while a group of ``g`` samples computes its prompt once instead of ``g`` times.
  Micro-batches come from :func:`plan_shared_prefix` (whole groups where they fit the budget).

:func:`plan_micro_batches` lays a mini-batch out packed (sharing prompts in rows where the attention takes an
explicit mask) or padded (``trainer.layout``), and in the shared-prefix layout instead where that is allowed
and processes at least ``SHARED_PREFIX_MIN_SAVING`` fewer tokens.
"""

from __future__ import annotations

import inspect
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from runtime.models.kv_cache import shared_prompt_mask
from runtime.models.logprobs import positions_from_mask
from runtime.samples import Sample

# The shared-prefix layout runs two forwards per micro-batch; below this saving in processed tokens the
# second forward's fixed cost (mask construction, module dispatch, the cache expansion) eats the gain.
SHARED_PREFIX_MIN_SAVING = 0.2
# A continuation forward's fixed cost in padded tokens, for splitting a batch's continuations by length.
TIER_OVERHEAD_TOKENS = 128

Forward = Callable[..., Any]


# --------------------------------------------------------------------------- padded layout


def make_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most ``token_budget`` padded tokens.

    Sequences are sorted by length (longest first, ties by index) and packed
    greedily: a micro-batch of ``b`` sequences whose longest has ``L`` tokens
    costs ``b * L``. A sequence longer than the budget gets a micro-batch of
    its own. Deterministic for a given input.
    """
    if token_budget < 1:
        raise ValueError("trainer.micro_batch_tokens must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        new_longest = max(longest, lengths[i])
        if current and (len(current) + 1) * new_longest > token_budget:
            batches.append(current)
            current, new_longest = [], lengths[i]
        current.append(i)
        longest = new_longest
    if current:
        batches.append(current)
    return batches


def padded_tokens(lengths: list[int], batches: list[list[int]]) -> int:
    """Tokens the forward passes of ``batches`` process, padding included."""
    return sum(len(b) * max(lengths[i] for i in b) for b in batches if b)


def padding_ratio(lengths: list[int], batches: list[list[int]]) -> float:
    """Padding tokens / all processed tokens of ``batches`` (0 when nothing is processed)."""
    total = padded_tokens(lengths, batches)
    return 0.0 if total == 0 else 1.0 - sum(lengths[i] for b in batches for i in b) / total


@dataclass
class ResponseLayout:
    """Where the response tokens of a micro-batch's samples sit in a ``[B, W]`` grid."""

    indices: list[int]  # positions in the caller's sample list, one per row
    rows: Tensor  # [n] row of each response token (sample order, then token order)
    cols: Tensor  # [n] its column
    mask: Tensor  # [B, W] float, 1 at response tokens
    lengths: list[int]  # response length per row

    def scatter(self, per_sample: list[Tensor]) -> Tensor:
        """Per-sample 1-D response tensors -> ``[B, W]`` (0 elsewhere)."""
        out = torch.zeros(self.mask.shape, dtype=torch.float32, device=self.mask.device)
        if self.rows.numel():
            out[self.rows, self.cols] = torch.cat([per_sample[i] for i in self.indices]).to(out.device, torch.float32)
        return out

    def split(self, flat: Tensor) -> list[Tensor]:
        """A flat ``[n]`` tensor in response-token order -> one 1-D tensor per row."""
        return list(torch.split(flat, self.lengths))

    def logits_and_targets(self, forward: Forward, prefix_forward: Forward | None = None) -> tuple[Tensor, Tensor]:
        """The logits predicting each response token ``[n, V]`` and the tokens ``[n]``, in grid order."""
        raise NotImplementedError

    def forward_inputs(self) -> dict[str, Tensor | None]:
        """The one forward's ``input_ids``, ``attention_mask``, ``position_ids`` (layouts of one forward)."""
        raise NotImplementedError(f"{type(self).__name__} has no single forward")

    def predicting(self, per_position: Tensor) -> Tensor:
        """``[R, T, ...]`` outputs of :meth:`forward_inputs`' forward -> ``[n, ...]``: those at the positions
        predicting each response token, in grid order (a critic's values)."""
        raise NotImplementedError(f"{type(self).__name__} has no single forward")


@dataclass
class PaddedBatch(ResponseLayout):
    """Right-padded prompt + response rows; the grid is the ``[B, L-1]`` next-token layout."""

    input_ids: Tensor = field(default_factory=lambda: torch.empty(0))  # [B, L]
    attention_mask: Tensor = field(default_factory=lambda: torch.empty(0))  # [B, L]
    position_ids: Tensor = field(default_factory=lambda: torch.empty(0))  # [B, L]

    def logits_and_targets(self, forward: Forward, prefix_forward: Forward | None = None) -> tuple[Tensor, Tensor]:
        """The logits predicting each response token ``[n, V]`` and the tokens ``[n]`` (one forward)."""
        logits = forward(**self.forward_inputs(), use_cache=False).logits
        return self.predicting(logits), self.input_ids[self.rows, self.cols + 1]

    def forward_inputs(self) -> dict[str, Tensor | None]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "position_ids": self.position_ids}

    def predicting(self, per_position: Tensor) -> Tensor:
        return per_position[:, :-1][self.rows, self.cols]


def _layout(
    indices: list[int], rows: list[int], cols: list[int], lengths: list[int], width: int, device: torch.device
) -> dict[str, Any]:
    """The :class:`ResponseLayout` fields of a ``[len(indices), width]`` grid with response tokens at
    (``rows``, ``cols``)."""
    mask = torch.zeros((len(indices), width), dtype=torch.float32)
    rows_t, cols_t = torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)
    if rows:
        mask[rows_t, cols_t] = 1.0
    return {
        "indices": indices,
        "rows": rows_t.to(device),
        "cols": cols_t.to(device),
        "mask": mask.to(device),
        "lengths": lengths,
    }


def collate_padded(samples: list[Sample], indices: list[int], pad_id: int, device: torch.device) -> PaddedBatch:
    seqs = [samples[i].prompt_ids + samples[i].response_ids for i in indices]
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    rows: list[int] = []
    cols: list[int] = []
    lengths: list[int] = []
    for r, (i, seq) in enumerate(zip(indices, seqs, strict=True)):
        input_ids[r, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention_mask[r, : len(seq)] = 1
        p, n = len(samples[i].prompt_ids), len(samples[i].response_ids)
        # Response token at sequence position p + j is predicted at column p + j - 1.
        rows.extend([r] * n)
        cols.extend(range(p - 1, p - 1 + n))
        lengths.append(n)
    return PaddedBatch(
        **_layout(indices, rows, cols, lengths, max(width - 1, 1), device),
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        position_ids=positions_from_mask(attention_mask).to(device),
    )


# --------------------------------------------------------------------------- prompts and continuations


def prompt_units(samples: list[Sample], indices: list[int]) -> list[list[int]]:
    """``indices`` grouped by identical prompt ids, groups in order of first appearance."""
    units: dict[tuple[int, ...], list[int]] = {}
    for i in indices:
        units.setdefault(tuple(samples[i].prompt_ids), []).append(i)
    return list(units.values())


def _continuation(samples: list[Sample], i: int) -> int:
    """Tokens sample ``i`` feeds after its prompt: its response but the last (whose successor is not scored)."""
    return max(len(samples[i].response_ids) - 1, 0)


# --------------------------------------------------------------------------- packed layout


# Row widths a packed micro-batch tries, as multiples of its longest sequence: a wider row lets two
# sequences just over half the longest share it, at the cost of attention over a longer (masked) row.
PACKED_ROW_WIDTHS = (1.0, 1.5, 2.0)
# A wider row is taken only if it wastes at least this much less of the micro-batch's tokens.
PACKED_WIDER_MIN_SAVING = 0.01


def plan_packed(lengths: list[int], token_budget: int) -> list[list[list[int]]]:
    """Micro-batches of rows of sequence indices (into ``lengths``), each within ``token_budget`` tokens (a
    sequence longer than the budget gets a row and a micro-batch of its own).

    Micro-batch by micro-batch: its rows are ``w`` tokens wide, a :data:`PACKED_ROW_WIDTHS` multiple of the
    longest sequence left (the one that wastes least; capped at the budget), and it has ``budget // w``
    of them. The sequences left are placed longest first, each into the first row with room, every one
    tried before the micro-batch closes, so the short ones fill what the long ones leave. Deterministic.
    """
    if token_budget < 1:
        raise ValueError("trainer.micro_batch_tokens must be >= 1")
    remaining = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[list[int]]] = []
    while remaining:
        longest = max(lengths[remaining[0]], 1)
        best: tuple[float, list[list[int]], list[int]] | None = None
        for factor in PACKED_ROW_WIDTHS:
            width = min(max(token_budget, longest), math.ceil(factor * longest))
            rows, left = _first_fit(lengths, remaining, width, max(1, token_budget // width))
            fills = [sum(lengths[i] for i in row) for row in rows]
            waste = (len(rows) * max(fills) - sum(fills)) / max(sum(fills), 1)
            if best is None or waste < best[0] - PACKED_WIDER_MIN_SAVING:
                best = (waste, rows, left)
        assert best is not None
        batches.append(best[1])
        remaining = best[2]
    return batches


def _first_fit(lengths: list[int], order: list[int], width: int, max_rows: int) -> tuple[list[list[int]], list[int]]:
    """``order`` placed into at most ``max_rows`` rows of ``width`` tokens, each into the first row with
    room; returns the rows and what did not fit (in order)."""
    rows: list[list[int]] = []
    room: list[int] = []
    open_rows: list[int] = []  # rows with room for the shortest sequence, in order
    shortest = min((lengths[i] for i in order), default=0)
    too_long = None  # ``order`` is longest first: once a length fits nowhere, no longer one will
    left: list[int] = []
    for i in order:
        n = lengths[i]
        row = None if too_long is not None and n >= too_long else next((r for r in open_rows if n <= room[r]), None)
        if row is not None:
            rows[row].append(i)
            room[row] -= n
            if room[row] < shortest:
                open_rows.remove(row)
        elif len(rows) < max_rows:
            rows.append([i])
            room.append(width - n)
            if room[-1] >= shortest:
                open_rows.append(len(rows) - 1)
        else:
            too_long = n
            left.append(i)
    return rows, left


def packed_tokens(lengths: list[int], batches: list[list[list[int]]]) -> int:
    """Tokens the forwards of packed ``batches`` process: rows x the longest row's fill, per micro-batch."""
    return sum(len(rows) * max(sum(lengths[i] for i in row) for row in rows) for rows in batches if rows)


# Row widths a micro-batch of rows sharing prompts tries, as multiples of its longest sequence (prompt +
# continuation): a wider row holds more of a group behind one prompt copy, at the cost of more attention.
SHARED_ROW_WIDTHS = (1.0, 1.25, 1.5, 2.0, 3.0)
# Without a model's shapes: the row width at which a row's attention costs what its linear layers do.
DEFAULT_ATTENTION_WIDTH = 2048.0


def attention_width(config: Any) -> float:
    """The row width (tokens) at which a packed row's attention costs as much as its linear layers.

    The attention of a ``W``-token row computes every (query, key) pair, masked ones included: about
    ``4 q W^2`` flops per layer (``q`` the query width), against ``2 L W`` for the linear layers (``L`` their
    weights per layer), so the two are even at ``W = L / 2q``. Read from a transformers-style config;
    :data:`DEFAULT_ATTENTION_WIDTH` when a field is missing.
    """
    try:
        h, heads, inter = int(config.hidden_size), int(config.num_attention_heads), int(config.intermediate_size)
    except (AttributeError, TypeError, ValueError):
        return DEFAULT_ATTENTION_WIDTH
    head_dim = int(getattr(config, "head_dim", None) or h // heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads) * head_dim
    q = heads * head_dim
    linear = 2 * h * q + 2 * h * kv + 3 * h * inter  # q, o; k, v; gate, up, down
    return linear / (2 * q)


def unit_tokens(samples: list[Sample], unit: list[int], cont_of: dict[int, int]) -> int:
    """Tokens a packed unit feeds: its prompt once, then each sample's continuation."""
    return len(samples[unit[0]].prompt_ids) + sum(cont_of[i] for i in unit)


def packed_cost(rows: int, width: int, width_scale: float) -> float:
    """The cost of a packed micro-batch of ``rows`` rows ``width`` tokens wide in token-equivalents: its tokens,
    each row's attention over its width counted as :func:`attention_width` says."""
    return rows * width * (1.0 + width / width_scale)


def plan_packed_units(
    samples: list[Sample],
    indices: list[int],
    token_budget: int,
    share_prompts: bool,
    width_scale: float = DEFAULT_ATTENTION_WIDTH,
) -> list[list[list[list[int]]]]:
    """Micro-batches of rows of units (lists of sample indices sharing a prompt) within ``token_budget``.

    Without ``share_prompts`` every sample is a unit of its own: :func:`plan_packed` (sequence packing). With
    it, a sample joins a row that holds its group's prompt where its continuation fits there, else any row
    with room for the prompt and its continuation: a group's samples in one row share one copy of the prompt.
    Micro-batch by micro-batch, the samples left are placed longest continuation first into rows of each
    :data:`SHARED_ROW_WIDTHS` multiple of the longest sequence left, and the width whose rows cost least
    (:func:`packed_cost`) per token of the samples they hold is taken (a prompt counted once per group, so
    its copies count as waste). Deterministic.
    """
    cont_of = {i: _continuation(samples, i) for i in indices}
    if not share_prompts:
        lengths = [len(samples[i].prompt_ids) + cont_of[i] for i in indices]
        return [[[[indices[k]] for k in row] for row in rows] for rows in plan_packed(lengths, token_budget)]
    key_of = {i: tuple(samples[i].prompt_ids) for i in indices}
    group_size = Counter(key_of.values())
    useful = {i: cont_of[i] + len(key_of[i]) / group_size[key_of[i]] for i in indices}
    # Group by group (the group with the longest continuation first), each longest first: a group's samples
    # meet in the rows its first ones opened.
    groups = [sorted(g, key=lambda i: (-cont_of[i], i)) for g in prompt_units(samples, indices)]
    groups.sort(key=lambda g: -cont_of[g[0]])  # stable: ties keep the order of first appearance
    remaining = [i for g in groups for i in g]
    batches: list[list[list[list[int]]]] = []
    while remaining:
        longest = max(len(key_of[i]) + cont_of[i] for i in remaining)
        best: tuple[float, list[list[list[int]]], list[int]] | None = None
        for factor in SHARED_ROW_WIDTHS:
            width = min(max(token_budget, longest), math.ceil(factor * longest))
            rows, fill, left = _fill_shared_rows(remaining, key_of, cont_of, width, max(1, token_budget // width))
            placed = sum(useful[i] for row in rows for unit in row for i in unit)
            cost = packed_cost(len(rows), fill, width_scale) / max(placed, 1e-9)
            if best is None or cost < best[0]:
                best = (cost, rows, left)
        assert best is not None
        batches.append(best[1])
        remaining = best[2]
    return batches


def _fill_shared_rows(
    order: list[int], key_of: dict[int, tuple[int, ...]], cont_of: dict[int, int], width: int, max_rows: int
) -> tuple[list[list[list[int]]], int, list[int]]:
    """``order`` placed into at most ``max_rows`` rows of ``width`` tokens: each sample into the first row that
    holds its prompt with room for its continuation, else the first with room for both, else a new row.
    Returns the rows (units in order of their prompt's first appearance), the widest row's fill, and what did
    not fit (in order)."""
    rows: list[dict[tuple[int, ...], list[int]]] = []  # each row's units by prompt
    room: list[int] = []
    rows_of: dict[tuple[int, ...], list[int]] = {}  # rows holding a prompt
    left: list[int] = []
    for i in order:
        key, c = key_of[i], cont_of[i]
        row = next((r for r in rows_of.get(key, ()) if c <= room[r]), None)
        need = c
        if row is None:
            need = len(key) + c
            row = next((r for r in range(len(rows)) if need <= room[r]), None)
            if row is None and len(rows) < max_rows:
                rows.append({})
                room.append(width)
                row = len(rows) - 1
            if row is None:
                left.append(i)
                continue
            rows_of.setdefault(key, []).append(row)
        rows[row].setdefault(key, []).append(i)
        room[row] -= need
    return [list(row.values()) for row in rows], width - min(room, default=width), left


@dataclass
class PackedBatch(ResponseLayout):
    """Units packed into ``[R, C]`` rows; the grid is ``[B, N]`` (column ``j`` = response token ``j``), one grid
    row per sample in packing order (``indices``).

    A unit is a prompt and the continuations of the samples answering it (each sample's response but its last
    token, whose successor is not scored). A unit of one sample is a sequence: positions restart at 0 for
    each, and no mask is passed (the attention is block-diagonal, read from the positions, as flash-attention's
    varlen path reads them too). A unit of several gives each response the prompt's positions' successors
    and an explicit mask (:func:`~runtime.models.kv_cache.shared_prompt_mask`): each response sees its prompt
    and itself, so every log-prob and gradient is the padded layout's to float rounding.
    """

    input_ids: Tensor = field(default_factory=lambda: torch.empty(0))  # [R, C]
    position_ids: Tensor = field(default_factory=lambda: torch.empty(0))  # [R, C], from 0 for each unit
    attention_mask: Tensor | None = None  # [R, 1, C, C] where a unit shares its prompt, else None
    pick: Tensor = field(default_factory=lambda: torch.empty(0))  # [n] flat [R * C] position predicting each
    targets: Tensor = field(default_factory=lambda: torch.empty(0))  # [n]

    @property
    def shares_prompts(self) -> bool:
        return self.attention_mask is not None

    def logits_and_targets(self, forward: Forward, prefix_forward: Forward | None = None) -> tuple[Tensor, Tensor]:
        """The logits predicting each response token ``[n, V]`` and the tokens ``[n]`` (one forward)."""
        logits = forward(**self.forward_inputs(), use_cache=False).logits
        return self.predicting(logits), self.targets

    def forward_inputs(self) -> dict[str, Tensor | None]:
        # Without a mask the restarting positions are what makes the attention block-diagonal.
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "position_ids": self.position_ids}

    def predicting(self, per_position: Tensor) -> Tensor:
        return per_position.reshape(-1, *per_position.shape[2:])[self.pick]


def collate_packed(
    samples: list[Sample], rows: list[list[list[int]]], pad_id: int, device: torch.device
) -> PackedBatch:
    """The micro-batch whose packed rows hold the units ``rows`` (each a list of indices into ``samples``
    sharing one prompt; a unit of one sample is a sequence)."""
    cont_of = {i: _continuation(samples, i) for row in rows for unit in row for i in unit}
    width = max(sum(unit_tokens(samples, u, cont_of) for u in row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    segments = torch.zeros((len(rows), width), dtype=torch.long)
    branches = torch.zeros((len(rows), width), dtype=torch.long)
    pick: list[int] = []
    targets: list[int] = []
    for r, row in enumerate(rows):
        offset = 0
        for s, unit in enumerate(row):
            prompt = samples[unit[0]].prompt_ids
            p = len(prompt)
            input_ids[r, offset : offset + p] = torch.tensor(prompt, dtype=torch.long)
            position_ids[r, offset : offset + p] = torch.arange(p)
            segments[r, offset : offset + p] = s
            last = r * width + offset + p - 1  # the prompt's last column predicts every response's first token
            offset += p
            for b, i in enumerate(unit, start=1):
                response, c = samples[i].response_ids, cont_of[i]
                input_ids[r, offset : offset + c] = torch.tensor(response[:c], dtype=torch.long)
                position_ids[r, offset : offset + c] = torch.arange(p, p + c)
                segments[r, offset : offset + c] = s
                branches[r, offset : offset + c] = b
                # Response token j >= 1 is predicted at the column of token j - 1.
                pick.extend([last, *range(r * width + offset, r * width + offset + c)] if response else [])
                targets.extend(response)
                offset += c
        # The row's padding tail counts from 0 too: a sequence of its own, which no real token attends.
        position_ids[r, offset:] = torch.arange(width - offset)
        segments[r, offset:] = len(row)
    shared = any(len(unit) > 1 for row in rows for unit in row)
    indices = [i for row in rows for unit in row for i in unit]
    lengths = [len(samples[i].response_ids) for i in indices]
    grid_rows = [k for k, n in enumerate(lengths) for _ in range(n)]
    grid_cols = [j for n in lengths for j in range(n)]
    return PackedBatch(
        **_layout(indices, grid_rows, grid_cols, lengths, max(max(lengths, default=0), 1), device),
        input_ids=input_ids.to(device),
        position_ids=position_ids.to(device),
        attention_mask=shared_prompt_mask(segments.to(device), branches.to(device)) if shared else None,
        pick=torch.tensor(pick, dtype=torch.long, device=device),
        targets=torch.tensor(targets, dtype=torch.long, device=device),
    )


# --------------------------------------------------------------------------- shared-prefix layout


def continuation_tiers(conts: list[int]) -> list[tuple[int, int]]:
    """Row ranges ``[start, end)`` of continuation lengths ``conts`` (sorted longest first), each run as one
    forward padded to its first row's length.

    A new tier starts where capping every remaining row at its length saves more than
    ``TIER_OVERHEAD_TOKENS`` padded tokens, one more forward's fixed cost: a few long answers no longer
    pad every short one to their length.
    """
    tiers: list[tuple[int, int]] = []
    start = 0
    for r, c in enumerate(conts):
        if r > start and (conts[start] - c) * (len(conts) - r) > TIER_OVERHEAD_TOKENS:
            tiers.append((start, r))
            start = r
    if conts:
        tiers.append((start, len(conts)))
    return tiers


def _rows_longest_first(samples: list[Sample], units: list[list[int]]) -> list[tuple[int, int]]:
    """(sample index, unit) of every row, longest continuation first (ties: unit, then sample)."""
    rows = [(i, u) for u, unit in enumerate(units) for i in unit]
    return sorted(rows, key=lambda row: (-_continuation(samples, row[0]), row[1], row[0]))


def shared_prefix_cost(samples: list[Sample], units: list[list[int]], cont_of: dict[int, int] | None = None) -> int:
    """Tokens one shared-prefix micro-batch of ``units`` processes, padding included. ``cont_of``: each sample's
    continuation length, when the caller has them (the planner asks for many candidate batches)."""
    rows = [i for u in units for i in u]
    conts = sorted((_continuation(samples, i) if cont_of is None else cont_of[i] for i in rows), reverse=True)
    prompt = max(len(samples[u[0]].prompt_ids) for u in units)
    return len(units) * prompt + sum((end - start) * conts[start] for start, end in continuation_tiers(conts))


def plan_shared_prefix(samples: list[Sample], indices: list[int], token_budget: int) -> list[list[list[int]]]:
    """Micro-batches of prompt units (each a list of sample indices sharing one prompt) within ``token_budget``.

    A group too large for the budget is cut into units that fit (each re-runs its prompt). Units are
    ordered by continuation length (longest first), then packed greedily. Deterministic.
    """
    if token_budget < 1:
        raise ValueError("trainer.micro_batch_tokens must be >= 1")
    cont_of = {i: _continuation(samples, i) for i in indices}
    units: list[list[int]] = []
    for group in prompt_units(samples, indices):
        group = sorted(group, key=lambda i: (-cont_of[i], i))
        unit: list[int] = []
        for i in group:
            if unit and shared_prefix_cost(samples, [unit + [i]], cont_of) > token_budget:
                units.append(unit)
                unit = []
            unit.append(i)
        units.append(unit)
    units.sort(key=lambda u: (-max(cont_of[i] for i in u), -len(samples[u[0]].prompt_ids), u[0]))
    batches: list[list[list[int]]] = []
    current: list[list[int]] = []
    for unit in units:
        if current and shared_prefix_cost(samples, current + [unit], cont_of) > token_budget:
            batches.append(current)
            current = []
        current.append(unit)
    if current:
        batches.append(current)
    return batches


_FORWARD_KEYWORDS: dict[type, frozenset[str]] = {}


def _forward_keywords(forward: Forward) -> frozenset[str]:
    """The keyword arguments the model behind ``forward`` takes (a module, or ParallelModel.forward)."""
    owner = forward if isinstance(forward, torch.nn.Module) else getattr(forward, "__self__", None)
    module = getattr(owner, "module", owner)
    if not isinstance(module, torch.nn.Module):
        return frozenset()
    kind = type(module)
    if kind not in _FORWARD_KEYWORDS:
        _FORWARD_KEYWORDS[kind] = frozenset(inspect.signature(module.forward).parameters)
    return _FORWARD_KEYWORDS[kind]


@dataclass
class ContinuationTier:
    """Rows of a shared-prefix batch continued by one forward, padded to ``C`` tokens."""

    units: Tensor  # [b] unit of each row: which prompt's cache it continues
    input_ids: Tensor  # [b, C] the responses but their last token
    attention_mask: Tensor  # [b, P + C]: the unit's prompt (P = the batch's prompt width), then these
    position_ids: Tensor  # [b, C]


@dataclass
class SharedPrefixBatch(ResponseLayout):
    """Prompt units run once, their responses continued from the expanded cache; the grid is ``[B, R]``
    (column ``j`` = response token ``j``), rows longest continuation first."""

    prefix_ids: Tensor = field(default_factory=lambda: torch.empty(0))  # [U, P] right-padded prompts
    prefix_mask: Tensor = field(default_factory=lambda: torch.empty(0))  # [U, P]
    prefix_last: Tensor = field(default_factory=lambda: torch.empty(0))  # [U] column of each prompt's last token
    tiers: list[ContinuationTier] = field(default_factory=list)  # those with at least one column
    pick: Tensor = field(default_factory=lambda: torch.empty(0))  # [n] row of [first; each tier's] logits
    targets: Tensor = field(default_factory=lambda: torch.empty(0))  # [n]

    def logits_and_targets(self, forward: Forward, prefix_forward: Forward | None = None) -> tuple[Tensor, Tensor]:
        """The logits predicting each response token ``[n, V]`` and the tokens ``[n]``.

        Every forward but the last runs through ``prefix_forward`` (with ddp: the module itself, so that only
        the micro-batch's last forward goes through the wrapper that reduces gradients).
        """
        passes = 1 + len(self.tiers)
        forwards = [prefix_forward or forward] * (passes - 1) + [forward]
        kwargs: dict[str, Any] = {}
        last_columns = torch.unique(self.prefix_last)
        if "logits_to_keep" in _forward_keywords(forwards[0]):  # the lm head only where a first token is predicted
            kwargs["logits_to_keep"] = last_columns
        else:
            last_columns = torch.arange(self.prefix_ids.shape[1], device=self.prefix_ids.device)
        out = forwards[0](
            input_ids=self.prefix_ids,
            attention_mask=self.prefix_mask,
            position_ids=positions_from_mask(self.prefix_mask),
            use_cache=bool(self.tiers),
            **kwargs,
        )
        kept = torch.searchsorted(last_columns, self.prefix_last)
        logits = [out.logits[torch.arange(len(kept), device=kept.device), kept]]  # [U, V]
        if self.tiers:
            cache = getattr(out, "cache", None) or out.past_key_values  # transformers 5 / 4
            layers = [(layer.keys, layer.values) for layer in cache.layers]
            # transformers 5 renamed `past_key_values` to `cache`; pass whichever the model takes.
            cache_kw = "cache" if "cache" in _forward_keywords(forward) else "past_key_values"
            for tier, tier_forward in zip(self.tiers, forwards[1:], strict=True):
                # Indexing keeps the graph: gradients flow back into the prompt's positions.
                expanded = type(cache)(ddp_cache_data=[(k[tier.units], v[tier.units]) for k, v in layers])
                tier_logits = tier_forward(
                    input_ids=tier.input_ids,
                    attention_mask=tier.attention_mask,
                    position_ids=tier.position_ids,
                    use_cache=False,
                    **{cache_kw: expanded},
                ).logits
                logits.append(tier_logits.reshape(-1, tier_logits.shape[-1]))
        return torch.cat(logits)[self.pick], self.targets


def collate_shared_prefix(
    samples: list[Sample], units: list[list[int]], pad_id: int, device: torch.device
) -> SharedPrefixBatch:
    prompts = [samples[u[0]].prompt_ids for u in units]
    width = max(len(p) for p in prompts)
    prefix_ids = torch.full((len(units), width), pad_id, dtype=torch.long)
    prefix_mask = torch.zeros((len(units), width), dtype=torch.long)
    for u, prompt in enumerate(prompts):
        prefix_ids[u, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        prefix_mask[u, : len(prompt)] = 1
    order = _rows_longest_first(samples, units)
    conts = [_continuation(samples, i) for i, _ in order]
    tiers: list[ContinuationTier] = []
    pick: list[int] = []
    offset = len(units)  # rows of the concatenated logits before the current tier's
    for start, end in continuation_tiers(conts):
        cont = conts[start]
        if cont == 0:  # every row of the tier has a one-token response: the prompt's logits are all it needs
            pick.extend(u for i, u in order[start:end] if samples[i].response_ids)
            continue
        input_ids = torch.full((end - start, cont), pad_id, dtype=torch.long)
        mask = torch.zeros((end - start, width + cont), dtype=torch.long)
        positions = torch.zeros((end - start, cont), dtype=torch.long)
        for t, (i, u) in enumerate(order[start:end]):
            p, c = len(prompts[u]), conts[start + t]
            input_ids[t, :c] = torch.tensor(samples[i].response_ids[:c], dtype=torch.long)
            mask[t, :p] = 1
            mask[t, width : width + c] = 1
            positions[t] = torch.arange(p, p + cont)  # padding columns continue the count: never attended
            n = len(samples[i].response_ids)
            # Token 0 is predicted by the prompt's last position, token j >= 1 by this tier's column j - 1.
            pick.extend([u] + [offset + t * cont + j - 1 for j in range(1, n)] if n else [])
        tiers.append(
            ContinuationTier(
                torch.tensor([u for _, u in order[start:end]], dtype=torch.long, device=device),
                input_ids.to(device),
                mask.to(device),
                positions.to(device),
            )
        )
        offset += (end - start) * cont
    indices = [i for i, _ in order]
    lengths = [len(samples[i].response_ids) for i in indices]
    rows = [r for r, n in enumerate(lengths) for _ in range(n)]
    cols = [j for n in lengths for j in range(n)]
    return SharedPrefixBatch(
        **_layout(indices, rows, cols, lengths, max(max(lengths, default=0), 1), device),
        prefix_ids=prefix_ids.to(device),
        prefix_mask=prefix_mask.to(device),
        prefix_last=torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long, device=device),
        tiers=tiers,
        pick=torch.tensor(pick, dtype=torch.long, device=device),
        targets=torch.tensor([t for i in indices for t in samples[i].response_ids], dtype=torch.long, device=device),
    )


# --------------------------------------------------------------------------- choosing the layout


LAYOUTS = ("packed", "padded", "shared_prefix")


@dataclass
class MicroBatchPlan:
    """A mini-batch's micro-batches in one layout (:data:`LAYOUTS`), and the tokens they process (padding
    included) and of those, the real ones."""

    layout: str
    batches: list[Any]  # padded: lists of sample indices; packed: lists of rows of units; shared: lists of units
    processed_tokens: int
    real_tokens: int

    def __len__(self) -> int:
        return len(self.batches)

    @property
    def shared_prefix(self) -> bool:
        return self.layout == "shared_prefix"

    def prompt_sharing_batches(self) -> int:
        """Micro-batches that run a prompt once for several samples (any layout)."""
        if self.layout == "shared_prefix":
            return len(self.batches)
        if self.layout == "packed":
            return sum(1 for rows in self.batches if any(len(unit) > 1 for row in rows for unit in row))
        return 0

    def collate(self, k: int, samples: list[Sample], pad_id: int, device: torch.device) -> ResponseLayout:
        if self.layout == "shared_prefix":
            return collate_shared_prefix(samples, self.batches[k], pad_id, device)
        if self.layout == "packed":
            return collate_packed(samples, self.batches[k], pad_id, device)
        return collate_padded(samples, self.batches[k], pad_id, device)


def plan_micro_batches(
    samples: list[Sample],
    indices: list[int],
    token_budget: int,
    allow_shared_prefix: bool,
    packed: bool = True,
    share_prompts: bool = False,
    width_scale: float = DEFAULT_ATTENTION_WIDTH,
) -> MicroBatchPlan:
    """``indices`` packed (``packed``; with ``share_prompts`` a group's samples share their prompt in a row) or
    right-padded, or in the shared-prefix layout when that is allowed and processes at least
    ``SHARED_PREFIX_MIN_SAVING`` fewer tokens."""
    base: MicroBatchPlan
    cont_of = {i: _continuation(samples, i) for i in indices}
    if packed:
        batches: list[Any] = plan_packed_units(samples, indices, token_budget, share_prompts, width_scale)
        widths = [[sum(unit_tokens(samples, u, cont_of) for u in row) for row in rows] for rows in batches]
        processed = sum(len(fills) * max(fills) for fills in widths)
        base = MicroBatchPlan("packed", batches, processed, sum(sum(fills) for fills in widths))
    else:
        lengths = [samples[i].num_tokens for i in indices]
        local = make_micro_batches(lengths, token_budget)
        batches = [[indices[j] for j in b] for b in local]
        base = MicroBatchPlan("padded", batches, padded_tokens(lengths, local), sum(lengths))
    if not allow_shared_prefix or len({tuple(samples[i].prompt_ids) for i in indices}) == len(indices):
        return base  # not allowed, or no prompt repeats: nothing to share
    shared = plan_shared_prefix(samples, indices, token_budget)
    processed = sum(shared_prefix_cost(samples, b, cont_of) for b in shared)
    if processed > (1.0 - SHARED_PREFIX_MIN_SAVING) * base.processed_tokens:
        return base
    real = sum(len(samples[u[0]].prompt_ids) + sum(cont_of[i] for i in u) for b in shared for u in b)
    return MicroBatchPlan("shared_prefix", shared, processed, real)
