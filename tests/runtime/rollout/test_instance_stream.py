"""The multi-instance rollout of async mode, piece by piece: aggregated packed transfer, cancelling
and admission records of the continuous batcher, the dynamic-parallelism scaler, and dispatch
restricted to the active instances."""

from __future__ import annotations

import time

import pytest
import torch

from runtime.models import build_policy
from runtime.rollout import Engine, SamplingParams
from runtime.rollout.scheduling import BubbleMeter, Dispatcher, InstanceScaler
from runtime.rollout.transfer import Aggregator, sample_nbytes
from runtime.sample_queue import pack_samples
from runtime.samples import Sample
from runtime.spec import ModelSpec

torch.set_num_threads(1)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def sample(i, prompt_len=3, response_len=2):
    return Sample(
        sample_id=i,
        prompt_id=i,
        group_id=i,
        prompt_ids=list(range(prompt_len)),
        response_ids=list(range(response_len)),
        logprobs=[-0.5] * response_len,
        versions=[1] * response_len,
        finish_reason="stop",
    )


# ----- aggregation -----------------------------------------------------------------------------------------
def test_aggregator_flushes_by_size_before_the_window():
    clock = Clock()
    agg = Aggregator(max_bytes=100, window_s=10.0, nbytes=len, clock=clock)
    assert not agg.due() and agg.flush() == []
    agg.add("a" * 60)
    assert not agg.due()  # 60 bytes, window not over
    agg.add("b" * 39)
    assert not agg.due()  # 99 bytes
    agg.add("c")
    assert agg.due()  # 100 bytes: at the threshold, at once
    assert agg.flush() == ["a" * 60, "b" * 39, "c"]  # oldest first
    assert (len(agg), agg.bytes, agg.due()) == (0, 0, False)


def test_aggregator_flushes_by_time_from_the_oldest_entry():
    clock = Clock()
    agg = Aggregator(max_bytes=1 << 20, window_s=0.5, nbytes=len, clock=clock)  # binary fractions: exact
    agg.add("x")
    clock.now += 0.375
    agg.add("y")  # a newer entry does not restart the window
    assert not agg.due()
    clock.now += 0.125
    assert agg.due()
    assert agg.flush() == ["x", "y"]
    clock.now += 5
    assert not agg.due()  # empty: nothing is ever due
    agg.add("z")
    assert not agg.due()  # the window starts at the first entry after a flush


def test_a_zero_window_sends_each_entry_at_once():
    agg = Aggregator(max_bytes=1 << 20, window_s=0.0, nbytes=len, clock=Clock())
    agg.add("x")
    assert agg.due()


@pytest.mark.parametrize(("max_bytes", "window", "field"), [(0, 0.1, "transfer_max_bytes"), (1, -1, "window_s")])
def test_aggregator_rejects_bad_thresholds_naming_the_field(max_bytes, window, field):
    with pytest.raises(ValueError, match=field):
        Aggregator(max_bytes=max_bytes, window_s=window, nbytes=len)


def test_sample_nbytes_is_the_packed_size_without_extras():
    samples = [sample(0, 3, 2), sample(1, 1, 0), sample(2, 7, 11)]  # an empty response included
    packed = pack_samples(samples)
    tensors = sum(v.numel() * v.element_size() for v in packed.values() if isinstance(v, torch.Tensor))
    assert sample_nbytes(samples) == tensors
    # packed moves no padding: against rows padded to the longest prompt and response
    padded = len(samples) * (8 * 7 + 24 * 11 + 50)
    assert sample_nbytes(samples) < padded


# ----- the batcher under streaming -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def policy():
    return build_policy(ModelSpec(builtin="tiny-qwen2"), "cpu", seed=3)


def test_cancelled_requests_free_their_slots_and_the_rest_generate_as_alone(policy):
    model, tok = policy
    params = SamplingParams(8, temperature=0, ignore_eos=True)
    prompts = {tag: tok.encode_prompt(text) for tag, text in enumerate(["abc=", "hello=", "xy", "reverse:ab="])}
    engine = Engine(model, tok, "cpu", max_batch_size=2)
    batcher = engine.batcher(params)
    for tag, ids in prompts.items():
        batcher.submit(ids, tag)
    batcher.step()  # admits 0 and 1 into the two slots
    assert sorted(batcher.admitted) == [0, 1] and batcher.num_waiting == 2
    batcher.admitted.clear()
    assert batcher.cancel(lambda tag: tag in (1, 2)) == 2  # one live, one waiting
    assert (batcher.num_live, batcher.num_waiting) == (1, 1)
    done = {}
    while not batcher.idle:
        done.update(batcher.step())
    assert sorted(done) == [0, 3] and batcher.admitted == [3]
    for tag in (0, 3):  # greedy: the same tokens as generating the prompt alone
        alone = Engine(model, tok, "cpu").generate([prompts[tag]], params)[0]
        assert done[tag].token_ids == alone.token_ids


