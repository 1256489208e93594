"""Length-aware scheduling of generation requests over several rollout instances, and the bubble metrics.

Generation lengths in RL are long-tailed: a static batch waits for its longest sample (padding), an
instance handed the unlucky batches finishes last (skew), and samples wait in queues meanwhile
(sorting wait). This module is the library the pipeline wires in; it holds no threads and no clocks of
its own (times are passed in), so it is tested on simulated instances with a deterministic cost model.

- :class:`LengthPredictor` — predicted response length of a request: the running mean of that
  prompt's past response lengths; else the mean of its task's; else its prompt length times the
  observed response/prompt ratio (1 before any observation); capped at ``max_new_tokens``.
  ``length_prediction: off`` predicts ``max_new_tokens`` for everything (length-blind scheduling).
- :func:`quantile_boundaries`, :func:`bucketize`, :func:`pack_batches` — bucket requests by predicted
  length (edges given in the spec, or quantiles of observed lengths) and cut each bucket into batches
  whose padded size ``rows x longest (prompt + predicted)`` fits ``max_batch_tokens``.
- :func:`mix_groups` — long/short mixing: requests (longest first) go to the scheduling group with
  the least predicted work so far, so the long ones spread evenly, short ones fill in, and all groups
  carry about the same work (longest-processing-time first: a group exceeds the mean by at most its
  largest request). Each group is then bucketed and packed into batches of similar lengths.
- :class:`Dispatcher` — queue-aware dispatch: work goes to the live instance with the smallest
  estimated completion time ``(queued predicted tokens + the new work) / measured tokens per second``;
  :meth:`Scheduler.plan` applies it request by request, longest first, before batching.
- :class:`BubbleMeter` — ``padding_ratio = 1 - real tokens / allocated tokens``, ``skewness = max
  instance busy time / mean instance busy time``, ``sorting_wait = mean queue wait / mean instance
  busy time``, per step and per instance.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class Request:
    """One generation request (one sequence) as the scheduler sees it."""

    request_id: Hashable
    prompt_id: Hashable
    prompt_len: int
    task: str = ""
    predicted: float = 0.0  # filled in by LengthPredictor.annotate
    enqueued_at: float = 0.0  # clock time it entered the queue (sorting wait)
    payload: Any = None

    @property
    def cost(self) -> float:
        """Predicted tokens: prompt plus predicted response."""
        return self.prompt_len + self.predicted


class _Mean:
    """A running mean."""

    __slots__ = ("n", "mean")

    def __init__(self) -> None:
        self.n = 0
        self.mean = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.mean += (x - self.mean) / self.n


class LengthPredictor:
    """Predicted response length per request; see the module docstring for the fall-back order."""

    def __init__(self, max_new_tokens: int, mode: str = "from_stats"):
        if mode not in ("from_stats", "off"):
            raise ValueError(f"length_prediction must be 'from_stats' or 'off', got {mode!r}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.max_new_tokens = max_new_tokens
        self.mode = mode
        self._prompt: dict[Hashable, _Mean] = defaultdict(_Mean)
        self._task: dict[str, _Mean] = defaultdict(_Mean)
        self._ratio = _Mean()  # response length / prompt length over every observation
        self.lengths: list[int] = []  # every observed response length, for quantile bucket edges

    def observe(self, prompt_id: Hashable, task: str, prompt_len: int, response_len: int) -> None:
        """Record one finished response."""
        self._prompt[prompt_id].add(response_len)
        self._task[task].add(response_len)
        self._ratio.add(response_len / max(prompt_len, 1))
        self.lengths.append(response_len)

    def predict(self, prompt_id: Hashable, task: str, prompt_len: int) -> float:
        if self.mode == "off":
            return float(self.max_new_tokens)
        if prompt_id in self._prompt:
            guess = self._prompt[prompt_id].mean
        elif task in self._task:
            guess = self._task[task].mean
        else:
            guess = prompt_len * (self._ratio.mean if self._ratio.n else 1.0)
        return float(min(max(guess, 1.0), self.max_new_tokens))

    def source(self, prompt_id: Hashable, task: str) -> str:
        """Which statistic :meth:`predict` uses: ``prompt``, ``task``, ``prompt_len`` or ``off``."""
        if self.mode == "off":
            return "off"
        return "prompt" if prompt_id in self._prompt else "task" if task in self._task else "prompt_len"

    def annotate(self, requests: Sequence[Request]) -> None:
        """Set ``predicted`` on each request."""
        for r in requests:
            r.predicted = self.predict(r.prompt_id, r.task, r.prompt_len)


def quantile_boundaries(lengths: Sequence[float], num_buckets: int) -> list[int]:
    """Bucket edges at the 1/k, 2/k, ... quantiles of ``lengths`` (strictly increasing, duplicates dropped).

    A length ``x`` falls in bucket ``i`` when ``edges[i-1] < x <= edges[i]``; above the last edge is
    the last bucket. Empty ``lengths`` or one bucket: no edges (everything in one bucket).
    """
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    if not lengths or num_buckets == 1:
        return []
    ordered = sorted(lengths)
    edges: list[int] = []
    for i in range(1, num_buckets):
        q = ordered[min(len(ordered) - 1, math.ceil(i * len(ordered) / num_buckets) - 1)]
        edge = math.ceil(q)
        if not edges or edge > edges[-1]:
            edges.append(edge)
    return edges


def check_boundaries(edges: Sequence[int]) -> None:
    if any(b <= a for a, b in zip(edges, edges[1:], strict=False)) or (edges and edges[0] < 1):
        raise ValueError(f"rollout.bucket_boundaries must be positive and strictly increasing, got {list(edges)}")


def bucketize(requests: Sequence[Request], edges: Sequence[int]) -> list[list[Request]]:
    """Requests grouped by predicted length into ``len(edges) + 1`` buckets (shortest first)."""
    check_boundaries(edges)
    buckets: list[list[Request]] = [[] for _ in range(len(edges) + 1)]
    for r in requests:
        buckets[bisect.bisect_left(edges, math.ceil(r.predicted))].append(r)
    return buckets


def check_fits(requests: Sequence[Request], max_new_tokens: int, max_batch_tokens: int) -> None:
    """Every request must fit one batch even at its longest: prompt + max_new_tokens <= max_batch_tokens."""
    for r in requests:
        if r.prompt_len + max_new_tokens > max_batch_tokens:
            raise ValueError(
                f"rollout.max_batch_tokens ({max_batch_tokens}) is smaller than request {r.request_id!r}'s "
                f"prompt ({r.prompt_len} tokens) plus max_new_tokens ({max_new_tokens})"
            )


def pack_batches(bucket: Sequence[Request], max_batch_tokens: int, max_batch_size: int) -> list[list[Request]]:
    """Cut one bucket (sorted by cost) into batches whose ``rows x longest cost`` fits the token budget."""
    batches: list[list[Request]] = []
    current: list[Request] = []
    widest = 0.0
    for r in sorted(bucket, key=lambda r: r.cost):
        w = max(widest, r.cost)
        if current and (len(current) >= max_batch_size or w * (len(current) + 1) > max_batch_tokens):
            batches.append(current)
            current, w = [], r.cost
        current.append(r)
        widest = w
    if current:
        batches.append(current)
    return batches


def batch_cost(batch: Sequence[Request]) -> float:
    """Predicted token positions a static engine computes for ``batch``: rows x the longest request."""
    return len(batch) * max((r.cost for r in batch), default=0.0)


def batch_work(batch: Sequence[Request]) -> float:
    """Predicted tokens of ``batch`` without padding: what a continuous-batching instance computes."""
    return sum(r.cost for r in batch)


def mix_groups(items: Sequence[T], num_groups: int, cost: Callable[[T], float]) -> list[list[T]]:
    """Long/short mixing: ``items`` (requests or batches) dealt into ``num_groups`` groups of about equal
    ``cost``.

    Items go costliest first, each to the group with the least cost so far (longest-processing-time
    first), so the long items spread evenly over the groups, short ones fill in behind, and no group
    exceeds the mean by more than its costliest item. Each group lists its items costliest first — the
    order an instance should start them. Empty groups are dropped.
    """
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    groups: list[list[T]] = [[] for _ in range(num_groups)]
    load = [0.0] * num_groups
    for item in sorted(items, key=cost, reverse=True):
        g = min(range(num_groups), key=lambda i: (load[i], i))
        groups[g].append(item)
        load[g] += cost(item)
    return [g for g in groups if g]


@dataclass
class InstanceState:
    """What the dispatcher knows of one rollout instance."""

    instance_id: Hashable
    throughput: float  # measured tokens per second (exponential moving average)
    queued_tokens: float = 0.0  # predicted tokens dispatched and not yet completed
    alive: bool = True
    in_flight: dict[Hashable, float] = field(default_factory=dict)  # group id -> predicted tokens
    measured: bool = False


class Dispatcher:
    """Queue-aware dispatch over rollout instances (see module docstring).

    ``smoothing`` weighs a new throughput measurement in the moving average; instances start at
    ``initial_throughput`` until their first completion.
    """

    def __init__(self, instance_ids: Sequence[Hashable], initial_throughput: float = 1.0, smoothing: float = 0.5):
        if not instance_ids:
            raise ValueError("resources.rollout_workers: the dispatcher needs at least one rollout instance")
        if len(set(instance_ids)) != len(instance_ids):
            raise ValueError(f"instance ids must be unique, got {list(instance_ids)}")
        if initial_throughput <= 0 or not 0 < smoothing <= 1:
            raise ValueError("initial_throughput must be > 0 and smoothing in (0, 1]")
        self.smoothing = smoothing
        self.instances = {i: InstanceState(i, initial_throughput) for i in instance_ids}

    def throughput(self, instance_id: Hashable) -> float:
        """Measured tokens/s; an instance not measured yet is assumed as fast as the measured ones'
        mean (were it left at ``initial_throughput``, one fast first measurement elsewhere would starve it)."""
        st = self.instances[instance_id]
        if st.measured:
            return st.throughput
        measured = [o.throughput for o in self.instances.values() if o.measured]
        return sum(measured) / len(measured) if measured else st.throughput

    def estimated_completion(self, instance_id: Hashable, extra_tokens: float = 0.0) -> float:
        st = self.instances[instance_id]
        return (st.queued_tokens + extra_tokens) / self.throughput(instance_id)

    def choose(self, tokens: float, among: Collection[Hashable] | None = None) -> Hashable:
        """The live instance (of ``among``, when given) that would finish ``tokens`` more work soonest
        (ties: first listed)."""
        live = [i for i, st in self.instances.items() if st.alive and (among is None or i in among)]
        if not live:
            raise RuntimeError("no live rollout instance to dispatch to")
        return min(live, key=lambda i: self.estimated_completion(i, tokens))

    def dispatch(self, group_id: Hashable, tokens: float) -> Hashable:
        """Send a group of ``tokens`` predicted tokens to the best instance (:meth:`choose`); returns it."""
        target = self.choose(tokens)
        self.assign(group_id, target, tokens)
        return target

    def assign(self, group_id: Hashable, instance_id: Hashable, tokens: float) -> None:
        """Record that ``instance_id`` now has group ``group_id`` of ``tokens`` predicted tokens queued."""
        st = self.instances[instance_id]
        if not st.alive:
            raise RuntimeError(f"rollout instance {instance_id!r} is out of dispatch")
        st.in_flight[group_id] = tokens
        st.queued_tokens += tokens

    def complete(self, instance_id: Hashable, group_id: Hashable, tokens_done: float, busy_s: float) -> None:
        """A group finished: ``tokens_done`` tokens generated in ``busy_s`` seconds of the instance's time."""
        st = self.instances[instance_id]
        st.queued_tokens = max(0.0, st.queued_tokens - st.in_flight.pop(group_id, 0.0))
        self.measure(instance_id, tokens_done, busy_s)

    def measure(self, instance_id: Hashable, tokens: float, busy_s: float) -> None:
        """Fold ``tokens`` generated in ``busy_s`` seconds into the instance's throughput estimate."""
        st = self.instances[instance_id]
        if busy_s > 0 and tokens > 0:
            a = 1.0 if not st.measured else self.smoothing
            st.throughput = a * tokens / busy_s + (1 - a) * st.throughput
            st.measured = True

    def forget(self) -> None:
        """Every instance's queue is empty again (all in-flight work withdrawn, e.g. at a rollback)."""
        for st in self.instances.values():
            st.in_flight.clear()
            st.queued_tokens = 0.0

    def remove(self, instance_id: Hashable) -> list[Hashable]:
        """Take a dead instance out of dispatch; returns its in-flight group ids to re-dispatch."""
        st = self.instances[instance_id]
        st.alive = False
        lost = list(st.in_flight)
        st.in_flight.clear()
        st.queued_tokens = 0.0
        return lost

    def restore(self, instance_id: Hashable) -> None:
        """A restarted instance takes work again (with a fresh throughput estimate)."""
        st = self.instances[instance_id]
        st.alive, st.measured = True, False


