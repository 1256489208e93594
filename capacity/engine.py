"""A rollout instance's engine: continuous batching of groups, one simulated engine step at a time.

It mirrors the runtime's (``runtime/rollout/batcher.py``, ``runtime/workloads/llm/instance.py``):

* a group (one prompt's ``group_size`` sequences) starts whole, on the weights current then, which
  gives all its samples one version;
* admission, at a step boundary and in arrival order, keeps the live sequences within
  ``max_batch_size`` slots and their reservations (prompt + ``max_new_tokens`` each) within
  ``max_batch_tokens``; a group is always admitted into an empty engine;
* one engine step costs ``decode_step_s + decode_s_per_token * sequences decoded +
  prefill_s_per_token * prompt tokens admitted``; an admitted sequence gets its first token from the
  prefill, every other live sequence one token; a finished sequence frees its slot for the next step;
* a group whose ``min_version`` is newer than the engine's weights is held back (throttle) without
  holding anything else back, and released, in issue order, when such weights arrive;
* new weights are taken at a step boundary: the engine pauses while it loads them.

Steps in which nothing joins or leaves cost the same, so the engine advances through them in one
simulated interval (up to the next sequence to finish) and is woken early only by new work or
weights; the result is the same as stepping one by one, with far fewer events.

On a CPU host whose processes outnumber its cores (``Config.host_cores``), every compute interval
of an engine or a trainer is a job on :class:`HostCores`, and the engine steps one step at a time
(its speed changes whenever another process starts or stops computing).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import simpy

from capacity.costs import Costs


class HostCores:
    """A host's cores shared by its processes' compute (processor sharing): while ``n`` jobs run, each
    advances at ``min(1, cores / (n + background))`` of one core's speed — a one-thread process never
    uses more than one core, and the operating system's scheduler shares the cores equally among the
    runnable ones (the egalitarian processor-sharing queue; Kleinrock, Queueing Systems vol. 2, 1976,
    section 4.4). ``background``: cores' worth of other work always runnable on the host (a shared
    machine), which takes its share too."""

    def __init__(self, env: simpy.Environment, cores: int, background: float = 0.0):
        self.env = env
        self.cores = cores
        self.background = background
        self._jobs: list[list[Any]] = []  # [seconds of one core's work left, event to trigger when done]
        self._updated = env.now
        self._changed = env.event()
        env.process(self._run())

    def run(self, seconds: float) -> simpy.Event:
        """An event that triggers when ``seconds`` of one core's work are done."""
        done = self.env.event()
        if seconds <= 0:
            done.succeed()
            return done
        self._advance()
        self._jobs.append([float(seconds), done])
        if not self._changed.triggered:
            self._changed.succeed()
        return done

    def _rate(self) -> float:
        return min(1.0, self.cores / (len(self._jobs) + self.background)) if self._jobs else 1.0

    def _advance(self) -> None:
        now = self.env.now
        if self._jobs and now > self._updated:
            done = (now - self._updated) * self._rate()
            for job in self._jobs:
                job[0] -= done
        self._updated = now

    def _run(self) -> Generator[Any, Any, None]:
        while True:
            first: list[Any] | None = None
            if not self._jobs:
                yield self._changed
            else:
                first = min(self._jobs, key=lambda job: job[0])
                ends_at = self.env.now + max(first[0], 0.0) / self._rate()
                yield self._changed | self.env.timeout(ends_at - self.env.now)
            if self._changed.triggered:
                self._changed = self.env.event()
            self._advance()
            if first is not None and self.env.now >= ends_at:
                first[0] = 0.0  # done by construction, whatever the floating-point residue
            finished = [job for job in self._jobs if job[0] <= _DONE_S]
            self._jobs = [job for job in self._jobs if job[0] > _DONE_S]
            for job in finished:
                job[1].succeed()


_DONE_S = 1e-12  # a job with this little work left is finished (floating-point residue)


