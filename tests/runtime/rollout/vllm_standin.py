"""A stand-in for the ``vllm`` package, which cannot be installed on the CPU test machines.

Only the surface the adapter calls (vLLM 0.11's ``LLM``, ``LLM.llm_engine``, ``SamplingParams``,
``sampling_params.RequestOutputKind``), behaving as vLLM documents it in the simplest way: every request
added is stepped one token per ``step()`` and its new tokens are returned (``DELTA`` outputs); a request
ends on one of its stop ids or at ``max_tokens``; its ``len(prompt)``-th token is eos. Tokens are a function of the request's seed and
position, so tests can tell requests and seeds apart. Every call is appended to ``calls`` so the tests
can assert the order the adapter drives vLLM in. It models nothing of vLLM's numerics or memory.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

VOCAB = 100  # the char tokenizer's size
EOS = 2


class SamplingParams:
    def __init__(self, **kwargs: Any):
        self.__dict__.update(kwargs)


class RequestOutputKind:
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    finished: bool


@dataclass
class _Running:
    prompt: list[int]
    params: SamplingParams
    made: int = 0


@dataclass
class LLMEngine:
    calls: list[tuple]
    running: dict[str, _Running] = field(default_factory=dict)
    during_step: Any = None  # a test's hook, called inside step() (another thread's update arriving)

    def add_request(self, request_id: str, prompt: dict, params: SamplingParams) -> None:
        assert request_id not in self.running, "vLLM request ids must be unique"
        self.calls.append(("add_request", request_id))
        self.running[request_id] = _Running(list(prompt["prompt_token_ids"]), params)

    def abort_request(self, request_ids: list[str]) -> None:
        self.calls.append(("abort_request", list(request_ids)))
        for rid in request_ids:
            self.running.pop(rid, None)

    def step(self) -> list[RequestOutput]:
        self.calls.append(("step",))
        if self.during_step is not None:
            self.during_step()
        outputs = []
        for rid, r in list(self.running.items()):
            seed = r.params.seed or 0
            token = 3 + (seed + 7 * r.made + len(r.prompt)) % (VOCAB - 3)  # never a special id
            if r.made + 1 == len(r.prompt):
                token = EOS  # a prompt of k tokens is answered by k tokens, the last one eos
            r.made += 1
            stopped = token in r.params.stop_token_ids
            done = stopped or r.made >= r.params.max_tokens
            reason = ("stop" if stopped else "length") if done else None
            outputs.append(
                RequestOutput(rid, [CompletionOutput([token], [{token: Logprob(-0.01 * token)}], reason)], done)
            )
            if done:
                del self.running[rid]
        return outputs


class LLM:
    instances: list[LLM] = []  # every engine built, newest last

    def __init__(self, **kwargs: Any):
        self.kwargs = kwargs
        self.calls: list[tuple] = []
        self.llm_engine = LLMEngine(self.calls)
        LLM.instances.append(self)

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        self.calls.append(("collective_rpc", method, args))
        return [None]


def modules() -> dict[str, types.ModuleType]:
    """Fresh ``vllm`` and ``vllm.sampling_params`` module objects to put in ``sys.modules``."""
    LLM.instances = []
    vllm = types.ModuleType("vllm")
    vllm.LLM = LLM  # type: ignore[attr-defined]
    vllm.SamplingParams = SamplingParams  # type: ignore[attr-defined]
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = RequestOutputKind  # type: ignore[attr-defined]
    return {"vllm": vllm, "vllm.sampling_params": sampling}


def install(monkeypatch) -> None:
    """The stand-in in ``sys.modules`` for one test (pytest's monkeypatch restores everything after it)."""
    for name, mod in modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the adapter sets it when unset
