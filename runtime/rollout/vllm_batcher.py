"""The request queue of the vLLM engine, with :class:`~runtime.rollout.batcher.ContinuousBatcher`'s interface:
``submit`` / ``submit_group``, ``step``, ``idle``, ``wants_more``, ``cancel``, ``admitted``, ``run``, ``stats``.

Continuous batching itself is vLLM's: this queue adds waiting requests to vLLM's engine as its
``max_batch_size`` sequence slots (vLLM's ``max_num_seqs``) free up — a group's requests together or
not at all, so a GRPO group starts on one weight version — steps the engine, and collects each
request's new tokens. Requests are streamed (``RequestOutputKind.DELTA``): every step's tokens are
tagged with the weight version current during that step, so a sequence that crosses a weight update
records both versions, as the built-in engine's do.

vLLM 0.30's request calls (``vllm/v1/engine/llm_engine.py``): ``add_request(request_id, prompt, params)``
returns vLLM's internal id (ours plus a random suffix); its ``RequestOutput.request_id`` and
``abort_request(ids)`` use ours, so this queue keeps ours only. A ``DELTA`` output's
``outputs[0].logprobs`` holds one ``{token id: Logprob}`` per new token (``vllm/outputs.py``,
``vllm/v1/engine/output_processor.py``). vLLM's own finish reasons are "stop", "length", "abort", "error"
and "repetition"; this queue asks for none that could end in the last three, so they are errors.

Token accounting: vLLM packs its batches and pages its KV cache, so nothing here is padding:
``allocated_tokens`` equals ``real_tokens`` (the bubble the built-in engine measures is vLLM's own
business and not visible through its API).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.rollout.batcher import BatchStats, drive, request_limit
from runtime.rollout.sampling import Completion, SamplingParams

_request_ids = itertools.count()


class VLLMEngineError(RuntimeError):
    """vLLM's engine failed inside a step: the role ends naming vLLM (a run failure, resumed like any other)."""


# vLLM request ids are unique per engine; one counter for the process


@dataclass
class _Request:
    tag: Any
    prompt_ids: list[int]
    max_new: int
    seed: int | None
    request_id: str = ""
    counted_cache: bool = False  # vLLM's cached prompt tokens, counted at the request's first output
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    adapter_version: int | None = None  # LoRA: the version whose adapter the request generates with


