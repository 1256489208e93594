"""The length-aware scheduler: prediction fall-backs, bucketing, token-budget packing, long/short mixing,
queue-aware dispatch (balance on simulated instances with a deterministic cost model), bubble metrics."""

from __future__ import annotations

import random

import pytest

from runtime.rollout.scheduling import (
    BubbleMeter,
    Dispatcher,
    LengthPredictor,
    Request,
    Scheduler,
    batch_cost,
    batch_work,
    bubble_metrics,
    bucketize,
    mix_groups,
    pack_batches,
    quantile_boundaries,
)


def req(i, prompt_len=4, predicted=0.0, task="t", prompt_id=None):
    return Request(request_id=i, prompt_id=i if prompt_id is None else prompt_id, prompt_len=prompt_len,
                   task=task, predicted=predicted)  # fmt: skip


# ----- prediction ----------------------------------------------------------------------------------------
def test_prediction_falls_back_from_prompt_to_task_to_prompt_length():
    p = LengthPredictor(max_new_tokens=100)
    assert (p.predict("a", "rev", 7), p.source("a", "rev")) == (7.0, "prompt_len")  # ratio 1 before data
    p.observe("b", "rev", prompt_len=4, response_len=10)
    p.observe("c", "rev", prompt_len=4, response_len=20)
    assert (p.predict("a", "rev", 7), p.source("a", "rev")) == (15.0, "task")
    # Another task, never seen: prompt length times the observed response/prompt ratio (2.5 and 5 -> 3.75).
    assert (p.predict("z", "copy", 4), p.source("z", "copy")) == (15.0, "prompt_len")
    p.observe("a", "rev", prompt_len=7, response_len=3)
    p.observe("a", "rev", prompt_len=7, response_len=6)
    assert (p.predict("a", "rev", 7), p.source("a", "rev")) == (4.5, "prompt")  # running mean of 3 and 6
    p.observe("long", "rev", 7, 500)
    assert p.predict("long", "rev", 7) == 100.0  # capped at max_new_tokens


def test_prediction_off_assumes_the_longest():
    p = LengthPredictor(max_new_tokens=64, mode="off")
    p.observe("a", "t", 4, 3)
    assert (p.predict("a", "t", 4), p.source("a", "t")) == (64.0, "off")
    with pytest.raises(ValueError, match="length_prediction"):
        LengthPredictor(64, mode="sometimes")


# ----- bucketing and packing ---------------------------------------------------------------------------
def test_quantile_boundaries_and_bucketize():
    lengths = [1, 2, 2, 3, 4, 5, 8, 13, 40, 100]
    assert quantile_boundaries(lengths, 4) == [2, 4, 13]  # the 3rd, 5th and 8th of 10 sorted lengths
    assert quantile_boundaries([5] * 10, 4) == [5]  # duplicate edges dropped
    assert quantile_boundaries([], 4) == [] and quantile_boundaries(lengths, 1) == []
    rs = [req(i, predicted=x) for i, x in enumerate([1, 2, 3, 4, 4.5, 13, 14, 99.5])]
    buckets = bucketize(rs, [2, 4, 13])  # a bucket takes (previous edge, edge]; 4.5 rounds up to 5
    assert [[r.predicted for r in b] for b in buckets] == [[1, 2], [3, 4], [4.5, 13], [14, 99.5]]
    with pytest.raises(ValueError, match="rollout.bucket_boundaries must be positive and strictly increasing"):
        bucketize(rs, [5, 5])


def test_pack_batches_respects_token_budget_and_size():
    rng = random.Random(0)
    rs = [req(i, prompt_len=rng.randint(2, 10), predicted=rng.randint(1, 60)) for i in range(200)]
    batches = pack_batches(rs, max_batch_tokens=256, max_batch_size=8)
    assert sorted(r.request_id for b in batches for r in b) == list(range(200))  # each exactly once
    assert all(len(b) <= 8 and batch_cost(b) <= 256 for b in batches)
    # Packed by cost, neighbours are similar: padding inside a batch is small.
    real = sum(r.cost for r in rs)
    assert 1 - real / sum(map(batch_cost, batches)) < 0.1


def test_budget_smaller_than_one_request_is_a_clear_error():
    with pytest.raises(ValueError, match=r"rollout.max_batch_tokens \(32\) is smaller than one prompt token"):
        Scheduler(["a"], max_new_tokens=32, max_batch_tokens=32, max_batch_size=8)
    s = Scheduler(["a"], max_new_tokens=32, max_batch_tokens=40, max_batch_size=8)
    with pytest.raises(ValueError, match=r"request 7's prompt \(9 tokens\) plus max_new_tokens \(32\)"):
        s.plan([req(7, prompt_len=9)])
    with pytest.raises(ValueError, match="at least one rollout instance"):
        Scheduler([], max_new_tokens=8, max_batch_tokens=64, max_batch_size=8)
    with pytest.raises(ValueError, match="bucket_boundaries"):
        Scheduler(["a"], max_new_tokens=8, max_batch_tokens=64, max_batch_size=8, bucket_boundaries=[8, 4])


