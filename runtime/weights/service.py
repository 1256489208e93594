"""The weight service: versioned publication of policy weights.

Every published weight set gets a version, strictly increasing over the run.

* Co-located (:meth:`WeightService.publish` with ``state=None``): the
  generation engine *is* the trainer's model, so publishing moves only the
  version number — zero copy, zero sync cost.
* Disaggregated on one host (:meth:`WeightService.shared_handle`): the
  trainer copies each new version into one shared-memory buffer (one storage per
  dtype; siblings' same-named parameters side by side, so a reader can use q/k/v
  or gate/up as one fused tensor without a copy). :class:`WeightSubscriber` in a
  rollout process reads it one of two ways. *Copying* (an engine on an
  accelerator): it keeps a *current* version in its engine's own tensors and
  switches only when asked to, at a batch boundary, copying under the buffer's
  lock. *In place* (an engine on the host): the engine's parameters are the
  buffer's tensors — one copy of the weights on the host however many instances
  read them — and each engine step runs inside :meth:`WeightSubscriber.reading`,
  which marks the reader's slot; a publish takes the lock (no new step starts)
  and waits for the marked steps to end before it writes. A reader records its
  pid while it holds the lock or a slot, so that what a reader killed there
  (SIGKILL, OOM killer) holds is released on its behalf
  (:meth:`WeightService.reader_gone`, :meth:`~WeightService.reader_died`)
  instead of blocking the trainer and the other readers for ever; one frozen
  there is reported to :attr:`WeightService.on_wait` while a publish waits.
* Disaggregated across hosts (:attr:`WeightService.on_publish`): each version is handed to the
  remote rollout links (:mod:`runtime.rollout.link`), which push it to their instances newest-wins.
* Rollback: the last ``keep`` published versions are kept on the host;
  :meth:`WeightService.rollback` republishes an old one under a NEW, higher
  version so that versions stay monotonic and staleness arithmetic holds.

Workload-agnostic: it moves name -> tensor dicts and knows nothing of LLMs.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from runtime import processes

State = dict[str, torch.Tensor]
# Where kept versions live: host memory. Each is a private copy, never written after it is made, so a
# reader may use its tensors in place (runtime.workloads.llm.probe.PublishedPolicy) even after it is dropped.
KEPT_ON = torch.device("cpu")


class WeightError(RuntimeError):
    pass


@dataclass
class SharedWeights:
    """What a rollout process needs to follow published weights (picklable across spawn)."""

    tensors: State  # shared-memory buffer, one tensor per parameter (views of one storage per dtype)
    # shared int64 [latest version, pid of the reader holding the lock or 0, then per in-place reader slot
    # the pid of the reader inside a step or 0]
    meta: torch.Tensor
    lock: Any  # a multiprocessing lock guarding buffer + meta

    @property
    def reader_slots(self) -> int:
        """How many in-place readers (:meth:`WeightSubscriber.reading`) the buffer has room for."""
        return self.meta.numel() - READERS


VERSION, HOLDER, READERS = 0, 1, 2  # indices into SharedWeights.meta (READERS: the first reader slot)
# A lock held this long with no holder recorded: its reader died between acquiring it and
# recording its pid (or between clearing it and releasing); a live reader records it at once.
STUCK_S = 2.0


class WeightService:
    """Trainer-side publisher. ``keep``: versions retained for rollback (0 = none)."""

    def __init__(self, keep: int = 3, initial_version: int = 0):
        self.keep = keep
        self._version = initial_version
        self._history: OrderedDict[int, State] = OrderedDict()
        self._shared: SharedWeights | None = None
        self._recover = threading.Lock()  # reader_gone (receiver thread) vs the publishing thread
        # called with (version, host copy of the weights) after each publish / initialize: remote readers
        self.on_publish: Callable[[int, State], None] | None = None
        # called with the pid of a live reader holding the buffer's lock, each 0.1 s a publish waits on it:
        # the readers' owner may find it hung (frozen while copying) and kill it; reader_gone then frees the lock
        self.on_wait: Callable[[int], None] | None = None

    @property
    def version(self) -> int:
        return self._version

    def versions(self) -> list[int]:
        """Versions available for rollback, oldest first."""
        return list(self._history)

    def shared_handle(self, like: State, ctx: Any = None, readers: int = 0) -> SharedWeights:
        """Create (once) the shared-memory buffer for rollout processes, shaped like ``like`` and holding its
        values, with ``readers`` in-place reader slots (:meth:`WeightSubscriber.reading`)."""
        if self._shared is None:
            ctx = ctx or processes.context()
            meta = torch.zeros(READERS + readers, dtype=torch.int64)
            meta[VERSION] = self._version
            self._shared = SharedWeights(tensors=shared_layout(like), meta=meta.share_memory_(), lock=ctx.Lock())
        return self._shared

    def publish(self, state: State | None, version: int | None = None) -> int:
        """Publish ``state`` (None: co-located, the engine already reads it) as a new version.

        Returns the version. ``version`` defaults to the previous one + 1 and must increase.
        """
        new = self._version + 1 if version is None else version
        if new <= self._version:
            raise WeightError(f"version {new} is not newer than the published {self._version}")
        if state is not None:
            if self.keep:
                self._history[new] = {k: v.detach().to(KEPT_ON, copy=True) for k, v in state.items()}
                while len(self._history) > self.keep:
                    self._history.popitem(last=False)
            if self._shared is not None:
                self._write_shared(state, new)
        elif self._shared is not None:
            raise WeightError("a shared buffer has subscribers; publish needs the weights")
        self._version = new
        if state is not None:
            self._announce(new, state)
        return new

    def _announce(self, version: int, state: State) -> None:
        if self.on_publish is not None:
            kept = self._history.get(version)  # an immutable host copy; make one when none is kept
            self.on_publish(
                version, kept if kept is not None else {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
            )

    def initialize(self, state: State) -> None:
        """Record ``state`` as the weights of the current version, without a new version
        (at the start of a run or after a resume), for subscribers and rollback alike."""
        if self.keep:
            self._history[self._version] = {k: v.detach().to(KEPT_ON, copy=True) for k, v in state.items()}
            while len(self._history) > self.keep:
                self._history.popitem(last=False)
        if self._shared is not None:
            self._write_shared(state, self._version)
        self._announce(self._version, state)

    def _write_shared(self, state: State, version: int) -> None:
        shared = self._shared
        assert shared is not None
        missing = set(shared.tensors) ^ set(state)
        if missing:
            raise WeightError(f"published weights differ from the shared buffer in: {sorted(missing)[:5]}")
        self._acquire(shared)  # no reader starts a step or a copy from here on
        try:
            self._wait_for_steps(shared)
            with torch.no_grad():
                for name, buf in shared.tensors.items():
                    buf.copy_(state[name])
                shared.meta[VERSION] = version
        finally:
            shared.lock.release()

    def _wait_for_steps(self, shared: SharedWeights, poll: float = 0.0005, max_poll: float = 0.01) -> None:
        """Wait until no in-place reader is inside a step (they end within an engine step; one that died there
        is cleared by reader_gone, one frozen there is reported to on_wait each 0.1 s, its owner may kill it)."""
        readers = shared.meta[READERS:]
        reported = time.monotonic()
        while bool(readers.any()):
            time.sleep(poll)
            poll = min(2 * poll, max_poll)
            if self.on_wait is not None and time.monotonic() - reported >= 0.1:
                reported = time.monotonic()
                for pid in readers.tolist():
                    if pid:
                        self.on_wait(int(pid))

    def _acquire(self, shared: SharedWeights) -> None:
        """Take the buffer's lock; one held with no holder recorded for STUCK_S is released first."""
        unowned_since: float | None = None
        while not shared.lock.acquire(timeout=0.1):
            holder = int(shared.meta[HOLDER])
            if holder:  # a live reader copying (a dead one is released by reader_gone)
                unowned_since = None
                if self.on_wait is not None:
                    self.on_wait(holder)
                continue
            now = time.monotonic()
            unowned_since = unowned_since or now
            if now - unowned_since >= STUCK_S:
                with self._recover:
                    shared.lock.release()
                unowned_since = None

    def reader_died(self, pid: int) -> None:
        """Reader process ``pid`` has died: make sure it does not hold the buffer's lock any more.

        Its lock is released at once when its pid is recorded as the holder; when it died in the
        instant between taking the lock and recording itself, the lock stays held with no holder:
        that is released after STUCK_S. Returns once the lock can be taken (blocks up to STUCK_S)."""
        shared = self._shared
        if shared is None:
            return
        self.reader_gone(pid)
        self._acquire(shared)
        shared.lock.release()

    def reader_gone(self, pid: int) -> None:
        """Reader process ``pid`` has exited (called once, after its death): if it held the buffer's
        lock, release it on its behalf."""
        shared = self._shared
        if shared is None:
            return
        with self._recover:
            readers = shared.meta[READERS:]
            readers[readers == pid] = 0  # it died inside a step: a publish must not wait for it to end
            if int(shared.meta[HOLDER]) == pid:  # it died while copying: it can never clear this
                shared.meta[HOLDER] = 0
                shared.lock.release()

    def state(self, version: int) -> State:
        """The kept weights of ``version`` (for rollback or inspection)."""
        if version not in self._history:
            raise WeightError(f"version {version} is not kept (kept: {self.versions()})")
        return self._history[version]

    def rollback(self, to_version: int) -> tuple[int, State]:
        """Republish the weights of ``to_version`` under a new version; returns (new version, weights).

        The caller loads the returned weights into the trainer's model.
        """
        state = self.state(to_version)
        new = self.publish(state)
        return new, state

    def state_dict(self) -> dict[str, Any]:
        return {"version": self._version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._version = int(state["version"])


MAX_POLL_S = 0.016  # the longest a throttled instance sleeps between looks for new weights


class WeightSubscriber:
    """Rollout-side view of a :class:`SharedWeights` buffer."""

    def __init__(self, shared: SharedWeights, current_version: int = -1):
        self.shared = shared
        self.current_version = current_version

    @property
    def latest_version(self) -> int:
        return int(self.shared.meta[VERSION])

    def wait_for(
        self, version: int, timeout: float | None = None, poll: float = 0.001, max_poll: float = MAX_POLL_S
    ) -> bool:
        """Wait until a version >= ``version`` is available (throttle); False on timeout.

        The buffer has no lock-free way to wake a reader, so this polls: first every ``poll`` seconds, the
        interval doubling up to ``max_poll``. A fixed 2 ms poll woke every throttled instance 500 times a
        second for as long as the trainer trained, taking cores from it on a small host."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.latest_version < version:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            time.sleep(poll if deadline is None else min(poll, max(0.0, deadline - now)))
            poll = min(2 * poll, max_poll)
        return True

    @contextmanager
    def reading(self, slot: int) -> Iterator[int]:
        """In place: the buffer's weights stay as they are for the block (a publish waits for it to end);
        yields their version. ``slot``: this reader's own, below ``shared.reader_slots``."""
        meta = self.shared.meta
        if not 0 <= slot < self.shared.reader_slots:
            raise WeightError(f"reader slot {slot} is not one of the buffer's {self.shared.reader_slots}")
        with self.shared.lock:  # taken between publishes only: the weights are whole
            meta[READERS + slot] = os.getpid()
            version = int(meta[VERSION])
        try:
            yield version
        finally:
            meta[READERS + slot] = 0
        self.current_version = version

    def switch(self, apply: Callable[[State, int], None]) -> int | None:
        """At a batch boundary: if a newer version is available, hand it to ``apply``.

        ``apply(weights, version)`` runs under the buffer's lock and must copy what it
        needs (e.g. ``engine.update_weights``). Returns the new version, or None when
        already current.
        """
        if self.latest_version <= self.current_version:
            return None
        with self.shared.lock, torch.no_grad():
            self.shared.meta[HOLDER] = os.getpid()  # so the trainer can free the lock if we are killed here
            try:
                version = int(self.shared.meta[VERSION])
                apply(self.shared.tensors, version)
            finally:
                self.shared.meta[HOLDER] = 0
        self.current_version = version
        return version


def shared_weights_mode() -> str:
    """How host rollout instances read the shared buffer: ``in_place`` (the default) or ``copy``, from
    ``TANDEM_SHARED_WEIGHTS`` (to compare the two); anything else is refused naming the variable."""
    mode = os.environ.get("TANDEM_SHARED_WEIGHTS", "") or "in_place"
    if mode not in ("in_place", "copy"):
        raise WeightError(f"TANDEM_SHARED_WEIGHTS: {mode!r} is not in_place or copy")
    return mode


def shared_layout(like: State) -> State:
    """Shared-memory copies of ``like``'s tensors, as views of one storage per dtype.

    Ordered so that parameters of the same name in sibling modules lie side by side in their modules' order —
    ``layers.0.self_attn.{q,k,v}_proj.weight``, then their biases; ``mlp.{gate,up}_proj.weight`` — which lets
    an in-place reader use each run of them as one fused matrix, a view (runtime.rollout.runners.FastRunner).
    Names of one tensor (tied embeddings) share one view: a reader binding them stays tied."""
    names: list[str] = []
    same_as: dict[str, str] = {}  # a tied parameter (one tensor under two names) is one view under both
    first: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], str] = {}
    for name, t in like.items():
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape), tuple(t.stride()))
        if key in first:
            same_as[name] = first[key]
        else:
            first[key] = name
            names.append(name)

    def place(i: int) -> tuple[str, str, int]:
        module, _, leaf = names[i].rpartition(".")
        return module.rpartition(".")[0], leaf, i  # (the module's parent, the parameter's name, its order)

    by_dtype: dict[torch.dtype, list[str]] = {}
    for i in sorted(range(len(names)), key=place):
        by_dtype.setdefault(like[names[i]].dtype, []).append(names[i])
    out: State = {}
    for dtype, group in by_dtype.items():
        storage = torch.empty(sum(like[n].numel() for n in group), dtype=dtype).share_memory_()
        offset = 0
        for name in group:
            src = like[name].detach()
            view = storage[offset : offset + src.numel()].view(src.shape)
            view.copy_(src)
            out[name] = view
            offset += src.numel()
    return {name: out[same_as.get(name, name)] for name in like}  # the caller's names and order


def copy_into(model: torch.nn.Module) -> Callable[[State, int], None]:
    """An ``apply`` for :meth:`WeightSubscriber.switch` that copies into ``model``'s tensors in place."""
    targets = model.state_dict()

    def apply(state: State, version: int) -> None:
        for name, buf in state.items():
            targets[name].copy_(buf)

    return apply