class InstanceScaler:
    """Dynamic parallelism: how many rollout instances take new work, following the queue watermark.

    After each training step, ``update(watermark_fill)`` — the queue's high-water mark since the
    previous step as a fraction of its capacity — adds one active instance when the fill stayed
    below ``scale_up_below`` (the trainer is starving: more generation capacity) and parks one
    when it reached ``scale_down_above`` (samples pile up: give capacity back), within
    ``[minimum, maximum]``. One instance per step at most, so a single noisy step moves little.
    A parked instance finishes the work it holds and takes no more.
    """

    def __init__(self, minimum: int, maximum: int, scale_up_below: float, scale_down_above: float):
        if not 1 <= minimum <= maximum:
            raise ValueError(f"resources.min_rollout_workers: need 1 <= {minimum} <= rollout_workers ({maximum})")
        if not 0 <= scale_up_below < scale_down_above <= 1:
            raise ValueError(
                f"pipeline.scale_up_below ({scale_up_below}) must be below scale_down_above ({scale_down_above})"
            )
        self.minimum, self.maximum = minimum, maximum
        self.low, self.high = scale_up_below, scale_down_above
        self.active = maximum  # start with full generation capacity: the queue is empty at the start

    def update(self, watermark_fill: float) -> int:
        """The active count after a step whose queue watermark was ``watermark_fill`` (0..1)."""
        if watermark_fill < self.low and self.active < self.maximum:
            self.active += 1
        elif watermark_fill >= self.high and self.active > self.minimum:
            self.active -= 1
        return self.active