# ----- mixing ------------------------------------------------------------------------------------------
def long_tailed(n, seed, top=200):
    """Response lengths with a long tail: most short, a few up to ``top``."""
    rng = random.Random(seed)
    return [min(top, int(4 / (1 - rng.random()) ** 1.2)) for _ in range(n)]


def test_mixing_balances_groups_and_mixes_long_with_short():
    lengths = long_tailed(256, seed=1)
    rs = [req(i, prompt_len=4, predicted=x) for i, x in enumerate(lengths)]
    groups = mix_groups(rs, 4, lambda r: r.cost)
    assert sorted(r.request_id for g in groups for r in g) == list(range(256))  # each exactly once
    loads = [sum(r.cost for r in g) for g in groups]
    mean = sum(loads) / 4
    assert max(loads) - mean <= max(r.cost for r in rs)  # the LPT bound
    assert max(loads) / mean < 1.02
    longest = sorted(rs, key=lambda r: -r.cost)[:8]
    for g in groups:
        assert sum(r in longest for r in g) == 2  # the 8 longest spread two per group
        assert min(r.predicted for r in g) < 10  # and short ones fill in behind
        assert [r.cost for r in g] == sorted((r.cost for r in g), reverse=True)  # longest first
    # Batches mix the same way.
    batches = pack_batches(rs, 512, 16)
    bgroups = mix_groups(batches, 4, batch_work)
    bloads = [sum(map(batch_work, g)) for g in bgroups]
    assert max(bloads) - sum(bloads) / 4 <= max(map(batch_work, batches))


def test_plan_groups_are_balanced_bucketed_and_dispatched_largest_first():
    rs = [req(i, prompt_len=4, prompt_id=i) for i in range(64)]
    sched = Scheduler(["a", "b"], max_new_tokens=128, max_batch_tokens=1024, max_batch_size=8, groups_per_instance=4)
    for r, x in zip(rs, long_tailed(64, seed=5, top=128), strict=True):
        sched.predictor.observe(r.prompt_id, "t", 4, x)
    plan = sched.plan(rs)
    assert len(plan) == 8  # 4 groups per instance
    assert sorted(r.request_id for _, _, g in plan for b in g for r in b) == list(range(64))
    works = [sum(map(batch_work, g)) for _, _, g in plan]
    assert works == sorted(works, reverse=True)
    assert sorted(inst for _, inst, _ in plan) == ["a"] * 4 + ["b"] * 4
    queued = {i: st.queued_tokens for i, st in sched.dispatcher.instances.items()}
    assert abs(queued["a"] - queued["b"]) <= max(works)
    for _, _, g in plan:
        assert all(len(b) <= 8 and batch_cost(b) <= 1024 for b in g)


# ----- dispatch ----------------------------------------------------------------------------------------
def test_dispatcher_picks_smallest_estimated_completion_and_learns_throughput():
    d = Dispatcher(["a", "b"])
    assert d.dispatch(1, 100) == "a"
    assert d.dispatch(2, 60) == "b"  # a has 100 queued, b none
    assert d.dispatch(3, 30) == "b"  # 90 < 130
    d.complete("a", 1, tokens_done=100, busy_s=0.5)  # a: 200 tok/s, now empty
    d.complete("b", 2, tokens_done=60, busy_s=1.0)  # b: 60 tok/s, 30 left
    assert d.instances["a"].throughput == 200 and d.instances["b"].queued_tokens == 30
    assert d.dispatch(4, 100) == "a"  # 100/200 = 0.5 s beats (30+100)/60
    assert d.remove("a") == [4] and d.instances["a"].queued_tokens == 0
    assert d.dispatch(5, 1) == "b"  # a dead: out of dispatch
    d.remove("b")
    with pytest.raises(RuntimeError, match="no live rollout instance"):
        d.dispatch(6, 1)