class VLLMBatcher:
    """Requests in (``submit``), completions out (``step``), over one
    :class:`~runtime.rollout.vllm_adapter.VLLMEngine`. ``submit`` may be called from other threads; ``step``
    from one thread at a time."""

    def __init__(self, engine: Any, params: SamplingParams, generator: torch.Generator | None = None):
        self.engine = engine
        self.params = params
        self.generator = generator
        self.stats = BatchStats()
        self.admitted: list[Any] = []  # tags added to vLLM since the caller last cleared it (queue waits)
        self._waiting: deque[list[_Request]] = deque()  # gangs: added to vLLM together or not at all
        self._live: dict[str, _Request] = {}  # vLLM request id -> request
        self._lock = threading.Lock()

    # ----- requests ------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], tag: Any = None, max_new_tokens: int | None = None) -> None:
        """Queue one request (one sequence). ``max_new_tokens`` lowers the limit for this request only."""
        self.engine._check_prompts([prompt_ids], self.params)
        limit = request_limit(self.params, max_new_tokens)
        with self._lock:
            self._waiting.append([_Request(tag, list(prompt_ids), limit, self._seed())])

    def submit_group(self, requests: list[tuple[list[int], Any]]) -> None:
        """Queue ``(prompt_ids, tag)`` requests added to vLLM at the same step, or not at all."""
        if not 1 <= len(requests) <= self.engine.max_batch_size:
            raise ValueError(
                f"a group of {len(requests)} requests does not fit {self.engine.max_batch_size} slots (max_batch_size)"
            )
        self.engine._check_prompts([ids for ids, _ in requests], self.params)
        limit = self.params.max_new_tokens
        with self._lock:
            self._waiting.append([_Request(tag, list(ids), limit, self._seed()) for ids, tag in requests])

    def _seed(self) -> int | None:
        """A request's vLLM seed, drawn in submission order (None without a generator: vLLM's own RNG)."""
        g = self.generator
        if g is None:
            return None
        return int(torch.randint(0, 2**31 - 1, (1,), generator=g, device=g.device))

    @property
    def num_waiting(self) -> int:
        return sum(map(len, self._waiting))

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def idle(self) -> bool:
        """Nothing waiting and nothing in vLLM."""
        return not self._waiting and not self._live

    def wants_more(self) -> bool:
        """Whether a request submitted now could be added to vLLM at the next step (for lazy feeding)."""
        return self.num_waiting < self.engine.max_batch_size - self.num_live

    def cancel(self, drop: Callable[[Any], bool]) -> int:
        """Forget every waiting and live request whose tag ``drop`` accepts (live ones are aborted in vLLM)."""
        with self._lock:
            count = self.num_waiting
            gangs = ([r for r in gang if not drop(r.tag)] for gang in self._waiting)
            self._waiting = deque(gang for gang in gangs if gang)
            count -= self.num_waiting
        doomed = [rid for rid, r in self._live.items() if drop(r.tag)]
        if doomed:
            self.engine.llm.llm_engine.abort_request(doomed)
            for rid in doomed:
                del self._live[rid]
        return count + len(doomed)

    # ----- stepping ------------------------------------------------------------------------------
    def step(self) -> list[tuple[Any, Completion]]:
        """One vLLM engine step; returns the ``(tag, completion)`` pairs that finished in it."""
        engine = self.engine
        engine._begin_step()  # a staged weight update is applied here, before the step
        try:
            self._admit()
            finished: list[tuple[Any, Completion]] = []
            if self._live:
                version = engine.version  # fixed during the step: updates arriving now are staged
                try:
                    outputs = engine.llm.llm_engine.step()
                except Exception as exc:  # vLLM's own failure (its engine core died, a kernel raised, ...)
                    raise VLLMEngineError(f"vLLM's engine failed in a step: {type(exc).__name__}: {exc}") from exc
                for output in outputs:
                    self._record(output, version, finished)
            self.stats.steps += 1
            engine.stats.steps += 1
            return finished
        finally:
            engine._end_step()

    def _admit(self) -> None:
        free = self.engine.max_batch_size - len(self._live)
        taken: list[_Request] = []
        with self._lock:
            while self._waiting and len(taken) + len(self._waiting[0]) <= free:
                taken.extend(self._waiting.popleft())
        if not taken:
            return
        self.engine.claim(self)
        llm_engine = self.engine.llm.llm_engine
        salt = f"v{self.engine.version}"  # KV cached under one weight version never serves another
        lora = self.engine.lora_request
        pinned = self.engine.version if self.engine.adapters is not None else None
        for r in taken:
            r.request_id = f"tandem-{next(_request_ids)}"
            r.adapter_version = pinned
            params = self.engine.sampling_params(self.params, r.max_new, r.seed)
            # vLLM's TokensPrompt; the internal id it returns is not needed (outputs carry ours)
            prompt = {"prompt_token_ids": r.prompt_ids, "cache_salt": salt}
            llm_engine.add_request(r.request_id, prompt, params, lora_request=lora)
            self.engine.prompt_tokens += len(r.prompt_ids)
            self._live[r.request_id] = r
            self.admitted.append(r.tag)
            self._count(len(r.prompt_ids), 0)

    def _record(self, output: Any, version: int, finished: list[tuple[Any, Completion]]) -> None:
        r = self._live.get(output.request_id)
        if r is None:
            return  # aborted by cancel()
        if not r.counted_cache and output.num_cached_tokens is not None:
            r.counted_cache = True
            self.engine.cached_prompt_tokens += int(output.num_cached_tokens)
        new_tokens = 0
        for seq in output.outputs:  # n=1: one sequence per request
            tokens = list(seq.token_ids)
            r.tokens += tokens
            r.logprobs += [float(step[tok].logprob) for tok, step in zip(tokens, seq.logprobs or [], strict=True)]
            # a LoRA request generates with its adapter's version to its end
            r.versions += [version if r.adapter_version is None else r.adapter_version] * len(tokens)
            new_tokens += len(tokens)
        self._count(new_tokens, new_tokens)
        if not output.finished:
            return
        del self._live[output.request_id]
        reason = output.outputs[0].finish_reason if output.outputs else None
        if reason not in ("stop", "length"):  # "abort" / "error" / "repetition": not a sample to learn from
            raise RuntimeError(f"vLLM ended request {output.request_id} (tag {r.tag!r}) with finish_reason {reason!r}")
        index = r.tag if isinstance(r.tag, int) else -1
        finished.append((r.tag, Completion(index, r.tokens, r.logprobs, r.versions, reason)))
        self.stats.completed += 1
        self.engine.stats.completed += 1

    def adapter_versions(self) -> set[int]:
        """The LoRA versions live requests generate with (their adapters must stay loaded)."""
        return {r.adapter_version for r in self._live.values() if r.adapter_version is not None}

    def _count(self, real: int, generated: int) -> None:
        for stats in (self.stats, self.engine.stats):
            stats.real_tokens += real
            stats.allocated_tokens += real  # no padding: vLLM packs batches and pages its KV cache
            stats.generated_tokens += generated

    def run(self, requests: Iterable[tuple[Any, list[int]]], on_complete: Callable[[Any, Completion], None]) -> None:
        """Feed ``(tag, prompt_ids)`` from ``requests`` lazily (as slots free) and step until all are done."""
        drive(self, requests, on_complete)
