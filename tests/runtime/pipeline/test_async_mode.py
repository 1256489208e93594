"""Async mode with several rollout instances, end to end on the tiny model: streaming instances report
the three bubbles, rewards can come from a real (failing) reward server, a hung instance is replaced,
and the active instance count follows the queue watermark. Every issued group is accounted for
exactly once in each run: trained on, dropped (stale or reward), or left over."""

from __future__ import annotations

import os
import signal
import zlib

import pytest
import torch

from runtime.control import Control
from runtime.metrics import read_jsonl
from runtime.pipeline import run
from tests.runtime.helpers import assert_each_group_once, derived, tiny_spec
from tests.runtime.reward_server import RewardServer

BASE = derived(
    seed=11,
    task={"name": "reverse", "min_len": 1, "max_len": 6, "train_size": 256, "eval_size": 8},
    rollout={"max_new_tokens": 8, "max_batch_size": 8},
    pipeline={"mode": "async", "max_policy_lag": 1, "queue_capacity": 32, "steps": 5},
    resources={"rollout_workers": 2, "threads_per_process": 1},
    checkpoint={"interval": 0},
)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def accounted_once(trace):
    return assert_each_group_once(
        trace["consumed"], trace["dropped"], trace.get("reward_dropped", []), trace["leftover"]
    )


@pytest.mark.slow
def test_two_streaming_instances_share_the_work_and_report_the_bubbles(tmp_path):
    # every result message through shared memory (the default sends only those of 64 KiB or more)
    before = {n for n in os.listdir("/dev/shm") if n.startswith("tandem-")}
    result = run(tiny_spec(tmp_path, "two", BASE, pipeline__transfer_shm_min_bytes=1))
    # nothing left, under this trainer's name or any other (a child naming its segments after the wrong pid
    # would leave them where a sweep by this pid never looks)
    assert {n for n in os.listdir("/dev/shm") if n.startswith("tandem-")} - before == set()
    steps, _ = read_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    for r in steps:
        assert 0.0 <= r["rollout/padding_ratio"] < 1.0
        assert r["rollout/skewness"] >= 1.0 and r["rollout/sorting_wait"] >= 0.0
        assert r["rollout/active_instances"] == 2
        assert r["staleness/max"] <= 1
    # dispatch spread the work over both instances (which of them produced what the five steps consumed
    # depends on how fast each started); each reports its own figures
    assert {rank for _, rank, _ in result["trace"]["issued_to"]} == {0, 1}
    assert sum(r[f"rollout/instance/{rank}/busy_s"] for r in steps for rank in (0, 1)) > 0
    for rank in (0, 1):
        assert all(0.0 <= r[f"rollout/instance/{rank}/padding_ratio"] < 1.0 for r in steps)
    assert [len(s) for s in result["trace"]["consumed"]] == [4] * 5
    accounted_once(result["trace"])