def test_plan_gives_a_faster_instance_proportionally_more_work():
    sched = Scheduler(["slow", "fast"], max_new_tokens=64, max_batch_tokens=1024, max_batch_size=16)
    sched.dispatcher.complete("slow", None, tokens_done=100, busy_s=1.0)  # 100 tok/s
    sched.dispatcher.complete("fast", None, tokens_done=300, busy_s=1.0)  # 300 tok/s
    rs = [req(i, prompt_len=4, prompt_id=i) for i in range(120)]
    for r, x in zip(rs, long_tailed(120, seed=2, top=64), strict=True):
        sched.predictor.observe(r.prompt_id, "t", 4, x)
    plan = sched.plan(rs)
    work = {inst: sum(map(batch_work, g)) for _, inst, g in plan}
    assert work["fast"] / work["slow"] == pytest.approx(3.0, rel=0.1)
    est = [sched.dispatcher.estimated_completion(i) for i in ("slow", "fast")]
    assert max(est) / min(est) < 1.1  # both finish at about the same time
    sched.dispatcher.remove("slow")
    assert {inst for _, inst, _ in sched.plan(rs[:10])} == {"fast"}  # a removed instance gets nothing
    with pytest.raises(RuntimeError, match="out of dispatch"):
        sched.dispatcher.assign(99, "slow", 1.0)


def simulate(scheduler, prompts, true_len, speeds, steps, rng, fifo=False, batch=16):
    """Run ``steps`` steps on simulated instances: an instance spends ``tokens / speed`` seconds on a group
    (continuous batching: real tokens only; FIFO static batches: rows x longest). Returns per-step skewness."""
    skews = []
    for _ in range(steps):
        requests = [Request(pid, pid, plen, task="t") for pid, plen in prompts]
        actual = {pid: max(1, true_len[pid] + rng.randint(-2, 2)) for pid, _ in prompts}
        busy = dict.fromkeys(speeds, 0.0)
        if fifo:  # fixed-size batches in arrival order, round robin
            ids = list(speeds)
            for k in range(0, len(requests), batch):
                chunk = requests[k : k + batch]
                inst = ids[(k // batch) % len(ids)]
                busy[inst] += len(chunk) * max(r.prompt_len + actual[r.request_id] for r in chunk) / speeds[inst]
        else:
            for gid, inst, group in scheduler.plan(requests):
                tokens = sum(r.prompt_len + actual[r.request_id] for b in group for r in b)
                busy[inst] += tokens / speeds[inst]
                scheduler.dispatcher.complete(inst, gid, tokens, tokens / speeds[inst])
        for r in requests:
            scheduler.predictor.observe(r.prompt_id, r.task, r.prompt_len, actual[r.request_id])
        skews.append(bubble_metrics(busy, 1, 1, [])["skewness"])
    return skews


@pytest.mark.parametrize("speeds", [{"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 2.0, "c": 1.5, "d": 1.0}])
def test_dispatch_balances_long_tailed_workloads_on_simulated_instances(speeds):
    rng = random.Random(7)
    prompts = [(pid, rng.randint(3, 12)) for pid in range(256)]
    true_len = dict(zip((p for p, _ in prompts), long_tailed(256, seed=3, top=256), strict=True))
    sched = Scheduler(list(speeds), max_new_tokens=256, max_batch_tokens=4096, max_batch_size=16)
    skews = simulate(sched, prompts, true_len, speeds, steps=4, rng=rng)
    # Step 1 knows neither lengths nor speeds; from step 2 on both are measured.
    assert max(skews[1:]) <= 1.15
    if len(set(speeds.values())) > 1:  # unequal instances: FIFO batches dealt round robin are skewed
        fifo = simulate(Scheduler(list(speeds), 256, 4096, 16), prompts, true_len, speeds, 2, rng, fifo=True)
        assert min(fifo) > 1.15


# ----- bubble metrics ----------------------------------------------------------------------------------
def test_bubble_meter_reports_the_three_bubbles_per_step_and_instance():
    m = BubbleMeter(["a", "b"])
    m.record_work("a", busy_s=3.0, real_tokens=90, allocated_tokens=100)
    m.record_work("b", busy_s=1.0, real_tokens=50, allocated_tokens=100)
    for w in (1.0, 3.0):
        m.record_wait(w)
    out = m.report()
    assert out == {
        "padding_ratio": pytest.approx(0.3),
        "skewness": 1.5,  # 3 / mean(3, 1)
        "sorting_wait": 1.0,  # mean wait 2 / mean busy 2
        "instance/a/busy_s": 3.0,
        "instance/a/padding_ratio": pytest.approx(0.1),
        "instance/b/busy_s": 1.0,
        "instance/b/padding_ratio": 0.5,
    }
    assert m.report()["skewness"] == 1.0 and m.report()["padding_ratio"] == 0.0  # reset for the next step
    with pytest.raises(ValueError, match="exceed allocated"):
        m.record_work("a", 1.0, real_tokens=5, allocated_tokens=4)