# ----- dynamic parallelism and dispatch --------------------------------------------------------------------
def test_scaler_follows_the_watermark_one_instance_per_step_within_bounds():
    s = InstanceScaler(minimum=1, maximum=3, scale_up_below=0.25, scale_down_above=0.9)
    assert s.active == 3  # full capacity at the start, when the queue is empty
    assert [s.update(f) for f in (0.1, 0.95, 1.0, 1.0, 0.5, 0.2, 0.0, 0.0, 0.9)] == [3, 2, 1, 1, 1, 2, 3, 3, 2]


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((0, 2, 0.2, 0.9), "min_rollout_workers"),
        ((3, 2, 0.2, 0.9), "min_rollout_workers"),
        ((1, 2, 0.9, 0.9), "scale_up_below"),
    ],
)
def test_scaler_rejects_bad_bounds_naming_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        InstanceScaler(*args)


def test_dispatch_among_active_instances_and_forget():
    d = Dispatcher([0, 1, 2])
    for i, rate in enumerate((100, 100, 1000)):
        d.measure(i, tokens=rate, busy_s=1.0)  # instance 2 is fastest, but parked
    assert d.choose(10, among=[0, 1]) == 0
    d.assign("g", 0, 10)
    assert d.choose(10, among=[0, 1]) == 1
    assert d.choose(10) == 2
    d.forget()
    assert [st.queued_tokens for st in d.instances.values()] == [0.0, 0.0, 0.0]
    with pytest.raises(RuntimeError, match="no live rollout instance"):
        d.choose(1, among=[])


def test_skewness_over_the_active_instances_only():
    meter = BubbleMeter([0, 1])
    meter.record_work(0, busy_s=2.0, real_tokens=90, allocated_tokens=100)
    meter.record_work(1, busy_s=0.0, real_tokens=0, allocated_tokens=0)  # parked
    assert meter.report(among=[0])["skewness"] == 1.0
    meter.record_work(0, busy_s=2.0, real_tokens=90, allocated_tokens=100)
    assert meter.report()["skewness"] == 2.0  # counting the parked one as idle


def test_an_unmeasured_instance_is_assumed_as_fast_as_the_measured_ones():
    d = Dispatcher([0, 1, 2])
    d.measure(0, tokens=600, busy_s=1.0)
    d.measure(1, tokens=200, busy_s=1.0)
    assert d.throughput(2) == 400.0  # not the initial 1 token/s, which would starve it
    d.assign("a", 0, 600)
    d.assign("b", 1, 100)
    assert d.choose(100) == 2  # (0 + 100) / 400 beats (100 + 100) / 200 and (600 + 100) / 600


# ----- one rollout instance, in this process, with real parts ----------------------------------------------
class InstanceHarness:
    """A RolloutInstance on the tiny model: real engine, shared weights, pipe and work queue; its loop in a thread."""

    def __init__(self, tmp_path, in_place: bool = False, **over):
        import queue
        import threading
        from multiprocessing import Pipe

        from runtime.models import build_policy
        from runtime.weights.service import WeightService, WeightSubscriber
        from runtime.workloads.llm import build_engine, build_task
        from runtime.workloads.llm.instance import RolloutInstance, engine_on_shared_weights
        from tests.runtime.helpers import TINY, tiny_spec

        self.spec = tiny_spec(tmp_path, "inst", TINY, pipeline__mode="async", pipeline__transfer_window_s=0.0, **over)
        policy, tok = build_policy(self.spec.model, "cpu", seed=self.spec.seed)
        self.weights = WeightService(keep=0)
        ctx = torch.multiprocessing.get_context("spawn")
        shared = self.weights.shared_handle(policy.state_dict(), ctx, readers=1)
        self.weights.initialize(policy.state_dict())
        self.state = policy.state_dict()
        self.flags = ctx.RawArray("q", 2)
        self.recv, send = Pipe(duplex=False)
        self.work: queue.Queue = queue.Queue()
        if in_place:  # the engine's parameters are the shared buffer's tensors
            engine = engine_on_shared_weights(self.spec, torch.device("cpu"), shared, 0)
            assert engine is not None
        else:
            engine = build_engine(policy, tok, torch.device("cpu"), self.spec)
        sub = WeightSubscriber(shared, current_version=-1)
        task = build_task(self.spec)
        self.instance = RolloutInstance(0, self.spec, engine, tok, task, sub, send, self.flags, in_place=in_place)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.instance.run, args=(self.work, self.stop.is_set), daemon=True)
        self.thread.start()

    def send(self, tickets_items, epoch=0):
        self.work.put((epoch, [(t, item.pack()) for t, item in tickets_items]))

    def results(self, want: int, timeout: float = 60.0) -> list[tuple[dict, list]]:
        """Result messages until ``want`` groups (kept or dropped) are back."""
        from runtime.rollout.wire import from_bytes
        from runtime.sample_queue import unpack_samples

        out, got, deadline = [], 0, time.monotonic() + timeout
        while got < want:
            assert self.recv.poll(max(0.0, deadline - time.monotonic())), f"only {got} of {want} groups came back"
            kind, _, payload = self.recv.recv()
            if kind == "samples":
                blob, info = payload
                out.append((info, unpack_samples(from_bytes(blob))))
                got += len(info["tickets"]) + len(info["dropped"])
        return out

    def close(self):
        self.stop.set()
        self.thread.join(10)
        self.instance.close()