class BubbleMeter:
    """Accumulates one step's bubble figures; :meth:`report` returns them and starts the next step."""

    def __init__(self, instance_ids: Sequence[Hashable]):
        self.instance_ids = list(instance_ids)
        self._reset()

    def _reset(self) -> None:
        self.busy = dict.fromkeys(self.instance_ids, 0.0)
        self.real = dict.fromkeys(self.instance_ids, 0)
        self.allocated = dict.fromkeys(self.instance_ids, 0)
        self.waits: list[float] = []

    def record_work(self, instance_id: Hashable, busy_s: float, real_tokens: int, allocated_tokens: int) -> None:
        if real_tokens > allocated_tokens:
            raise ValueError(f"real tokens ({real_tokens}) exceed allocated tokens ({allocated_tokens})")
        self.busy[instance_id] += busy_s
        self.real[instance_id] += real_tokens
        self.allocated[instance_id] += allocated_tokens

    def record_wait(self, wait_s: float) -> None:
        """Time one request waited in a queue before an instance started it."""
        self.waits.append(max(0.0, wait_s))

    def report(self, among: Collection[Hashable] | None = None) -> dict[str, float]:
        """This step's figures; skewness over the instances ``among`` (default all: e.g. the active ones,
        since a parked instance is idle by design)."""
        busy = self.busy if among is None else {i: b for i, b in self.busy.items() if i in among}
        out = bubble_metrics(busy, sum(self.real.values()), sum(self.allocated.values()), self.waits)
        for i in self.instance_ids:
            pad = 1.0 - self.real[i] / self.allocated[i] if self.allocated[i] else 0.0
            out[f"instance/{i}/busy_s"] = self.busy[i]
            out[f"instance/{i}/padding_ratio"] = pad
        self._reset()
        return out


