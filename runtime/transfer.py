"""Aggregated transfer: many small finished groups leave a rollout process as one packed message.

Sending every finished group on its own costs a pickle, a pipe write and a wake-up of the trainer's
receiver per group; with short responses that overhead rivals the generation. An :class:`Aggregator`
collects finished groups and says when to flush: when the packed size reaches ``max_bytes``, or
when the oldest group has waited ``window_s`` — whichever comes first — so large volumes travel in
few messages and a lone group is never held longer than the window. The message itself is the
packed (padding-free) format of :func:`runtime.queue.pack_samples`: flat tensors plus lengths.

Workload-agnostic: it counts bytes with a caller-supplied function and carries opaque entries.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Aggregator(Generic[T]):
    """Entries in, batches out: ``add`` entries, ``due()`` says when ``flush()`` should send them."""

    def __init__(
        self,
        max_bytes: int,
        window_s: float,
        nbytes: Callable[[T], int],
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_bytes < 1:
            raise ValueError(f"pipeline.transfer_max_bytes: must be >= 1, got {max_bytes}")
        if window_s < 0:
            raise ValueError(f"pipeline.transfer_window_s: must be >= 0, got {window_s}")
        self.max_bytes = max_bytes
        self.window_s = window_s
        self.nbytes = nbytes
        self.clock = clock
        self.entries: list[T] = []
        self.bytes = 0
        self.first_at: float | None = None  # when the oldest entry waiting arrived

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, entry: T) -> None:
        if not self.entries:
            self.first_at = self.clock()
        self.entries.append(entry)
        self.bytes += self.nbytes(entry)

    def due(self) -> bool:
        """Whether to flush now: the size threshold is reached, or the oldest entry's window has passed."""
        if not self.entries:
            return False
        if self.bytes >= self.max_bytes:
            return True
        assert self.first_at is not None
        return self.clock() - self.first_at >= self.window_s

    def flush(self) -> list[T]:
        """Everything waiting, oldest first; the aggregator is empty afterwards."""
        out, self.entries, self.bytes, self.first_at = self.entries, [], 0, None
        return out


def sample_nbytes(samples: list[Any]) -> int:
    """Bytes a list of ``Sample``s takes packed (:func:`runtime.queue.pack_samples`): int64 token ids,
    float64 log-probabilities, int64 versions, and the per-sample columns. An estimate good to a few
    bytes per sample (the ``extra`` JSON strings are not counted)."""
    per_sample = 8 * 5 + 8 + 1 + 1  # ids, prompt id, group id, two lengths; reward; correct; finish
    return sum(8 * len(s.prompt_ids) + 24 * len(s.response_ids) + per_sample for s in samples)


__all__ = ["Aggregator", "sample_nbytes"]
