"""DQN's target-network sync, off the update's critical path.

A sync (a Polyak step, or a copy when ``tau`` is 1: :func:`~runtime.train.algos.control.polyak_update_`)
is due after every ``target_update_interval`` gradient updates. In the background mode
:meth:`TargetSync.start` hands it to a worker thread of its own and returns at once; the next update
runs everything that does not read the target network (replay sampling, the online network's forward
passes) and calls :meth:`TargetSync.wait` just before the target's forward pass. So the update waits only for
what is left of the sync, and the result is the same as an inline sync, bit for bit: the sync reads
the online parameters the last optimizer step wrote, which no one writes again until the next
optimizer step, after the wait. On a CUDA device the thread only enqueues the sync's kernels on the
device's default stream, before the wait returns and so before the next update's kernels.

Priority: the sync is "background" by its place, not by an OS priority. It runs in the learner's gaps
(the tail of a step, the start of the next update) and the learner never waits for it unless it is not
done; the thread keeps the learner's nice value, because a lower one makes the learner wait behind the
sampling workers whenever they keep the cores busy (``nice`` takes an increment, for measuring that).

The inline mode (``background=False``) syncs in :meth:`TargetSync.start` itself: the baseline the
benchmark compares against (``bench/gym.py --roles``). Either way :attr:`TargetSync.wait_s` adds up
the seconds updates were held up by syncs (all of an inline one; only the wait for a background one).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from torch import nn

from runtime.train.algos.control import polyak_update_

# Added to the learner's nice value: none. The next update waits for the sync, so a sync thread that yields
# to the sampling workers would put them ahead of the learner (measured: bench/gym.py --roles).
TARGET_SYNC_NICE = 0


def _lower_priority(increment: int) -> None:
    if increment <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + increment)  # Linux: per thread
    except (AttributeError, OSError):
        pass  # not Linux: the thread keeps the learner's priority


class TargetSync:
    """Moves ``target``'s parameters toward ``online``'s by ``tau``; see the module docstring.

    Buffers (an observation normaliser's statistics) are not touched: the learner copies them itself."""

    def __init__(
        self, target: nn.Module, online: nn.Module, tau: float, background: bool = True, nice: int = TARGET_SYNC_NICE
    ):
        self._target = list(target.parameters())
        self._online = list(online.parameters())
        self.tau = tau
        self.background = background
        self._executor = (
            ThreadPoolExecutor(1, thread_name_prefix="target-sync", initializer=_lower_priority, initargs=(nice,))
            if background
            else None
        )
        self._pending: Future[None] | None = None
        self.events = 0  # syncs started since the last take_step_stats()
        self.wait_s = 0.0  # seconds updates were held up by syncs since then
        self.taken_back = 0  # background syncs the learner ran itself, the thread not having started them

    def start(self) -> None:
        """Sync now (inline) or in the background. The online parameters must not change until :meth:`wait`."""
        self.wait()  # one sync in flight at most: consecutive syncs compose in order
        self.events += 1
        if self._executor is None:
            started = time.perf_counter()
            polyak_update_(self._target, self._online, self.tau)
            self.wait_s += time.perf_counter() - started
        else:
            self._pending = self._executor.submit(polyak_update_, self._target, self._online, self.tau)

    def wait(self) -> None:
        """Return once the sync in flight, if any, is in the target (re-raising its error); the time counts.

        A sync the thread has not started yet is taken back and run here: on busy cores the thread's wake-up
        takes longer than the sync itself, so waiting for it would cost more than an inline sync."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        started = time.perf_counter()
        try:
            if pending.cancel():
                self.taken_back += 1
                polyak_update_(self._target, self._online, self.tau)
            else:
                pending.result()
        finally:
            self.wait_s += time.perf_counter() - started

    def take_step_stats(self) -> tuple[int, float]:
        """(syncs started, seconds held up) since the last call: one step's target-sync events and wait."""
        out = (self.events, self.wait_s)
        self.events, self.wait_s = 0, 0.0
        return out

    def close(self) -> None:
        """Finish the sync in flight and stop the thread (a learner that is dropped needs no call)."""
        self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