def items(*specs):
    from runtime.samples import Prompt
    from runtime.workloads.llm import WorkItem

    return [
        (ticket, WorkItem(index=ticket, prompt=Prompt(ticket, "abc", "cba", 3), min_version=v)) for ticket, v in specs
    ]


@pytest.mark.parametrize("in_place", [False, True], ids=["copying", "in-place"])
def test_an_instance_holds_a_group_until_its_weights_and_streams_the_others(tmp_path, in_place):
    h = InstanceHarness(tmp_path, in_place=in_place)
    try:
        h.send(items((0, 0), (1, 1), (2, 0)))  # group 1 needs weights version 1, not published yet
        first = h.results(2)
        assert sorted(t for info, _ in first for t in info["tickets"]) == [0, 2]
        assert h.recv.poll(0.5) is False or h.recv.recv()[0] == "beat"  # group 1 waits
        h.weights.publish(h.state, version=1)
        (info, samples), *_ = h.results(1)
        assert info["tickets"] == [1]
        assert [s.sample_id for s in samples] == [4, 5, 6, 7]  # issue index 1 x group size 4 + j
        assert {v for s in samples for v in s.versions} == {1}  # every token from the new weights
        for info, samples in first:  # the others: whole groups, packed, with the bubble accounting
            assert len(samples) == 4 * len(info["tickets"]) and info["allocated"] >= info["real"] > 0
            assert all(w >= 0 for w in info["waits"]) and info["gen_s"] > 0
    finally:
        h.close()


def test_an_instance_forgets_the_groups_of_an_older_epoch(tmp_path):
    h = InstanceHarness(tmp_path)
    try:
        h.send(items((0, 5)))  # held: version 5 never comes in this test
        h.flags[1] = 1  # a rollback: epoch 1
        h.send(items((1, 0)), epoch=1)
        h.send(items((2, 0)), epoch=0)  # issued before the rollback, arriving after it: skipped
        (info, _), *_ = h.results(1)
        assert info["tickets"] == [1]
        time.sleep(0.3)  # a few more turns of its loop
        assert 0 not in h.instance.groups and 2 not in h.instance.groups and h.instance.held == []
    finally:
        h.close()


# ----- shared-memory transfer --------------------------------------------------------------------------------
def shm_names(prefix):
    import os

    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


def test_large_messages_cross_through_shared_memory_and_leave_nothing_behind():
    from runtime.rollout.transfer import ShmCourier

    prefix = f"tandem-test-{time.monotonic_ns()}-"
    courier = ShmCourier(prefix, min_bytes=1000)
    assert courier.wrap(b"x" * 999) == b"x" * 999  # small: as it is, through the pipe
    blob = bytes(range(256)) * 40
    ref = courier.wrap(blob)
    assert ref == ("shm", f"{prefix}0", len(blob)) and shm_names(prefix) == [f"{prefix}0"]
    assert ShmCourier.unwrap(ref) == blob
    assert shm_names(prefix) == []  # the receiver unlinked it
    assert ShmCourier.unwrap(ref) is None  # gone: the message is dropped, not an error
    assert ShmCourier.unwrap(b"abc") == b"abc"


def test_sweep_removes_the_segments_of_a_dead_sender_only():
    from runtime.rollout.transfer import ShmCourier, sweep

    stamp = time.monotonic_ns()
    dead, alive = ShmCourier(f"tandem-test-{stamp}-0-", 1), ShmCourier(f"tandem-test-{stamp}-1-", 1)
    dead.wrap(b"lost")
    dead.wrap(b"lost too")
    kept = alive.wrap(b"still to be read")
    assert sweep(f"tandem-test-{stamp}-0-") == 2
    assert shm_names(f"tandem-test-{stamp}-") == [f"tandem-test-{stamp}-1-0"]
    assert ShmCourier.unwrap(kept) == b"still to be read"
