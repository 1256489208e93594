"""Adapter that puts vLLM (GPU) or vllm-ascend (Ascend NPU) behind the built-in engine's interface.

Selected with ``rollout.engine: vllm``. vllm is imported only when this engine is built; without it
:class:`VLLMUnavailable` says what to install. Same ``generate`` / ``update_weights`` / ``version``
as :class:`runtime.rollout.engine.Engine`, returning the same :class:`Completion` objects.

Differences from the built-in engine, by construction of vLLM:

- Log-probabilities: vLLM is started with ``logprobs_mode="processed_logprobs"`` so they include the
  temperature like the built-in engine's; with top-k/top-p on, vLLM reports the *truncated*
  distribution's log-probabilities (the built-in engine reports the untruncated ones).
- Sampling uses vLLM's own RNG: ``generator`` is not used; a per-call seed is drawn from it when
  given, so runs stay reproducible for a fixed seed and vLLM version.
- Weight updates go through ``LLM.collective_rpc`` to every worker's ``model.load_weights``; vLLM's
  multiprocess engine pickles the tensors to its workers.

Not exercised by CI (no vLLM on the CPU machines); the built-in engine is the tested reference.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from runtime.rollout.engine import Completion, SamplingParams


class VLLMUnavailable(RuntimeError):
    """vllm (or vllm-ascend) is not installed or cannot be imported."""


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise VLLMUnavailable(
            "rollout.engine=vllm needs the vllm package (vllm on NVIDIA GPUs; vllm and vllm-ascend on "
            f"Ascend NPUs, see requirements-npu.txt); it could not be imported: {exc}"
        ) from None
    return vllm


def _load_weights_on_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside each vLLM worker (collective_rpc passes the worker as the first argument)."""
    worker.model_runner.model.load_weights(weights=weights)


class VLLMEngine:
    """vLLM's ``LLM`` over a saved HF model directory (``save_hf`` output), with the Engine interface."""

    def __init__(
        self,
        model_path: str,
        tokenizer: Any,
        device: torch.device | str = "cuda",
        version: int = 0,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        seed: int = 0,
        **llm_kwargs: Any,
    ):
        vllm = _import_vllm()
        self._vllm = vllm
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.version = version
        self._lock = threading.Lock()
        self.llm = vllm.LLM(
            model=str(model_path),
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            logprobs_mode="processed_logprobs",
            **llm_kwargs,
        )

    def _params(self, params: SamplingParams, seed: int | None) -> Any:
        stops = list(params.stop_ids)
        return self._vllm.SamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_new_tokens,
            stop_token_ids=stops or None,
            ignore_eos=params.ignore_eos,
            logprobs=0,  # the sampled token's log-probability only
            seed=seed,
            detokenize=False,
        )

    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams, generator: torch.Generator | None = None
    ) -> list[Completion]:
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator)) if generator is not None else None
        with self._lock:  # weights cannot change inside one call: that is this engine's batch boundary
            version = self.version
            prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_ids]
            outputs = self.llm.generate(prompts, self._params(params, seed), use_tqdm=False)
        completions = []
        for index, request in enumerate(outputs):
            for out in request.outputs:
                tokens = list(out.token_ids)
                logprobs = [float(step[tok].logprob) for tok, step in zip(tokens, out.logprobs or [], strict=True)]
                reason = "stop" if out.finish_reason == "stop" else "length"
                completions.append(Completion(index, tokens, logprobs, [version] * len(tokens), reason))
        return completions

    def update_weights(self, state_dict: dict[str, torch.Tensor] | None, version: int) -> None:
        """Load ``state_dict`` into every vLLM worker (None: only the version moves)."""
        with self._lock:
            if state_dict is not None:
                weights = [(name, t.detach().cpu()) for name, t in state_dict.items()]
                self.llm.collective_rpc(_load_weights_on_worker, args=(weights,))
            self.version = version