def bubble_metrics(
    busy_s: dict[Hashable, float], real_tokens: int, allocated_tokens: int, waits_s: Sequence[float]
) -> dict[str, float]:
    """The three bubbles (see module docstring). Idle instances count in the mean busy time."""
    mean_busy = sum(busy_s.values()) / len(busy_s) if busy_s else 0.0
    return {
        "padding_ratio": 1.0 - real_tokens / allocated_tokens if allocated_tokens else 0.0,
        "skewness": max(busy_s.values()) / mean_busy if mean_busy > 0 else 1.0,
        "sorting_wait": (sum(waits_s) / len(waits_s)) / mean_busy if waits_s and mean_busy > 0 else 0.0,
    }


class Scheduler:
    """Predictor, bucketing, mixing and dispatch together: ``plan(requests)`` -> groups per instance.

    ``plan`` annotates predictions, checks every request fits the token budget, spreads the requests
    over the instances by estimated completion time (long and short mixed), and buckets and packs each
    instance's share into token-budget batches. Feed finished responses back to ``predictor.observe``
    so the next step's predictions and quantile edges improve. ``groups_per_instance`` > 1 cuts an
    instance's share into smaller groups (finer re-dispatch when an instance fails).
    """

    def __init__(
        self,
        instance_ids: Sequence[Hashable],
        max_new_tokens: int,
        max_batch_tokens: int,
        max_batch_size: int,
        length_prediction: str = "from_stats",
        bucket_boundaries: Sequence[int] | None = None,
        num_buckets: int = 4,
        mix_long_short: bool = True,
        groups_per_instance: int = 1,
    ):
        if bucket_boundaries is not None:
            check_boundaries(bucket_boundaries)
        if max_batch_tokens < max_new_tokens + 1:
            raise ValueError(
                f"rollout.max_batch_tokens ({max_batch_tokens}) is smaller than one prompt token plus "
                f"max_new_tokens ({max_new_tokens})"
            )
        self.predictor = LengthPredictor(max_new_tokens, length_prediction)
        self.dispatcher = Dispatcher(instance_ids)
        self.meter = BubbleMeter(instance_ids)
        self.max_new_tokens = max_new_tokens
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.bucket_boundaries = list(bucket_boundaries) if bucket_boundaries is not None else None
        self.num_buckets = num_buckets
        self.mix_long_short = mix_long_short
        self.groups_per_instance = groups_per_instance
        self._next_group = 0

    def boundaries(self) -> list[int]:
        if self.bucket_boundaries is not None:
            return self.bucket_boundaries
        return quantile_boundaries(self.predictor.lengths, self.num_buckets)

    def batches(self, requests: Sequence[Request]) -> list[list[Request]]:
        """Bucket by predicted length and pack into token-budget batches (bucket by bucket, shortest first)."""
        out: list[list[Request]] = []
        for bucket in bucketize(requests, self.boundaries()):
            out.extend(pack_batches(bucket, self.max_batch_tokens, self.max_batch_size))
        return out

    def plan(self, requests: Sequence[Request]) -> list[tuple[int, Hashable, list[list[Request]]]]:
        """``(group_id, instance_id, batches)`` for every scheduling group, largest first.

        Predicts lengths and checks every request fits the token budget. With ``mix_long_short``,
        requests (longest first) each go to the live instance that would finish them soonest —
        ``(queued predicted tokens + planned + the request's) / measured throughput`` — so long and short
        requests mix and every instance gets work in proportion to its speed; each instance's share is
        split into ``groups_per_instance`` balanced groups (:func:`mix_groups`), and each group is
        bucketed and packed into batches, longest batch first. Without mixing, every packed batch is a
        group dispatched on its own. Report completions to ``dispatcher.complete``.
        """
        self.predictor.annotate(requests)
        check_fits(requests, self.max_new_tokens, self.max_batch_tokens)
        plan: list[tuple[int, Hashable, list[list[Request]]]] = []
        if not self.mix_long_short:
            for batch in sorted(self.batches(requests), key=batch_work, reverse=True):
                gid = self._new_group()
                plan.append((gid, self.dispatcher.dispatch(gid, batch_work(batch)), [batch]))
            return plan
        instances = self.dispatcher.instances
        live = [i for i, st in instances.items() if st.alive]
        if not live:
            raise RuntimeError("no live rollout instance to dispatch to")
        planned = {i: instances[i].queued_tokens for i in live}
        share: dict[Hashable, list[Request]] = {i: [] for i in live}
        for r in sorted(requests, key=lambda r: r.cost, reverse=True):
            target = min(live, key=lambda i: (planned[i] + r.cost) / self.dispatcher.throughput(i))
            share[target].append(r)
            planned[target] += r.cost
        for inst in live:
            for group in mix_groups(share[inst], self.groups_per_instance, lambda r: r.cost):
                batches = sorted(self.batches(group), key=batch_work, reverse=True)
                gid = self._new_group()
                self.dispatcher.assign(gid, inst, sum(map(batch_work, batches)))
                plan.append((gid, inst, batches))
        plan.sort(key=lambda p: sum(map(batch_work, p[2])), reverse=True)
        return plan

    def _new_group(self) -> int:
        self._next_group += 1
        return self._next_group - 1