def compute(env: simpy.Environment, cores: HostCores | None, seconds: float) -> simpy.Event:
    """``seconds`` of one device's compute: a plain interval, or a job on the shared host cores."""
    return env.timeout(seconds) if cores is None else cores.run(seconds)


@dataclass(eq=False)
class Group:
    """One prompt's samples as they travel through the pipeline."""

    index: int
    """Issue index: the prompt's identity (its lengths are drawn from it)."""
    lengths: list[int]
    prompt_tokens: int
    predicted: float
    """Predicted tokens of the whole group (prompts + responses): the dispatcher's cost."""
    min_version: int = 0
    """Oldest weights allowed to generate it (throttle)."""
    version: int = -1
    """Weights it was generated with (set when it starts)."""
    left: int = 0
    """Sequences still generating."""
    engine: int = -1
    """Index of the engine it was dispatched to (async)."""
    finished: simpy.Event | None = field(default=None, repr=False)

    @property
    def response_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def tokens(self) -> int:
        return self.response_tokens + self.prompt_tokens * len(self.lengths)


class RolloutEngine:
    """One rollout instance's engine in the simulation; ``on_done(group)`` when a group finishes."""

    def __init__(
        self,
        env: simpy.Environment,
        costs: Costs,
        *,
        max_batch_size: int,
        max_batch_tokens: int,
        max_new_tokens: int,
        on_done: Callable[[Group], None],
        staged_at: dict[int, float] | None = None,
        cores: HostCores | None = None,
    ):
        self.env = env
        self.cores = cores
        self.costs = costs
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_new_tokens = max_new_tokens
        self.on_done = on_done
        self.version = 0
        self.staged_at = {} if staged_at is None else staged_at  # version -> when the trainer staged it
        self.busy_s = 0.0  # computing engine steps
        self.load_s = 0.0  # loading new weights
        self.await_weights_s = 0.0  # idle, holding work back for weights already staged but not yet here
        self.queued_cost = 0.0  # predicted tokens submitted and not finished: the dispatcher's view
        self.queued_groups = 0
        self._held: list[Group] = []
        self._ready: deque[Group] = deque()
        self._steps = 0  # engine steps so far: a live sequence finishes at a step count (a heap of them)
        self._live: list[tuple[int, int, Group]] = []  # (finishing step, admission order, group)
        self._admitted = 0
        self._reserved = 0
        self._weights: tuple[int, float] | None = None  # (version, seconds to load it)
        self._wake: simpy.Event | None = None
        self._doing: tuple[str, float] | None = None  # ("generate" | "load" | "idle", since when)
        env.process(self._run())

    # ---- from the pipeline ----
    def submit(self, group: Group) -> None:
        self.queued_cost += group.predicted
        self.queued_groups += 1
        (self._ready if group.min_version <= self.version else self._held).append(group)
        self._poke()

    def offer_weights(self, version: int, load_s: float) -> None:
        """Weights ``version`` have arrived; the engine loads them at its next step boundary."""
        if version > max(self.version, self._weights[0] if self._weights else -1):
            self._weights = (version, load_s)
            self._poke()

    def set_version(self, version: int) -> None:
        """Weights changed under an idle engine (lock-step modes: the trainer did the copy)."""
        self.version = version
        self._release_held()

    # ---- the engine loop ----
    def _poke(self) -> None:
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def _release_held(self) -> None:
        ready = sorted((g for g in self._held if g.min_version <= self.version), key=lambda g: g.index)
        if ready:
            self._held = [g for g in self._held if g.min_version > self.version]
            self._ready.extend(ready)

    def _admit(self) -> tuple[int, int]:
        """Admit ready groups that fit; (sequences admitted, prompt tokens to prefill)."""
        seqs = prefill = 0
        while self._ready:
            group = self._ready[0]
            n = len(group.lengths)
            need = n * (group.prompt_tokens + self.max_new_tokens)
            fits = len(self._live) + n <= self.max_batch_size and self._reserved + need <= self.max_batch_tokens
            if self._live and not fits:
                break
            self._ready.popleft()
            group.version = self.version
            group.left = n
            self._reserved += need
            for length in group.lengths:  # its first token comes with the next step (the prefill)
                heapq.heappush(self._live, (self._steps + length, self._admitted, group))
                self._admitted += 1
            seqs += n
            prefill += n * group.prompt_tokens
        return seqs, prefill

    def _advance(self, steps: int) -> None:
        """Every live sequence produced ``steps`` tokens; retire the finished ones."""
        self._steps += steps
        while self._live and self._live[0][0] <= self._steps:
            group = heapq.heappop(self._live)[2]
            self._reserved -= group.prompt_tokens + self.max_new_tokens
            group.left -= 1
            if group.left == 0:
                self.queued_cost -= group.predicted
                self.queued_groups -= 1
                self.on_done(group)

    def _run(self) -> Generator[Any, Any, None]:
        env, costs = self.env, self.costs
        while True:
            if self._weights is not None:
                version, load_s = self._weights
                self._weights = None
                if load_s > 0:
                    self._doing = ("load", env.now)
                    yield env.timeout(load_s)
                    self._doing = None
                    self.load_s += load_s
                self.version = version
                self._release_held()
            seqs, prefill = self._admit()
            if not self._live:
                self._doing = ("idle", env.now)
                self._wake = env.event()
                yield self._wake
                self._wake = None
                self.await_weights_s += self._awaited_since(self._doing[1])
                self._doing = None
                continue
            # one step: the admitted sequences prefill, the others decode a token each
            self._doing = ("generate", env.now)
            yield compute(env, self.cores, costs.engine_step_s(len(self._live) - seqs, prefill))
            self._end_generating()
            self._advance(1)
            if not self._live or self._weights is not None or self._could_admit() or self.cores is not None:
                continue
            yield from self._stretch()

    def _awaited_since(self, idle_from: float) -> float:
        """The part of an idle interval until now spent holding work for weights the trainer had staged."""
        if not self._held or self._ready:
            return 0.0
        staged = self.staged_at.get(min(g.min_version for g in self._held))
        return 0.0 if staged is None else max(0.0, self.env.now - max(idle_from, staged))

    def _end_generating(self) -> None:
        assert self._doing is not None
        self.busy_s += self.env.now - self._doing[1]
        self._doing = None

    def time_spent(self) -> tuple[float, float, float]:
        """Seconds (generating, loading weights, awaiting weights) so far, the interval in progress
        included, so that a measurement window can start and end at any instant."""
        busy, load, awaited = self.busy_s, self.load_s, self.await_weights_s
        if self._doing is not None:
            doing, since = self._doing
            if doing == "generate":
                busy += self.env.now - since
            elif doing == "load":
                load += self.env.now - since
            else:
                awaited += self._awaited_since(since)
        return busy, load, awaited

    def _could_admit(self) -> bool:
        if not self._ready:
            return False
        group = self._ready[0]
        n = len(group.lengths)
        need = n * (group.prompt_tokens + self.max_new_tokens)
        return len(self._live) + n <= self.max_batch_size and self._reserved + need <= self.max_batch_tokens

    def _stretch(self) -> Generator[Any, Any, None]:
        """Identical decode steps up to the next finish, cut short (at a step boundary) by new work
        or weights."""
        env = self.env
        steps = self._live[0][0] - self._steps
        step_s = self.costs.engine_step_s(len(self._live))
        started = env.now
        self._doing = ("generate", started)
        self._wake = env.event()
        yield self._wake | env.timeout(steps * step_s)
        self._wake = None
        elapsed = env.now - started
        if elapsed < steps * step_s:  # woken: finish the step in progress
            done = min(steps, math.ceil(elapsed / step_s - 1e-9)) if step_s > 0 else steps
            if done * step_s > elapsed:
                yield env.timeout(done * step_s - elapsed)
            steps = done
        self._end_generating()
        self._advance(steps)