def failing(prompt: str) -> bool:
    """About a quarter of the prompts, always the same ones: the reward server fails them with a 500."""
    return zlib.crc32(prompt.encode()) % 4 == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_rewards_from_a_failing_server_drop_whole_groups_and_lose_nothing(tmp_path, mode):
    server = RewardServer(fail_prompt=failing, reward=0.75)
    try:
        spec = tiny_spec(
            tmp_path,
            mode,
            BASE,
            pipeline__mode=mode,
            resources__rollout_workers=2 if mode == "async" else 1,  # instances of their own: async only
            pipeline__queue_capacity=32 if mode == "async" else None,  # and so is a sample queue
            reward__url=server.url,
            reward__max_retries=1,
            reward__backoff_s=0.01,
            reward__timeout_s=5.0,
            reward__breaker_failures=1000,
        )
        result = run(spec)
    finally:
        server.close()
    steps, _ = read_jsonl(tmp_path / mode / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert all(r["reward/mean"] == 0.75 for r in steps)  # every trained sample got the server's reward
    trace = result["trace"]
    dropped = trace["reward_dropped"]
    assert dropped and server.failed_prompts  # the case is not trivial
    last = steps[-1]
    # whole groups; async instances go on generating until shutdown, so the trace may hold later drops
    assert last["samples/dropped_reward"] % 4 == 0 and 0 < last["samples/dropped_reward"] <= 4 * len(dropped)
    assert last["reward/dropped"] >= last["samples/dropped_reward"]  # each sample of a dropped group
    assert last["reward/retries"] >= last["reward/dropped"]  # was retried before it was given up
    consumed = accounted_once(trace) if mode == "async" else [g for s in trace["consumed"] for g in s]
    assert not set(consumed) & set(dropped)
    if mode == "sync":  # lock-step: a step asks for fresh prompts in place of dropped groups (3 rounds at most)
        assert all(1 <= len(s) <= 4 for s in trace["consumed"]) and 4 in map(len, trace["consumed"])
        assert sorted(consumed + dropped) == list(range(len(consumed) + len(dropped)))


@pytest.mark.slow
@pytest.mark.parametrize("copying", [False, True], ids=["generating", "copying-weights"])
def test_a_hung_instance_is_killed_and_replaced_and_nothing_is_lost(tmp_path, monkeypatch, copying):
    """copying: it froze while copying published weights, holding the shared buffer's lock, so the
    trainer's next publish waits on it — and must find it out from there (the publishing thread is
    the one that supervises the instances)."""
    from runtime.weights.service import HOLDER, WeightService

    # one instance: the run cannot go on until the frozen one is found out and replaced
    # 5 s: a healthy instance beats every second, with room for a loaded machine's hiccups
    spec = tiny_spec(tmp_path, "hung", BASE, rollout__hang_timeout_s=5.0, resources__rollout_workers=1)
    control = Control()
    stopped = []
    buffers = []
    shared_handle = WeightService.shared_handle
    monkeypatch.setattr(
        WeightService, "shared_handle", lambda *a, **kw: buffers.append(shared_handle(*a, **kw)) or buffers[-1]
    )

    def stop(step, metrics):
        if step == 2:  # freeze it: alive, holding work, silent
            pid = control.status()["rollout_pids"][0]
            # the lock is taken before the freeze: frozen first, the instance may itself hold it (it copies
            # the weights of step 1 about now) and the test would wait for ever on a lock nobody releases
            if copying:
                assert buffers[-1].lock.acquire(timeout=30)
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
            if copying:  # what a reader frozen inside WeightSubscriber.switch leaves behind
                buffers[-1].meta[HOLDER] = pid
        return False

    result = run(spec, control=control, stop=stop)
    assert result["outcome"] == "completed" and result["steps"] == 5
    _, events = read_jsonl(tmp_path / "hung" / "metrics.jsonl")
    restarted = [e["payload"] for e in events if e["event"] == "rollout_restarted"]
    assert [(e["rank"], e["reason"]) for e in restarted] == [
        (0, "sent nothing for rollout.hang_timeout_s=5 s and was killed")
    ]
    assert stopped and stopped[0] not in control.status()["rollout_pids"]
    accounted_once(result["trace"])


@pytest.mark.slow
def test_the_active_instance_count_follows_the_queue_watermark(tmp_path):
    # Any sample left in the queue after a step counts as full enough to park an instance: from two
    # active instances down to the minimum of one, which takes all the new work from then on.
    spec = tiny_spec(
        tmp_path,
        "scale",
        BASE,
        resources__min_rollout_workers=1,
        pipeline__scale_up_below=0.0,
        pipeline__scale_down_above=0.01,
        pipeline__steps=6,
    )
    result = run(spec)
    steps, events = read_jsonl(tmp_path / "scale" / "metrics.jsonl")
    active = [r["rollout/active_instances"] for r in steps]
    assert active[0] == 2 and active[-1] == 1 and sorted(active, reverse=True) == active
    scaled = [e["payload"] for e in events if e["event"] == "rollout_scaled"]
    assert [(e["was"], e["active"]) for e in scaled] == [(2, 1)]
    # before parking both instances got work; from the step it was parked on, instance 1 gets none
    issued = result["trace"]["issued_to"]
    parked_at = scaled[0]["step"]
    assert {rank for step, rank, _ in issued if step < parked_at} == {0, 1}
    assert {rank for step, rank, _ in issued if step >= parked_at} == {0}
    accounted_once(result["trace"])


@pytest.mark.slow
def test_reward_counters_are_run_totals_across_a_resume(tmp_path):
    server = RewardServer(fail_prompt=failing, reward=0.75)
    try:
        over = dict(
            reward__url=server.url,
            reward__max_retries=0,
            reward__timeout_s=5.0,
            reward__breaker_failures=1000,
            checkpoint__interval=3,
        )
        first = tiny_spec(tmp_path, "counted", BASE, pipeline__steps=3, **over)
        run(first)
        before, _ = read_jsonl(tmp_path / "counted" / "metrics.jsonl")
        at_checkpoint = before[-1]
        assert at_checkpoint["samples/dropped_reward"] > 0 and at_checkpoint["reward/dropped"] > 0
        again = tiny_spec(tmp_path, "counted", BASE, pipeline__steps=6, **over)
        run(again, resume=tmp_path / "counted" / "checkpoints")
    finally:
        server.close()
    steps, _ = read_jsonl(tmp_path / "counted" / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    # the resumed process counts on from the checkpoint's totals, never from zero
    for key in ("samples/dropped_reward", "reward/dropped", "reward/requests"):
        assert steps[3][key] >= at_checkpoint[key], key
        assert all(a[key] <= b[key] for a, b in zip(steps, steps[1:], strict=False)), key
