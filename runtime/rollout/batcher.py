"""Continuous batching: a fixed set of KV-cache slots, each refilled with the next request as soon as its
sequence finishes, so one long sample no longer holds a whole batch.

One :meth:`ContinuousBatcher.step` is one engine step: it takes any staged weight update (so
in-flight sequences continue under the new weights — their earlier tokens' KV entries stay as
computed, nothing is thrown away), decodes one token for every live sequence, then admits waiting
requests into free slots (prefilled together; a prompt repeated within the admitted requests — a GRPO
group's — is prefilled once and its cache copied to the other slots) and samples their first token.
Every token records the weight version current at its step.

Admission keeps the live tokens under the engine's ``max_batch_tokens`` (each request reserves its
prompt plus its ``max_new_tokens``; one request, or group, is always admitted into an empty batcher) and the
live sequences under ``max_batch_size`` slots. ``refill=False`` gives static batching (a new batch only
when every slot is empty, finished rows computed until the batch ends) — the baseline the benchmark
compares against.

Bubble accounting: ``allocated_tokens`` counts every token position a forward pass computed (prefill
padding, and decode rows of finished or empty slots below the highest live one); ``real_tokens`` the
prompt and response tokens of live sequences; ``padding_ratio = 1 - real / allocated``. When nothing
is waiting, live sequences are moved down into empty slots (one cache copy each), so the tail of a
run — fewer live sequences than slots — computes no empty rows.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.rollout.sampling import Completion, SamplingParams, sample_tokens


@dataclass
class BatchStats:
    """Token accounting of one batcher (or, summed, of an engine)."""

    steps: int = 0
    real_tokens: int = 0  # prompt + generated tokens of live sequences
    allocated_tokens: int = 0  # token positions computed, padding included
    generated_tokens: int = 0
    completed: int = 0

    @property
    def padding_ratio(self) -> float:
        """``1 - real / allocated``: the share of computed token positions that were padding."""
        return 1.0 - self.real_tokens / self.allocated_tokens if self.allocated_tokens else 0.0

    def add(self, other: BatchStats) -> None:
        for name in ("steps", "real_tokens", "allocated_tokens", "generated_tokens", "completed"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict[str, float]:
        return {
            "steps": self.steps,
            "real_tokens": self.real_tokens,
            "allocated_tokens": self.allocated_tokens,
            "generated_tokens": self.generated_tokens,
            "completed": self.completed,
            "padding_ratio": round(self.padding_ratio, 6),
        }


@dataclass
class _Live:
    """One sequence in a slot. ``col`` is the cache column its last token will be written at."""

    tag: Any
    prompt_len: int
    max_new: int
    col: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    @property
    def reserved(self) -> int:
        return self.prompt_len + self.max_new


class ContinuousBatcher:
    """Requests in (``submit``), completions out (``step``), over one :class:`~runtime.rollout.Engine`.

    ``submit`` may be called from other threads; ``step`` from one thread at a time. The engine's KV
    cache serves one batcher with sequences in flight at a time.
    """

    def __init__(
        self,
        engine: Any,
        params: SamplingParams,
        generator: torch.Generator | None = None,
        refill: bool = True,
    ):
        self.engine = engine
        self.params = params
        self.generator = generator
        self.refill = refill
        self.stats = BatchStats()
        self.slots: list[_Live | None] = [None] * engine.max_batch_size
        # each entry a gang: requests admitted together or not at all (one request, or a submit_group)
        self._waiting: deque[list[tuple[Any, list[int], int]]] = deque()
        self._lock = threading.Lock()
        self._allocated = False
        self._static_rows = 0
        self.admitted: list[Any] = []  # tags admitted into a slot since the caller last cleared it (queue waits)
        stops = set(params.stop_ids)
        if not params.ignore_eos:
            stops.add(engine.tokenizer.eos_id)
        self._stops = frozenset(stops)

    # ----- requests ------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], tag: Any = None, max_new_tokens: int | None = None) -> None:
        """Queue one request (one sequence; expand ``n`` yourself). ``max_new_tokens`` lowers the sampling
        params' limit for this request only. Checked at once: bad prompts raise here."""
        self.engine._check_prompts([prompt_ids], self.params)
        limit = request_limit(self.params, max_new_tokens)
        with self._lock:
            self._waiting.append([(tag, list(prompt_ids), limit)])

    def submit_group(self, requests: list[tuple[list[int], Any]]) -> None:
        """Queue ``(prompt_ids, tag)`` requests admitted into slots at the same step, or not at all — e.g.
        a GRPO group, whose samples then all start on the same weights (one staleness for the group)."""
        if not 1 <= len(requests) <= len(self.slots):
            raise ValueError(
                f"a group of {len(requests)} requests does not fit {len(self.slots)} slots (max_batch_size)"
            )
        self.engine._check_prompts([ids for ids, _ in requests], self.params)
        limit = self.params.max_new_tokens
        with self._lock:
            self._waiting.append([(tag, list(ids), limit) for ids, tag in requests])

    @property
    def num_waiting(self) -> int:
        return sum(map(len, self._waiting))

    @property
    def num_live(self) -> int:
        return len(self.slots) - self.slots.count(None)  # asked before every submit: a C-level count

    @property
    def idle(self) -> bool:
        """Nothing waiting and nothing in flight."""
        return not self._waiting and self.num_live == 0

    def wants_more(self) -> bool:
        """Whether a request submitted now could be admitted at the next step (for lazy feeding)."""
        if not self.refill and self.num_live:
            return False
        return self.num_waiting < len(self.slots) - self.num_live

    def cancel(self, drop: Callable[[Any], bool]) -> int:
        """Forget every waiting and live request whose tag ``drop`` accepts (work nobody wants any more,
        e.g. issued before a rollback); their slots are free at the next step. Returns how many."""
        with self._lock:
            count = self.num_waiting
            gangs = ([r for r in gang if not drop(r[0])] for gang in self._waiting)
            self._waiting = deque(gang for gang in gangs if gang)
            count -= self.num_waiting
        for r, s in enumerate(self.slots):
            if s is not None and drop(s.tag):
                self.slots[r] = None
                count += 1
        return count

    # ----- stepping ------------------------------------------------------------------------------
    def step(self) -> list[tuple[Any, Completion]]:
        """One engine step; returns the ``(tag, completion)`` pairs that finished in it."""
        engine = self.engine
        engine._begin_step()
        try:
            if engine._weights_epoch != engine._loaded_epoch:  # new weights: re-read the fused copies
                engine.runner.load_weights()
                engine._loaded_epoch = engine._weights_epoch
            finished: list[tuple[Any, Completion]] = []
            model = engine.model
            # No dropout while sampling (restored for a co-located trainer). Only a runner that calls the
            # model's modules needs it, and toggling walks every module: a quarter of a small model's step.
            was_training = model.training and engine.runner.uses_modules
            if was_training:
                model.eval()
            try:
                with torch.inference_mode():
                    if self.num_live:
                        self._decode(finished)
                    self._admit(finished)
            finally:
                if was_training:
                    model.train(True)
            self.stats.steps += 1
            engine.stats.steps += 1
            return finished
        finally:
            engine._end_step()

    def _count(self, real: int, allocated: int, generated: int) -> None:
        for stats in (self.stats, self.engine.stats):
            stats.real_tokens += real
            stats.allocated_tokens += allocated
            stats.generated_tokens += generated

    def _compact(self) -> None:
        """Move the highest live sequences into the lowest empty slots, so a decode computes no empty row.

        Only when nothing waits (a waiting request refills the holes instead) and with refill on: it
        costs one copy of a sequence's cache rows, once, and saves a padding row at every later step.
        """
        if not self.refill or self._waiting:
            return
        while True:
            live = [r for r, s in enumerate(self.slots) if s is not None]
            holes = [r for r in range(len(live)) if self.slots[r] is None]
            if not holes:
                return
            src, dst = live[-1], holes[0]
            self.engine.runner.move(src, dst)
            self.slots[dst], self.slots[src] = self.slots[src], None

    def _decode(self, finished: list[tuple[Any, Completion]]) -> None:
        self._compact()
        live = [r for r, s in enumerate(self.slots) if s is not None]
        rows = self._static_rows if not self.refill else live[-1] + 1
        pad = self.engine.tokenizer.pad_id
        toks = [pad] * rows
        cols = [0] * rows  # empty slots run at column 0 (their contents are dead)
        for r in live:
            s = self.slots[r]
            assert s is not None
            toks[r], cols[r] = s.tokens[-1], s.col
        dev = self.engine.device
        logits = self.engine.runner.decode(torch.tensor(toks, device=dev), torch.tensor(cols, device=dev))
        if len(live) != rows:
            logits = logits[torch.tensor(live, device=dev)]
        self._count(len(live), rows, len(live))
        self._record(live, logits, finished)

    def _admit(self, finished: list[tuple[Any, Completion]]) -> None:
        if not self._waiting or (not self.refill and self.num_live):
            return
        free = [r for r, s in enumerate(self.slots) if s is None]
        reserved = sum(s.reserved for s in self.slots if s is not None)
        engine, budget = self.engine, self.engine.max_batch_tokens
        taken: list[tuple[int, _Live, list[int]]] = []
        with self._lock:
            while self._waiting and len(taken) + len(self._waiting[0]) <= len(free):
                gang = [(tag, ids, min(limit, engine.max_positions - len(ids))) for tag, ids, limit in self._waiting[0]]
                need = sum(len(ids) + max_new for _, ids, max_new in gang)
                if (taken or reserved) and reserved + need > budget:
                    break  # FIFO: the head waits for room rather than being overtaken
                self._waiting.popleft()
                reserved += need
                for tag, ids, max_new in gang:
                    taken.append((free[len(taken)], _Live(tag, len(ids), max_new, len(ids)), ids))
        if not taken:
            return
        width = max(s.reserved for _, s, _ in taken)
        owner = engine._cache_owner
        if owner is not self and owner is not None and not owner.idle:
            with self._lock:  # put them back: this batcher has not started
                self._waiting.extendleft([(s.tag, ids, s.max_new)] for _, s, ids in reversed(taken))
            raise RuntimeError("another batcher of this engine still has sequences in flight; one at a time")
        engine._cache_owner = self
        if not self._allocated:
            engine.runner.allocate(len(self.slots), width, engine.device)
            self._allocated = True
        else:
            engine.runner.grow(width)
        slots = [r for r, _, _ in taken]
        logits, real, computed = self._prefill(slots, [ids for _, _, ids in taken])
        for r, s, _ in taken:
            self.slots[r] = s
            self.admitted.append(s.tag)
        if not self.refill:
            self._static_rows = max(slots) + 1
        self._count(real, computed, len(taken))
        self._record(slots, logits, finished)

    def _prefill(self, slots: list[int], prompts: list[list[int]]) -> tuple[torch.Tensor, int, int]:
        """Prefill each distinct prompt once, copy its cache to the slots that repeat it; returns every
        slot's next-token logits, the prompt tokens computed and the positions computed (padding included)."""
        requests: dict[tuple[int, ...], list[int]] = {}  # each distinct prompt -> the requests that have it
        for j, ids in enumerate(prompts):
            requests.setdefault(tuple(ids), []).append(j)
        firsts = [js[0] for js in requests.values()]
        engine = self.engine
        pad = engine.tokenizer.pad_id
        logits, computed = engine.runner.prefill([prompts[j] for j in firsts], [slots[j] for j in firsts], pad)
        which = [0] * len(prompts)  # each request's row of ``logits``
        for u, js in enumerate(requests.values()):
            for j in js:
                which[j] = u
            if len(js) > 1:
                engine.runner.share_prefix(slots[js[0]], [slots[j] for j in js[1:]], len(prompts[js[0]]))
        return logits[torch.tensor(which, device=logits.device)], sum(len(prompts[j]) for j in firsts), computed

    def _record(self, rows: list[int], logits: torch.Tensor, finished: list[tuple[Any, Completion]]) -> None:
        """Sample one token per row of ``logits`` (the slots ``rows``), append it, retire finished rows."""
        tokens, logprobs = sample_tokens(logits, self.params, self.generator)
        version = self.engine.version
        for r, tok, lp in zip(rows, tokens.tolist(), logprobs.tolist(), strict=True):
            s = self.slots[r]
            assert s is not None
            s.tokens.append(tok)
            s.logprobs.append(lp)
            s.versions.append(version)
            stopped = tok in self._stops
            if stopped or len(s.tokens) >= s.max_new:
                index = s.tag if isinstance(s.tag, int) else -1
                reason = "stop" if stopped else "length"
                finished.append((s.tag, Completion(index, s.tokens, s.logprobs, s.versions, reason)))
                self.slots[r] = None
                self.stats.completed += 1
                self.engine.stats.completed += 1
            else:
                s.col += 1 if len(s.tokens) > 1 else 0  # the prefill token is written at col = prompt length

    def run(self, requests: Iterable[tuple[Any, list[int]]], on_complete: Callable[[Any, Completion], None]) -> None:
        """Feed ``(tag, prompt_ids)`` from ``requests`` lazily (as slots free) and step until all are done."""
        drive(self, requests, on_complete)


def request_limit(params: SamplingParams, max_new_tokens: int | None) -> int:
    """The new-token limit of one request: the sampling params', or a lower one asked for this request."""
    limit = params.max_new_tokens
    if max_new_tokens is not None:
        if not 1 <= max_new_tokens <= limit:
            raise ValueError(f"max_new_tokens must be in [1, {limit}], got {max_new_tokens}")
        limit = max_new_tokens
    return limit


def drive(
    batcher: Any, requests: Iterable[tuple[Any, list[int]]], on_complete: Callable[[Any, Completion], None]
) -> None:
    """Feed ``(tag, prompt_ids)`` from ``requests`` to ``batcher`` lazily (as its slots free) and step it until all
    are done; ``on_complete(tag, completion)`` per finished sequence. Any batcher with ``wants_more``, ``submit``,
    ``idle`` and ``step`` (the built-in one, vLLM's)."""
    source = iter(requests)
    exhausted = False
    while True:
        while not exhausted and batcher.wants_more():
            try:
                tag, ids = next(source)
            except StopIteration:
                exhausted = True
                break
            batcher.submit(ids, tag)
        if batcher.idle:
            if exhausted:
                return
            continue
        for tag, completion in batcher.step():
            on_complete(tag, completion)
