"""A remote reward endpoint (e.g. a reward-model server) that can never hang the pipeline.

Protocol: ``POST url`` with JSON ``{"prompt": ..., "response": ..., "answer": ...}``; the server answers
``200`` with JSON ``{"reward": <number>}`` (an optional boolean ``"correct"`` is passed through).

Guards, each a knob of ``RewardSpec`` (``reward:`` in the run spec):

- a **per-request timeout** (``timeout_s``) on connecting and on every read, so a server that hangs
  costs at most that long per attempt;
- **bounded retries** (``max_retries``) with exponential back-off (``backoff_s``, doubled per retry)
  for timeouts, connection errors, 5xx, 408/429 and unparseable replies; other 4xx are the request's
  fault and are not retried;
- a **concurrency limit** (``concurrency``): :meth:`RewardClient.score_many` keeps at most that many
  requests in flight;
- a **circuit breaker**: after ``breaker_failures`` consecutive failed attempts it opens and requests
  fail at once without touching the network; after ``breaker_cooldown_s`` one half-open probe is let
  through — success closes it, failure re-opens it.

A request that still fails is *dropped*: its result has ``reward=None``, ``reward/dropped`` counts it,
and :func:`apply_rewards` leaves its sample out of training.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from runtime.spec import check_http_url

RETRYABLE_STATUS = frozenset({408, 429})


@dataclass
class RewardResult:
    """The outcome of scoring one response. ``reward`` is None when the request was dropped."""

    reward: float | None
    correct: bool | None = None
    attempts: int = 0
    error: str | None = None

    @property
    def dropped(self) -> bool:
        return self.reward is None


class _Failure(Exception):
    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable


class CircuitBreaker:
    """closed -> (``failures`` consecutive failures) -> open -> (``cooldown_s``) -> half-open -> one probe."""

    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic):
        if failures < 1 or cooldown_s < 0:
            raise ValueError("breaker failures must be >= 1 and cooldown_s >= 0")
        self.failures = failures
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.state = "closed"
        self.consecutive = 0
        self.opened_at = 0.0
        self.times_opened = 0
        self._probing = False
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """Whether an attempt may go out now (in half-open state: only the one probe)."""
        with self._lock:
            if self.state == "open" and self.clock() - self.opened_at >= self.cooldown_s:
                self.state, self._probing = "half_open", False
            if self.state == "half_open":
                if self._probing:
                    return False
                self._probing = True
                return True
            return self.state == "closed"

    def record(self, ok: bool) -> None:
        with self._lock:
            if ok:
                self.state, self.consecutive, self._probing = "closed", 0, False
                return
            self.consecutive += 1
            if self.state == "half_open" or self.consecutive >= self.failures:
                if self.state != "open":
                    self.times_opened += 1
                self.state, self.opened_at, self._probing = "open", self.clock(), False


def check_url(url: str) -> str:
    """``url`` if it is http(s)://host[:port]/..., else a ValueError naming ``reward.url``."""
    try:
        return check_http_url(url)
    except ValueError as exc:
        raise ValueError(f"reward.url: {exc}") from None


class RewardClient:
    """Client of one reward endpoint; thread-safe. See the module docstring for the guards."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 10.0,
        max_retries: int = 2,
        backoff_s: float = 0.2,
        concurrency: int = 8,
        breaker_failures: int = 5,
        breaker_cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.url = check_url(url)
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0 or concurrency < 1:
            raise ValueError("reward: timeout_s > 0, max_retries >= 0, backoff_s >= 0 and concurrency >= 1 required")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.concurrency = concurrency
        self.breaker = CircuitBreaker(breaker_failures, breaker_cooldown_s, clock)
        self._counts = dict.fromkeys(("requests", "scored", "dropped", "retries", "failures", "rejected"), 0)
        self._lock = threading.Lock()

    @classmethod
    def from_spec(cls, reward_spec: Any) -> RewardClient:
        """From a runtime.spec.RewardSpec whose ``url`` is set."""
        if not reward_spec.url:
            raise ValueError("reward.url: no reward service configured")
        return cls(
            reward_spec.url,
            timeout_s=reward_spec.timeout_s,
            max_retries=reward_spec.max_retries,
            backoff_s=reward_spec.backoff_s,
            concurrency=reward_spec.concurrency,
            breaker_failures=reward_spec.breaker_failures,
            breaker_cooldown_s=reward_spec.breaker_cooldown_s,
        )

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def metrics(self) -> dict[str, float]:
        """Cumulative counters, named as the run reports them."""
        with self._lock:
            out = {f"reward/{k}": float(v) for k, v in self._counts.items()}
        out["reward/circuit_open"] = float(self.breaker.state != "closed")
        out["reward/circuit_opened"] = float(self.breaker.times_opened)
        return out

    def _post(self, body: bytes) -> tuple[float, bool | None]:
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as exc:
            retryable = exc.code >= 500 or exc.code in RETRYABLE_STATUS
            raise _Failure(f"HTTP {exc.code}", retryable) from None
        except (TimeoutError, OSError) as exc:  # URLError, connection refused/reset, socket timeout
            reason = getattr(exc, "reason", exc)
            raise _Failure(f"{type(exc).__name__}: {reason}") from None
        try:
            data = json.loads(raw)
            reward = float(data["reward"])
        except (ValueError, KeyError, TypeError) as exc:
            raise _Failure(f"bad reply {raw[:80]!r}: {type(exc).__name__}") from None
        if not math.isfinite(reward):
            raise _Failure(f"bad reply: reward {reward}")
        correct = data.get("correct")
        return reward, (bool(correct) if correct is not None else None)

    def score(self, prompt: str, response: str, answer: str = "") -> RewardResult:
        """Score one response: at most ``1 + max_retries`` attempts, then dropped. Never raises for
        server trouble."""
        self._count("requests")
        body = json.dumps({"prompt": prompt, "response": response, "answer": answer}).encode()
        attempts, error = 0, "not attempted"
        for attempt in range(self.max_retries + 1):
            if attempt:
                self._count("retries")
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            if not self.breaker.allow():
                self._count("rejected")
                error = "circuit breaker open"
                break  # fail fast: retrying into an open breaker only adds waiting
            attempts += 1
            try:
                reward, correct = self._post(body)
            except _Failure as exc:
                self.breaker.record(False)
                self._count("failures")
                error = str(exc)
                if not exc.retryable:
                    break
                continue
            self.breaker.record(True)
            self._count("scored")
            return RewardResult(reward, correct, attempts)
        self._count("dropped")
        return RewardResult(None, None, attempts, error)

    def score_many(self, items: Sequence[tuple[str, str, str]]) -> list[RewardResult]:
        """Score ``(prompt, response, answer)`` triples with at most ``concurrency`` requests in flight;
        results in input order."""
        if not items:
            return []
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(items))) as pool:
            return list(pool.map(lambda item: self.score(*item), items))


def apply_rewards(samples: Sequence[Any], results: Sequence[RewardResult]) -> tuple[list[Any], int]:
    """Set ``reward`` (and ``correct`` when the server says) on each sample; returns (kept, dropped count)."""
    if len(samples) != len(results):
        raise ValueError(f"{len(samples)} samples but {len(results)} reward results")
    kept = []
    for sample, result in zip(samples, results, strict=True):
        if result.dropped:
            continue
        sample.reward = result.reward
        if result.correct is not None:
            sample.correct = result.correct
        kept.append(sample)
    return kept, len(samples) - len(kept)
