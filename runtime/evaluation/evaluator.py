"""Greedy evaluation on held-out prompts, and a background evaluator that never blocks training.

:func:`evaluate` runs the engine greedily (temperature 0, one sample per
prompt) and scores each answer with the task's verifier.

:class:`BackgroundEvaluator` (async mode) owns an engine in a thread of its
own, niced so the OS prefers the trainer and the rollouts. The trainer hands it
the weights of a version through a one-slot mailbox: a newer request replaces
an unstarted older one, so evaluation can fall behind but never holds training
up. Without a device of its own the engine is a :class:`BoundEngine`: it reads
the weight service's kept tensors in place rather than a copy of the policy.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from runtime.contract import EVAL_ACCURACY

EVAL_REWARD = "eval/reward"
TIME_EVAL = "time/eval"


def evaluate(
    engine: Any,
    tokenizer: Any,
    task: Any,
    prompts: list,
    max_new_tokens: int,
    batch_size: int,
    temperature: float = 0.0,
    n: int = 1,
    seed: int = 0,
) -> dict:
    """Accuracy and mean reward of the engine's current weights on ``prompts``.

    Greedy by default (the run's ``eval/accuracy``). With ``temperature > 0`` it is the accuracy
    of the policy as sampled (``n`` samples per prompt, reproducible from ``seed``) — the more
    sensitive measure of what RL changed, since RL moves probabilities before it moves the mode.
    """
    from runtime.rollout.engine import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, stop_ids=tokenizer.stop_ids, n=n)
    started = time.perf_counter()
    correct = 0
    reward = 0.0
    per_call = max(1, batch_size // n)
    for start in range(0, len(prompts), per_call):
        chunk = prompts[start : start + per_call]
        ids = [tokenizer.encode_prompt(p.text) for p in chunk]
        gen = None
        if temperature > 0:
            gen = torch.Generator(device=engine.device)
            gen.manual_seed(seed * 1_000_003 + start)
        for c in engine.generate(ids, params, generator=gen):
            r, ok = task.score(chunk[c.prompt_index], tokenizer.decode(list(c.token_ids)))
            reward += float(r)
            correct += bool(ok)
    total = max(1, len(prompts) * n)
    return {EVAL_ACCURACY: correct / total, EVAL_REWARD: reward / total, TIME_EVAL: time.perf_counter() - started}


class BoundEngine:
    """An engine over a storage-less module whose parameters are bound, not copied, on each update.

    ``bind(state)`` makes ``state``'s tensors the module's parameters (``PublishedPolicy.bind``); the
    engine is then told the version with no weights, so its runner re-reads them. Call
    :meth:`update_weights` between generations (the evaluator's thread does: it owns the engine).
    """

    def __init__(self, engine: Any, bind: Callable[[dict[str, torch.Tensor]], Any]):
        self.engine = engine
        self._bind = bind

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def version(self) -> int:
        return self.engine.version

    def update_weights(self, state: dict[str, torch.Tensor] | None, version: int) -> None:
        if state is not None:
            self._bind(state)
        self.engine.update_weights(None, version)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine.generate(*args, **kwargs)


class BackgroundEvaluator:
    """Evaluates published weights in a low-priority thread; results are collected with :meth:`results`."""

    def __init__(self, make_engine: Callable[[], Any], run_eval: Callable[[Any], dict], nice: int = 10):
        self._make_engine = make_engine
        self._run_eval = run_eval
        self._nice = nice
        self._cond = threading.Condition()
        self._pending: tuple[int, int, dict[str, torch.Tensor]] | None = None
        self._results: list[tuple[int, dict]] = []
        self._error: BaseException | None = None
        self._closing = False
        self._busy = False
        self.skipped = 0
        self._thread = threading.Thread(target=self._loop, name="evaluator", daemon=True)
        self._thread.start()

    def submit(self, step: int, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Queue an evaluation of ``weights`` (a private copy the evaluator may keep) for ``step``."""
        with self._cond:
            if self._pending is not None:
                self.skipped += 1  # an unstarted older request: the newer weights matter more
            self._pending = (step, version, weights)
            self._cond.notify_all()

    def results(self) -> list[tuple[int, dict]]:
        """Finished evaluations since the last call, as (step, metrics)."""
        with self._cond:
            if self._error is not None:
                raise RuntimeError(f"evaluator failed: {self._error}") from self._error
            out, self._results = self._results, []
            return out

    def close(self, wait: bool = True) -> list[tuple[int, dict]]:
        """Stop the thread; with ``wait`` the pending request is evaluated first. Returns the last results."""
        with self._cond:
            if not wait:
                self._pending = None
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        return self.results()

    def _loop(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)  # Linux: per-thread nice
        except (AttributeError, OSError):
            pass
        try:
            engine = self._make_engine()
            while True:
                with self._cond:
                    while self._pending is None and not self._closing:
                        self._cond.wait()
                    if self._pending is None:
                        return
                    step, version, weights = self._pending
                    self._pending = None
                    self._busy = True
                engine.update_weights(weights, version)
                metrics = self._run_eval(engine)
                with self._cond:
                    self._results.append((step, metrics))
                    self._busy = False
        except BaseException as exc:  # surfaced to the trainer on its next results() call
            with self._cond:
                self._error = exc
