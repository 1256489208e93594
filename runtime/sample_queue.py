"""The sample queue between rollout and trainer (the "DistQueue").

Bounded, versioned and staleness-aware:

* ``capacity`` samples at most (default 5x one training step, see
  ``RunSpec.queue_capacity``); a producer that would overflow it blocks.
* every item carries ``sample_id`` and ``version`` (the oldest weight version
  that produced it); ids are unique — putting an id twice is an error, and an
  item leaves the queue exactly once: taken by the trainer, or moved to the
  stale list that the caller must collect (nothing is silently lost).
* ``take(n, version)`` hands out ``n`` items whose lag ``version - item.version``
  is within ``max_policy_lag``; items beyond it are never handed out.
* watermark reporting: depth, fill fraction and the high-water mark since the
  last report.

The queue is workload-agnostic (any item with ``sample_id`` and ``version``);
only :func:`pack_samples` / :func:`unpack_samples`, the zero-padding transfer
format for LLM samples crossing a process boundary, know the ``Sample`` type.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from runtime.samples import Sample

LAG_POLICIES = ("throttle", "drop", "sync")


class Versioned(Protocol):
    sample_id: int

    @property
    def version(self) -> int: ...


class QueueClosed(RuntimeError):
    """The queue was closed while a caller waited on it."""


@dataclass
class QueueStats:
    depth: int
    capacity: int
    high_water: int  # largest depth since the last ``reset_watermark``
    put_total: int
    taken_total: int
    dropped_stale: int

    @property
    def fill(self) -> float:
        return self.depth / self.capacity

    @property
    def watermark(self) -> float:
        return self.high_water / self.capacity


class SampleQueue:
    """A bounded FIFO of versioned samples with a staleness bound.

    Thread-safe. Across processes, producers send packed batches
    (:func:`pack_samples`) and a receiver thread in the trainer process puts
    them here.
    """

    def __init__(self, capacity: int, max_policy_lag: int | None = None, on_lag_exceeded: str = "throttle"):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        if on_lag_exceeded not in LAG_POLICIES:
            raise ValueError(f"on_lag_exceeded must be one of {LAG_POLICIES}")
        self.capacity = capacity
        self.max_policy_lag = max_policy_lag
        self.on_lag_exceeded = on_lag_exceeded
        self._items: deque[Any] = deque()
        self._stale: list[Any] = []  # removed for staleness, awaiting ``pop_stale``
        self._ids: set[int] = set()  # every id ever accepted: a second put is a bug upstream
        self._cond = threading.Condition()
        self._closed = False
        self._high_water = 0
        self._put_total = 0
        self._taken_total = 0
        self._dropped_stale = 0

    # ---- producer side -------------------------------------------------
    def put(self, items: list[Any], timeout: float | None = None) -> bool:
        """Append ``items`` atomically (a GRPO group never splits), waiting for room.

        Returns False on timeout (nothing was added). Raises ``ValueError`` for a
        duplicate id or a batch larger than the capacity, ``QueueClosed`` when closed.
        """
        if len(items) > self.capacity:
            raise ValueError(f"batch of {len(items)} exceeds the queue capacity {self.capacity}")
        ids = [item.sample_id for item in items]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate sample_id within one put")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            dup = self._ids.intersection(ids)
            if dup:
                raise ValueError(f"sample ids already queued or consumed: {sorted(dup)[:5]}")
            while len(self._items) + len(items) > self.capacity:
                if self._closed:
                    raise QueueClosed("queue closed")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            if self._closed:
                raise QueueClosed("queue closed")
            self._items.extend(items)
            self._ids.update(ids)
            self._put_total += len(items)
            self._high_water = max(self._high_water, len(self._items))
            self._cond.notify_all()
            return True

    # ---- consumer side -------------------------------------------------
    def is_stale(self, item: Any, version: int) -> bool:
        return self.max_policy_lag is not None and version - item.version > self.max_policy_lag

    def take(self, n: int, version: int, timeout: float | None = None) -> list[Any] | None:
        """Remove and return the ``n`` oldest items fresh enough for trainer ``version``.

        Items whose lag exceeds ``max_policy_lag`` are moved to the stale list
        (collect them with :meth:`pop_stale`) and counted; they are never
        returned here. Waits until ``n`` fresh items are present; returns None on
        timeout with no fresh item removed.
        """
        if n > self.capacity:
            raise ValueError(f"cannot take {n} items from a queue of capacity {self.capacity}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._purge(version)
                if len(self._items) >= n:
                    out = [self._items.popleft() for _ in range(n)]
                    self._taken_total += n
                    self._cond.notify_all()
                    return out
                if self._closed:
                    raise QueueClosed("queue closed")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def _purge(self, version: int) -> None:
        if self.max_policy_lag is None or not self._items:
            return
        keep: deque[Any] = deque()
        for item in self._items:
            if self.is_stale(item, version):
                self._stale.append(item)
                self._dropped_stale += 1
            else:
                keep.append(item)
        if len(keep) != len(self._items):
            self._items = keep
            self._cond.notify_all()

    def pop_stale(self) -> list[Any]:
        """Items removed for staleness since the last call (the caller re-issues or records them)."""
        with self._cond:
            out, self._stale = self._stale, []
            return out

    def release(self, ids: list[int]) -> None:
        """Forget ids of items removed as stale, so their regenerated replacements may reuse them.

        Only stale ids may be released: an item taken by the trainer keeps its id forever.
        """
        with self._cond:
            self._ids.difference_update(ids)

    # ---- reporting and lifecycle ---------------------------------------
    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def stats(self) -> QueueStats:
        with self._cond:
            return QueueStats(
                depth=len(self._items),
                capacity=self.capacity,
                high_water=self._high_water,
                put_total=self._put_total,
                taken_total=self._taken_total,
                dropped_stale=self._dropped_stale,
            )

    def reset_watermark(self) -> None:
        """Start a new high-water window (called after each report)."""
        with self._cond:
            self._high_water = len(self._items)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def snapshot(self) -> dict[str, Any]:
        """Everything needed to rebuild the queue after a resume (contents, stale list, counters)."""
        with self._cond:
            return {
                "items": list(self._items),
                "stale": list(self._stale),
                "ids": torch.tensor(sorted(self._ids), dtype=torch.int64),
                "put_total": self._put_total,
                "taken_total": self._taken_total,
                "dropped_stale": self._dropped_stale,
            }

    def clear(self) -> None:
        """Forget everything (contents, stale list, ids, counters), e.g. before a rollback's :meth:`restore`."""
        with self._cond:
            self._items.clear()
            self._stale = []
            self._ids = set()
            self._put_total = self._taken_total = self._dropped_stale = 0
            self._high_water = 0
            self._cond.notify_all()

    def restore(self, state: dict[str, Any]) -> None:
        """Load a :meth:`snapshot` into this (empty) queue."""
        with self._cond:
            if self._items or self._ids:
                raise RuntimeError("restore needs an empty queue")
            if len(state["items"]) > self.capacity:
                raise ValueError(f"snapshot holds {len(state['items'])} items, capacity is {self.capacity}")
            self._items = deque(state["items"])
            self._stale = list(state["stale"])
            ids = state["ids"]
            self._ids = set(ids.tolist() if isinstance(ids, torch.Tensor) else ids)
            self._put_total = state["put_total"]
            self._taken_total = state["taken_total"]
            self._dropped_stale = state["dropped_stale"]
            self._high_water = len(self._items)
            self._cond.notify_all()


