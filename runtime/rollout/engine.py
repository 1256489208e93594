"""The built-in generation engine: batched sampling with a KV cache over the trainer's own model.

``Engine.generate`` expands each prompt ``n`` times, groups the sequences into batches (sorted by
prompt length so left padding stays small), prefills each batch once and decodes one token per step
until every row has hit a stop token or ``max_new_tokens``. Each completion carries its token ids,
the log-probability of each token, the weight version that produced each token, and why it ended.

Log-probabilities are those of the temperature-scaled distribution ``softmax(logits / temperature)``
*before* top-k / top-p truncation — exactly what the trainer recomputes with
``token_logprobs(..., temperature=T)``, so engine and trainer are compared on the same math. With
top-k/top-p the token was actually drawn from the renormalised truncated distribution; the difference
is the truncation mass, which the trainer's off-policy correction treats like any other mismatch.
Greedy decoding (``temperature=0``) reports temperature-1 log-probabilities.

Weights change only at a batch boundary: ``update_weights`` called from another thread while a
``generate`` is running is staged and applied before the next batch (the engine's *latest available*
version becomes *current*), so every token of one batch comes from one version.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from runtime.models.logprobs import logprobs_from_logits
from runtime.rollout.runners import make_runner


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``top_k=0`` and ``top_p=1`` switch those filters off; ``temperature=0`` is greedy."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_ids: tuple[int, ...] = ()
    n: int = 1
    ignore_eos: bool = False  # benchmarks: force exactly max_new_tokens tokens

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")


@dataclass
class Completion:
    """One sampled response to prompt number ``prompt_index`` of the ``generate`` call."""

    prompt_index: int
    token_ids: list[int]  # includes the stop token when finish_reason == "stop"
    logprobs: list[float]
    versions: list[int]  # weight version that produced each token
    finish_reason: str  # "stop" | "length"


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from ``logits [B, V]``; returns (tokens [B], logprobs [B]) — see module doc."""
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, logprobs_from_logits(logits, tokens, 1.0)
    scaled = logits / params.temperature if params.temperature != 1.0 else logits
    logp = scaled.log_softmax(-1)
    filtered = scaled
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(filtered, params.top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = probs.cumsum(-1) - probs >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(filtered, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logp.exp() if filtered is scaled else filtered.softmax(-1)
    # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws exactly from p in a few cheap ops
    # (torch.multinomial and Tensor.exponential_ cost several times more per step on CPU).
    race = torch.rand(probs.shape, generator=generator, device=probs.device).log_().neg_()
    tokens = (probs / race).argmax(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


class Engine:
    """Generation over ``model`` (shared with the trainer when co-located) on ``device``."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        device: torch.device | str,
        max_batch_size: int = 64,
        max_batch_tokens: int = 16384,
        version: int = 0,
    ):
        if max_batch_size < 1 or max_batch_tokens < 1:
            raise ValueError("max_batch_size and max_batch_tokens must be >= 1")
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.version = version
        self.runner = make_runner(model)
        self.max_positions = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self._lock = threading.Lock()
        self._busy = False
        self._pending: tuple[dict[str, torch.Tensor] | None, int] | None = None

    # ----- weights -------------------------------------------------------------------------------
    def update_weights(self, state_dict: dict[str, torch.Tensor] | None, version: int) -> None:
        """Make ``version`` current: copy ``state_dict`` into the model (None: the model already holds it).

        Applied at once when idle; during a ``generate`` it waits for the next batch boundary.
        """
        if state_dict is not None:
            self._check_keys(state_dict)
        with self._lock:  # held while copying, so a generate cannot start on half-copied weights
            if self._busy:
                self._pending = (state_dict, version)
                return
            self._apply(state_dict, version)

    def _check_keys(self, state_dict: dict[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        unknown = sorted(set(state_dict) - set(own))
        if unknown:
            raise ValueError(f"update_weights: unknown parameter names {unknown[:5]}")
        for name, tensor in state_dict.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(
                    f"update_weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}"
                )

    def _apply(self, state_dict: dict[str, torch.Tensor] | None, version: int) -> None:
        if state_dict is not None:
            params = self.model.state_dict()
            with torch.no_grad():
                for name, tensor in state_dict.items():
                    params[name].copy_(tensor)
        self.version = version

    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            self._apply(*pending)

    # ----- generation ----------------------------------------------------------------------------
    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams, generator: torch.Generator | None = None
    ) -> list[Completion]:
        """``n`` completions per prompt, in prompt order (prompt 0's n samples first).

        ``generator`` (on the engine's device) makes sampling reproducible: same seed, same prompts, same
        weights -> same completions.
        """
        self._check_prompts(prompt_ids, params)
        items = [i for i in range(len(prompt_ids)) for _ in range(params.n)]
        with self._lock:
            self._busy = True
        try:
            results: list[Completion | None] = [None] * len(items)
            for batch in self._batches(items, prompt_ids, params):
                self._apply_pending()  # batch boundary: the latest available weights become current
                done = self._generate_batch([prompt_ids[items[j]] for j in batch], params, generator)
                for j, (tokens, logprobs, reason) in zip(batch, done, strict=True):
                    results[j] = Completion(items[j], tokens, logprobs, [self.version] * len(tokens), reason)
        finally:
            with self._lock:
                self._busy = False
                pending, self._pending = self._pending, None
                if pending is not None:  # arrived during the last batch: apply it now, at this boundary
                    self._apply(*pending)
        return [c for c in results if c is not None]

    def _check_prompts(self, prompt_ids: list[list[int]], params: SamplingParams) -> None:
        vocab = self.model.config.vocab_size
        for i, ids in enumerate(prompt_ids):
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab})")
            if len(ids) >= self.max_positions:
                raise ValueError(f"prompt {i} has {len(ids)} tokens; the model takes at most {self.max_positions}")

    def _batches(self, items: list[int], prompt_ids: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Indices into ``items`` grouped into batches by size and token budget, similar lengths together."""
        order = sorted(range(len(items)), key=lambda j: len(prompt_ids[items[j]]))
        batches: list[list[int]] = []
        current: list[int] = []
        longest = 0
        for j in order:
            length = len(prompt_ids[items[j]]) + params.max_new_tokens
            widest = max(longest, length)
            if current and (len(current) >= self.max_batch_size or widest * (len(current) + 1) > self.max_batch_tokens):
                batches.append(current)
                current, widest = [], length
            current.append(j)
            longest = widest
        if current:
            batches.append(current)
        return batches

    @torch.inference_mode()
    def _generate_batch(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | None
    ) -> list[tuple[list[int], list[float], str]]:
        dev = self.device
        bsz, plen = len(prompts), max(len(p) for p in prompts)
        max_new = min(params.max_new_tokens, self.max_positions - plen)
        pad = self.tokenizer.pad_id
        ids = torch.full((bsz, plen), pad, dtype=torch.long)
        key_valid = torch.zeros((bsz, plen + max_new), dtype=torch.bool)
        for r, p in enumerate(prompts):  # left padding: every prompt ends at column plen - 1
            ids[r, plen - len(p) :] = torch.tensor(p)
            key_valid[r, plen - len(p) : plen] = True
        ids, key_valid = ids.to(dev), key_valid.to(dev)
        positions = (key_valid[:, :plen].long().cumsum(-1) - 1).clamp(min=0)
        next_pos = key_valid[:, :plen].sum(-1)
        stops = set(params.stop_ids)
        if not params.ignore_eos:
            stops.add(self.tokenizer.eos_id)
        stop_ids = torch.tensor(sorted(stops), dtype=torch.long, device=dev)

        out_tokens = torch.full((bsz, max_new), pad, dtype=torch.long, device=dev)
        out_logprobs = torch.zeros((bsz, max_new), dtype=torch.float32, device=dev)
        finished = torch.zeros(bsz, dtype=torch.bool, device=dev)
        stopped = torch.zeros(bsz, dtype=torch.bool, device=dev)
        lengths = torch.full((bsz,), max_new, dtype=torch.long, device=dev)

        was_training = self.model.training
        self.model.eval()  # no dropout while sampling; restored for a co-located trainer
        try:
            self.runner.start(bsz, plen + max_new, dev)
            logits = self.runner.prefill(ids, positions, key_valid)
            for t in range(max_new):
                tokens, logprobs = sample_tokens(logits, params, generator)
                tokens = tokens.masked_fill(finished, pad)
                out_tokens[:, t] = tokens
                out_logprobs[:, t] = logprobs
                hit = torch.isin(tokens, stop_ids) & ~finished
                lengths = torch.where(hit, t + 1, lengths)
                stopped |= hit
                finished |= hit
                if t + 1 == max_new or bool(finished.all()):
                    break
                key_valid[:, plen + t] = True
                logits = self.runner.decode(tokens, next_pos, key_valid, plen + t)
                next_pos = next_pos + 1
        finally:
            self.model.train(was_training)

        toks, lps, lens, stp = out_tokens.tolist(), out_logprobs.tolist(), lengths.tolist(), stopped.tolist()
        return [(toks[r][: lens[r]], lps[r][: lens[r]], "stop" if stp[r] else "length") for r in range(bsz)]
