"""SampleQueue: capacity, watermark, staleness bound, no loss / no duplicate, snapshot, packed transfer."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.sample_queue import QueueClosed, SampleQueue, pack_samples, unpack_samples
from runtime.samples import Sample


@dataclass
class Item:
    sample_id: int
    version: int


def items(ids, version=0):
    return [Item(i, version) for i in ids]


def test_put_take_fifo_and_counts():
    q = SampleQueue(capacity=6)
    q.put(items([0, 1, 2]))
    q.put(items([3, 4]))
    got = q.take(4, version=0)
    assert [x.sample_id for x in got] == [0, 1, 2, 3]
    s = q.stats()
    assert (s.depth, s.put_total, s.taken_total, s.dropped_stale) == (1, 5, 4, 0)


def test_put_blocks_at_capacity_and_adds_nothing_on_timeout():
    q = SampleQueue(capacity=4)
    q.put(items([0, 1, 2]))
    assert q.put(items([3, 4]), timeout=0.01) is False
    assert len(q) == 3 and q.stats().put_total == 3
    with pytest.raises(ValueError, match="exceeds the queue capacity"):
        q.put(items(range(10, 15)))


def test_blocked_producer_resumes_when_consumer_takes():
    q = SampleQueue(capacity=2)
    q.put(items([0, 1]))
    done = threading.Event()

    def produce():
        q.put(items([2, 3]))
        done.set()

    t = threading.Thread(target=produce)
    t.start()
    assert not done.wait(0.05)
    assert [x.sample_id for x in q.take(2, 0)] == [0, 1]
    t.join(5)
    assert done.is_set() and [x.sample_id for x in q.take(2, 0)] == [2, 3]


def test_duplicate_ids_are_rejected_even_after_consumption():
    q = SampleQueue(capacity=8)
    q.put(items([1, 2]))
    q.take(2, 0)
    with pytest.raises(ValueError, match="already queued or consumed"):
        q.put(items([2, 3]))
    with pytest.raises(ValueError, match="duplicate sample_id"):
        q.put(items([5, 5]))
    assert len(q) == 0 and q.stats().put_total == 2


def test_watermark_tracks_high_water_and_resets():
    q = SampleQueue(capacity=10)
    q.put(items(range(7)))
    q.take(5, 0)
    s = q.stats()
    assert (s.depth, s.high_water, s.watermark, s.fill) == (2, 7, 0.7, 0.2)
    q.reset_watermark()
    assert q.stats().high_water == 2


def test_take_times_out_without_removing_anything():
    q = SampleQueue(capacity=4)
    q.put(items([0]))
    assert q.take(2, 0, timeout=0.01) is None
    assert len(q) == 1


def test_stale_items_are_never_returned_and_are_counted():
    q = SampleQueue(capacity=10, max_policy_lag=1, on_lag_exceeded="drop")
    q.put([Item(0, 0), Item(1, 1), Item(2, 2), Item(3, 0)])
    got = q.take(2, version=2)
    assert [x.sample_id for x in got] == [1, 2]
    stale = q.pop_stale()
    assert [x.sample_id for x in stale] == [0, 3]
    assert q.pop_stale() == []
    assert q.stats().dropped_stale == 2 and len(q) == 0


def test_close_wakes_waiters():
    q = SampleQueue(capacity=2)
    errors = []

    def consume():
        try:
            q.take(1, 0)
        except QueueClosed as exc:
            errors.append(exc)

    t = threading.Thread(target=consume)
    t.start()
    q.close()
    t.join(5)
    assert len(errors) == 1


def test_snapshot_restore_roundtrip_keeps_contents_counters_and_ids():
    q = SampleQueue(capacity=10, max_policy_lag=0, on_lag_exceeded="drop")
    q.put([Item(0, 0), Item(1, 1), Item(2, 1)])
    q.take(1, version=1)  # drops 0 as stale, takes 1
    snap = q.snapshot()
    r = SampleQueue(capacity=10, max_policy_lag=0, on_lag_exceeded="drop")
    r.restore(snap)
    assert [x.sample_id for x in r.take(1, 1)] == [2]
    assert [x.sample_id for x in r.pop_stale()] == [0]
    s = r.stats()
    assert (s.put_total, s.taken_total, s.dropped_stale) == (3, 2, 1)
    with pytest.raises(ValueError, match="already queued or consumed"):
        r.put(items([1]))
    with pytest.raises(RuntimeError, match="empty queue"):
        r.restore(snap)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    lag=st.integers(0, 3),
    policy=st.sampled_from(["throttle", "drop", "sync"]),
    producers=st.integers(1, 3),
    steps=st.integers(3, 12),
    group=st.integers(1, 4),
)
def test_staleness_bound_holds_under_random_delays(seed, lag, policy, producers, steps, group):
    """Producers stamp items with the version they read and sleep random times; the trainer
    consumes with random delays. Every consumed item is within the lag; every produced item is
    consumed or reported stale exactly once."""
    rng = random.Random(seed)
    per_step = 2 * group
    q = SampleQueue(capacity=3 * per_step, max_policy_lag=lag, on_lag_exceeded=policy)
    version = [0]
    next_id = [0]
    lock = threading.Lock()
    stop = threading.Event()
    delays = [[rng.random() * 0.002 for _ in range(500)] for _ in range(producers)]

    def producer(k):
        i = 0
        while not stop.is_set():
            with lock:
                ids = list(range(next_id[0], next_id[0] + group))
                next_id[0] += group
            v = version[0]
            stop.wait(delays[k][i % 500])
            i += 1
            try:
                if not q.put(items(ids, v), timeout=0.5):
                    with lock:  # never got in: account it as never produced
                        produced_back.extend(ids)
            except QueueClosed:
                produced_back.extend(ids)
                return

    produced_back: list[int] = []
    threads = [threading.Thread(target=producer, args=(k,)) for k in range(producers)]
    for t in threads:
        t.start()
    consumed = []
    stale = []
    for _ in range(steps):
        batch = q.take(per_step, version[0], timeout=10)
        assert batch is not None
        for x in batch:
            assert version[0] - x.version <= lag
        consumed += [x.sample_id for x in batch]
        stale += [x.sample_id for x in q.pop_stale()]
        stop.wait(rng.random() * 0.003)  # training time
        version[0] += 1
    stop.set()
    q.close()
    for t in threads:
        t.join(5)
    left = [x.sample_id for x in q.snapshot()["items"]]
    stale += [x.sample_id for x in q.pop_stale()]
    accounted = consumed + stale + left + produced_back
    assert len(accounted) == len(set(accounted)) == next_id[0]


def _sample(i, n_prompt, n_resp):
    return Sample(
        sample_id=i,
        prompt_id=100 + i,
        group_id=i // 2,
        prompt_ids=list(range(3, 3 + n_prompt)),
        response_ids=list(range(50, 50 + n_resp)),
        logprobs=[-0.1 * (k + 1) / 3 for k in range(n_resp)],
        versions=[7] * n_resp,
        finish_reason="stop" if i % 2 else "length",
        reward=0.25 * i,
        correct=bool(i % 2),
        extra={"size": i},
    )


def test_packed_transfer_roundtrip_is_exact_and_unpadded():
    samples = [_sample(0, 4, 1), _sample(1, 2, 9), _sample(2, 5, 0)]
    packed = pack_samples(samples)
    assert packed["prompt_ids"].numel() + packed["response_ids"].numel() == 4 + 1 + 2 + 9 + 5 + 0  # no padding
    assert packed["logprobs"].numel() == 10 and packed["response_lens"].tolist() == [1, 9, 0]
    assert unpack_samples(packed) == samples
    assert unpack_samples(pack_samples([])) == []


def test_packed_transfer_survives_a_process_boundary():
    samples = [_sample(i, 3, i) for i in range(4)]
    ctx = torch.multiprocessing.get_context("spawn")
    q = ctx.Queue()
    q.put(pack_samples(samples))
    assert unpack_samples(q.get(timeout=30)) == samples


def test_pack_rejects_mismatched_lengths():
    s = _sample(0, 2, 3)
    s.logprobs = s.logprobs[:2]
    with pytest.raises(ValueError, match="differ in length"):
        pack_samples([s])