# ---- packed transfer ------------------------------------------------------

_FINISH = ("stop", "length", "abort")


class PackError(ValueError):
    """Samples that cannot be packed, or a packed batch that does not unpack."""


def pack_samples(samples: list[Sample]) -> dict[str, Any]:
    """Pack samples into flat tensors plus length vectors — no padding.

    The one format for samples outside a ``Sample`` object: rollout → trainer
    transfer and the queue's contents in a checkpoint. Only tensors, ints and
    strings, so ``torch.load(weights_only=True)`` reads it; float64 keeps the
    engine's log-probabilities and rewards exact through the round trip.
    """
    extras = []
    for s in samples:
        if not (len(s.logprobs) == len(s.versions) == len(s.response_ids)):
            raise PackError(f"sample {s.sample_id}: response_ids, logprobs and versions differ in length")
        try:
            extras.append(json.dumps(s.extra, sort_keys=True, allow_nan=True))
        except (TypeError, ValueError) as exc:
            raise PackError(f"sample {s.sample_id}: `extra` must be JSON-serialisable ({exc})") from None

    def flat(rows: list[list], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([x for row in rows for x in row], dtype=dtype)

    def lens(rows: list[list]) -> torch.Tensor:
        return torch.tensor([len(r) for r in rows], dtype=torch.int64)

    prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    return {
        "kind": "samples/v1",
        "sample_id": torch.tensor([s.sample_id for s in samples], dtype=torch.int64),
        "prompt_id": torch.tensor([s.prompt_id for s in samples], dtype=torch.int64),
        "group_id": torch.tensor([s.group_id for s in samples], dtype=torch.int64),
        "prompt_ids": flat(prompts, torch.int64),
        "prompt_lens": lens(prompts),
        "response_ids": flat(responses, torch.int64),
        "response_lens": lens(responses),
        # logprobs and versions are per response token: response_lens splits them too.
        "logprobs": flat([s.logprobs for s in samples], torch.float64),
        "versions": flat([s.versions for s in samples], torch.int64),
        "reward": torch.tensor([float(s.reward) for s in samples], dtype=torch.float64),
        "correct": torch.tensor([bool(s.correct) for s in samples], dtype=torch.bool),
        "finish": torch.tensor([_FINISH.index(s.finish_reason) for s in samples], dtype=torch.int8),
        "extra": extras,
    }


def unpack_samples(packed: dict[str, Any]) -> list[Sample]:
    """Inverse of :func:`pack_samples`; checks that the lengths account for every value."""
    if packed.get("kind") != "samples/v1":
        raise PackError(f"not a packed sample list (kind {packed.get('kind')!r})")
    prompt_lens, response_lens = packed["prompt_lens"].tolist(), packed["response_lens"].tolist()

    def split(name: str, sizes: list[int]) -> list[list]:
        values, out, start = packed[name].tolist(), [], 0
        for n in sizes:
            out.append(values[start : start + n])
            start += n
        if start != len(values):
            raise PackError(f"packed samples: `{name}` has {len(values)} values, lengths sum to {start}")
        return out

    prompt_ids = split("prompt_ids", prompt_lens)
    response_ids, logprobs, versions = (split(k, response_lens) for k in ("response_ids", "logprobs", "versions"))
    ids, prompt_id, group_id = (packed[k].tolist() for k in ("sample_id", "prompt_id", "group_id"))
    reward, correct, finish = (packed[k].tolist() for k in ("reward", "correct", "finish"))
    return [
        Sample(
            sample_id=ids[i],
            prompt_id=prompt_id[i],
            group_id=group_id[i],
            prompt_ids=prompt_ids[i],
            response_ids=response_ids[i],
            logprobs=logprobs[i],
            versions=versions[i],
            finish_reason=_FINISH[finish[i]],
            reward=reward[i],
            correct=bool(correct[i]),
            extra=json.loads(packed["extra"][i]),
        )
        for i in range(len(ids))
    ]
