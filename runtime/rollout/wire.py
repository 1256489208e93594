"""What the trainer and its rollout processes share whatever the workload: the shared flags' indices,
results serialised by value, and the names of the shared-memory segments.

Plumbing of the ``async`` mode (:mod:`runtime.rollout.instance`, :mod:`runtime.pipeline.instance_pool`):
a workload's rollout instance uses it as it is.
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch

STOP, EPOCH = 0, 1  # indices into the shared flags of the rollout processes (a lock-free RawArray)
BEAT_S = 1.0  # an instance's heartbeat period (the trainer kills one silent for rollout.hang_timeout_s)


def to_bytes(obj: Any) -> bytes:
    """Serialise a packed batch by value: a tensor sent through a queue would live in the sender's
    shared memory, which vanishes when a rollout process exits before the trainer reads it."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=False)


def shm_prefix(trainer_pid: int, rank: int, pid: int | None = None) -> str:
    """Names of the shared-memory segments of a trainer's instances (of one instance process, with ``pid``)."""
    return f"tandem-{trainer_pid}-" + ("" if pid is None else f"{rank}-{pid}-")


_TRAINER_PID: int | None = None  # set in a rollout process by its entry point (runtime.rollout.instance)


def set_trainer_pid(pid: int) -> None:
    """Record, in a rollout process, the trainer that started it: its parent may be the fork server
    (runtime.processes), not the trainer."""
    global _TRAINER_PID
    _TRAINER_PID = pid


def trainer_pid() -> int:
    """The pid of the trainer this rollout process serves (its parent, unless :func:`set_trainer_pid` said)."""
    return _TRAINER_PID if _TRAINER_PID is not None else os.getppid()
