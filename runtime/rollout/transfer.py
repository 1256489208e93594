"""Aggregated transfer: many small finished groups leave a rollout process as one packed message.

Sending every finished group on its own costs a pickle, a pipe write and a wake-up of the trainer's
receiver per group; with short responses that overhead rivals the generation. An :class:`Aggregator`
collects finished groups and says when to flush: when the packed size reaches ``max_bytes``, or
when the oldest group has waited ``window_s`` — whichever comes first — so large volumes travel in
few messages and a lone group is never held longer than the window. The message itself is the
packed (padding-free) format of :func:`runtime.sample_queue.pack_samples`: flat tensors plus lengths.

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
    """Bytes a list of ``Sample``s takes packed (:func:`runtime.sample_queue.pack_samples`): int64 token ids,
    float64 log-probabilities, int64 versions, and the per-sample columns. An estimate good to a few
    bytes per sample (the ``extra`` JSON strings are not counted)."""
    per_sample = 8 * 5 + 8 + 1 + 1  # ids, prompt id, group id, two lengths; reward; correct; finish
    return sum(8 * len(s.prompt_ids) + 24 * len(s.response_ids) + per_sample for s in samples)


class ShmCourier:
    """Large messages through POSIX shared memory on one host: the pipe carries only a reference.

    ``wrap(blob)`` copies a blob of at least ``min_bytes`` into a new segment named
    ``<prefix><n>`` and returns ``("shm", name, size)``; smaller blobs travel as they are.
    ``unwrap(ref)`` on the receiving side copies the bytes out and unlinks the segment; a segment
    already gone (its sender died and it was swept) yields None — the receiver then drops the
    message, whose work is issued again with the rest of the dead sender's. The sender does not
    keep the segment registered with its own resource tracker (the receiver unlinks it); a
    segment created by a sender killed before it could send the reference is removed by
    :func:`sweep` of the sender's prefix.
    """

    def __init__(self, prefix: str, min_bytes: int = 1 << 16):
        self.prefix = prefix
        self.min_bytes = min_bytes
        self.sent = 0

    def wrap(self, blob: bytes) -> bytes | tuple[str, str, int]:
        if len(blob) < self.min_bytes:
            return blob
        from multiprocessing import resource_tracker, shared_memory

        name = f"{self.prefix}{self.sent}"
        self.sent += 1
        segment = shared_memory.SharedMemory(name=name, create=True, size=len(blob))
        try:
            buf = segment.buf
            assert buf is not None
            buf[: len(blob)] = blob
            del buf  # no view may outlive close()
        finally:
            segment.close()
        # the receiver unlinks it; left registered, our tracker would unlink it again (or too early) at exit
        resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
        return ("shm", name, len(blob))

    @staticmethod
    def unwrap(ref: bytes | tuple[str, str, int]) -> bytes | None:
        if isinstance(ref, bytes):
            return ref
        from multiprocessing import shared_memory

        _, name, size = ref
        try:
            segment = shared_memory.SharedMemory(name=name)  # registers with our tracker; unlink() unregisters
        except FileNotFoundError:
            return None
        try:
            buf = segment.buf
            assert buf is not None
            blob = bytes(buf[:size])
            del buf  # no view may outlive close()
            return blob
        finally:
            segment.close()
            segment.unlink()


def sweep(prefix: str) -> int:
    """Remove the shared-memory segments whose names start with ``prefix`` (Linux: /dev/shm); returns how many."""
    import os

    root = "/dev/shm"
    if not os.path.isdir(root):
        return 0
    removed = 0
    for name in os.listdir(root):
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(root, name))
                removed += 1
            except FileNotFoundError:
                pass
    return removed


__all__ = ["Aggregator", "ShmCourier", "sample_nbytes", "sweep"]
