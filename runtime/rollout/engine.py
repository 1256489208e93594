"""The built-in generation engine: continuous batching with a static KV cache over the trainer's own model.

``Engine.generate`` expands each prompt ``n`` times and feeds the sequences (shortest prompts first,
so prompts prefilled together have similar lengths) through a
:class:`~runtime.rollout.batcher.ContinuousBatcher`: up to ``max_batch_size`` sequences decode
together, and a slot whose sequence hit a stop token or ``max_new_tokens`` is refilled with the next
sequence at the next step. Each completion carries its token ids, the log-probability of each token
(see :mod:`runtime.rollout.sampling`), the weight version that produced each token, and why it ended.
``Engine.stream`` / ``ContinuousBatcher`` are the request-queue API for a caller that feeds requests
as they come (a rollout instance fed by the scheduler).

Weights change at the next engine step: ``update_weights`` called from another thread while a step
runs is staged and applied when that step ends (the *latest available* version becomes *current*),
so in-flight sequences continue under the new weights and their later tokens record the new version.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from runtime.rollout.batcher import BatchStats, ContinuousBatcher
from runtime.rollout.runners import make_runner
from runtime.rollout.sampling import Completion, SamplingParams, sample_tokens

__all__ = ["BatchStats", "Completion", "ContinuousBatcher", "Engine", "SamplingParams", "sample_tokens"]


class Engine:
    """Generation over ``model`` (shared with the trainer when co-located) on ``device``.

    ``max_batch_size`` caps the sequences decoded together (KV-cache slots); ``max_batch_tokens``
    caps the tokens they may reach together (prompt + ``max_new_tokens`` each). ``stats`` sums the
    token accounting (padding ratio) of everything this engine generated.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        device: torch.device | str,
        max_batch_size: int = 64,
        max_batch_tokens: int = 16384,
        version: int = 0,
        owns_model: bool = False,
    ):
        if max_batch_size < 1 or max_batch_tokens < 1:
            raise ValueError("max_batch_size and max_batch_tokens must be >= 1")
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.version = version
        self.runner = make_runner(model, owns_model)  # owned: one copy of the weights (FastRunner)
        self.max_positions = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.stats = BatchStats()
        self._lock = threading.Lock()
        self._stepping = False
        self._pending: tuple[dict[str, torch.Tensor] | None, int] | None = None
        self._weights_epoch = 0  # bumped by every applied update; the runner re-reads weights when it moves
        self._loaded_epoch = -1  # the epoch the runner's fused weight copies were read at
        self._cache_owner: ContinuousBatcher | None = None  # the batcher whose sequences the KV cache holds

    # ----- weights -------------------------------------------------------------------------------
    def update_weights(self, state_dict: dict[str, torch.Tensor] | None, version: int) -> None:
        """Make ``version`` current: copy ``state_dict`` into the model (None: the model already holds it).

        Applied at once between steps; during a step it is staged and applied when the step ends.
        """
        if state_dict is not None:
            self._check_keys(state_dict)
        with self._lock:  # held while copying, so a step cannot start on half-copied weights
            if self._stepping:
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
        self._weights_epoch += 1

    def _begin_step(self) -> None:
        with self._lock:
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

    # ----- generation ----------------------------------------------------------------------------
    def batcher(
        self, params: SamplingParams, generator: torch.Generator | None = None, refill: bool = True
    ) -> ContinuousBatcher:
        """A request queue over this engine: ``submit(prompt_ids, tag)``, then ``step()`` until ``idle``."""
        return ContinuousBatcher(self, params, generator, refill=refill)

    def stream(
        self,
        requests: Iterable[tuple[Any, list[int]]],
        params: SamplingParams,
        on_complete: Callable[[Any, Completion], None],
        generator: torch.Generator | None = None,
    ) -> BatchStats:
        """Generate for ``(tag, prompt_ids)`` pairs pulled lazily from ``requests`` (as slots free up),
        calling ``on_complete(tag, completion)`` as each finishes. Returns this call's token accounting."""
        batcher = self.batcher(params, generator)
        batcher.run(requests, on_complete)
        return batcher.stats

    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams, generator: torch.Generator | None = None
    ) -> list[Completion]:
        """``n`` completions per prompt, in prompt order (prompt 0's n samples first).

        ``generator`` (on the engine's device) makes sampling reproducible: same seed, same prompts, same
        weights -> same completions.
        """
        self._check_prompts(prompt_ids, params)
        items = [i for i in range(len(prompt_ids)) for _ in range(params.n)]
        order = sorted(range(len(items)), key=lambda j: len(prompt_ids[items[j]]))
        results: list[Completion | None] = [None] * len(items)

        def done(j: int, completion: Completion) -> None:
            completion.prompt_index = items[j]
            results[j] = completion

        self._loaded_epoch = -1  # re-read: a co-located trainer may have changed the parameters in place
        batcher = self.batcher(params, generator)
        batcher.run(((j, prompt_ids[items[j]]) for j in order), done)
        self.last_stats = batcher.stats
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
