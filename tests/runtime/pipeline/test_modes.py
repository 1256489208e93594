"""The pipeline modes end to end on a tiny model: determinism, resume, staleness bound, accounting."""

from __future__ import annotations

import pytest
import torch

from runtime.checkpoint import load_checkpoint
from runtime.metrics import read_jsonl
from runtime.pipeline import run
from runtime.pipeline.driver import CHECKPOINT_DIR, RESOLVED_SPEC
from tests.runtime.helpers import tiny_spec


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _spec(tmp_path, name, **over):
    return tiny_spec(tmp_path, name, **over)


def _policy(result):
    return load_checkpoint(result["checkpoint"], keys=["trainer"])["trainer"]["policy"]


def _initial_policy(spec):
    from runtime.models import build_policy

    model, _ = build_policy(spec.model, "cpu", seed=spec.seed)
    return model.state_dict()


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sync_same_seed_is_deterministic_and_learns_something(tmp_path):
    a = run(_spec(tmp_path, "a", pipeline__mode="sync", pipeline__steps=3))
    b = run(_spec(tmp_path, "b", pipeline__mode="sync", pipeline__steps=3))
    assert _equal(_policy(a), _policy(b))
    assert not _equal(_policy(a), _initial_policy(_spec(tmp_path, "a")))  # training moved the weights
    for key in ("reward/mean", "loss/policy", "entropy", "response_len/mean"):
        assert a["metrics"][key] == b["metrics"][key]
    assert a["trace"]["consumed"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert (tmp_path / "a" / RESOLVED_SPEC).is_file()
    steps, _ = read_jsonl(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["weights/version"] for r in steps] == [1, 2, 3]


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_sync_resume_is_bit_identical(tmp_path, algo):
    whole = run(_spec(tmp_path, "whole", pipeline__mode="sync", pipeline__steps=4, algorithm__name=algo))
    first = run(_spec(tmp_path, "split", pipeline__mode="sync", pipeline__steps=2, algorithm__name=algo))
    resumed = _spec(tmp_path, "split", pipeline__mode="sync", pipeline__steps=4, algorithm__name=algo)
    second = run(resumed, resume=tmp_path / "split")
    assert first["trace"]["consumed"] + second["trace"]["consumed"] == whole["trace"]["consumed"]
    assert _equal(_policy(whole), _policy(second))
    full = load_checkpoint(whole["checkpoint"], keys=["trainer"])["trainer"]["optimizer"]["state"]
    again = load_checkpoint(second["checkpoint"], keys=["trainer"])["trainer"]["optimizer"]["state"]
    assert all(torch.equal(full[k]["exp_avg"], again[k]["exp_avg"]) for k in full)
    if algo == "ppo":  # the critic continues exactly too
        critic = [load_checkpoint(r["checkpoint"], keys=["trainer"])["trainer"]["critic"] for r in (whole, second)]
        assert _equal(*critic)
    # the metrics file continues where the checkpoint left it: no step twice
    steps, _ = read_jsonl(tmp_path / "split" / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2, 3, 4]


def test_colocated_with_offload_matches_sync(tmp_path):
    """Same seed, same math: sharing the trainer's parameters (zero copy) changes nothing numerically."""
    sync = run(_spec(tmp_path, "s", pipeline__mode="sync", pipeline__steps=2))
    colo = run(_spec(tmp_path, "c", pipeline__mode="colocated", pipeline__steps=2, pipeline__offload_optimizer=True))
    assert _equal(_policy(sync), _policy(colo))
    assert colo["metrics"]["weights/version"] == 2


def _accounting(*traces, leftover):
    consumed = [g for trace in traces for step in trace["consumed"] for g in step]
    dropped = [g for trace in traces for g in trace["dropped"]]
    return consumed, dropped, list(leftover)


@pytest.mark.slow
@pytest.mark.parametrize(("policy", "lag"), [("throttle", 1), ("drop", 0), ("sync", 0)])
def test_async_respects_the_staleness_bound_and_loses_nothing(tmp_path, policy, lag):
    spec = _spec(
        tmp_path,
        "async",
        pipeline__mode="async",
        pipeline__steps=5,
        pipeline__max_policy_lag=lag,
        pipeline__on_lag_exceeded=policy,
        pipeline__eval_interval=5,
    )
    result = run(spec)
    steps, _ = read_jsonl(tmp_path / "async" / "metrics.jsonl")
    train_steps = [r for r in steps if "staleness/max" in r]
    assert [r["step"] for r in train_steps] == [1, 2, 3, 4, 5]
    assert all(r["staleness/max"] <= lag for r in train_steps)
    assert all(r["queue/watermark"] <= spec.queue_capacity for r in train_steps)
    # engine vs trainer on the same weights (the probe re-scores stale samples with their own version)
    assert all(r["consistency/logprob_diff_max"] < 1e-3 for r in train_steps)
    consumed, dropped, leftover = _accounting(result["trace"], leftover=result["trace"]["leftover"])
    assert all(len(step) == 4 for step in result["trace"]["consumed"])
    everything = consumed + dropped + leftover
    assert len(everything) == len(set(everything))  # nothing twice
    assert set(everything) == set(range(max(everything) + 1))  # nothing lost
    assert [e["step"] for e in result["eval"]] == [0, 5]
    if policy != "drop":
        assert dropped == []  # throttle and sync regenerate; nothing is given up
    assert train_steps[-1]["samples/dropped_stale"] >= 4 * len(dropped)


@pytest.mark.slow
def test_async_resume_loses_and_duplicates_nothing(tmp_path):
    over = dict(
        pipeline__mode="async",
        pipeline__max_policy_lag=2,
        checkpoint__interval=2,
        checkpoint__keep_last=5,
    )
    first = run(_spec(tmp_path, "run", pipeline__steps=3, **over))
    ckpt = tmp_path / "run" / CHECKPOINT_DIR / "step-00000002"
    saved = load_checkpoint(ckpt, keys=["queue", "in_flight", "source"])
    queued = saved["queue"]["items"]["group_id"].unique().tolist()
    in_flight = [d["index"] for d in saved["in_flight"]]
    assert queued or in_flight  # the checkpoint really caught work in progress
    second = run(_spec(tmp_path, "run", pipeline__steps=5, **over), resume=ckpt)
    before = first["trace"]["consumed"][:2]
    consumed = [g for step in before + second["trace"]["consumed"] for g in step]
    everything = consumed + first["trace"]["dropped"] + second["trace"]["dropped"] + second["trace"]["leftover"]
    assert len(everything) == len(set(everything))
    assert set(everything) == set(range(max(everything) + 1))
    assert set(queued) | set(in_flight) <= set(everything)


def test_stop_hook_ends_the_run_as_if_it_were_the_last_step(tmp_path):
    seen = []

    def stop(step, metrics):
        seen.append((step, metrics["weights/version"]))
        return step == 2

    result = run(_spec(tmp_path, "stop", pipeline__mode="sync", pipeline__steps=50), stop=stop)
    assert result["steps"] == 2 and seen == [(1, 1), (2, 2)]
    assert result["checkpoint"].endswith("step-00000002")
    assert len(result["trace"]["consumed"]) == 2


def test_prompt_source_cycles_reissues_first_and_roundtrips():
    from runtime.samples import Prompt
    from runtime.workloads.llm import PromptSource, WorkItem

    prompts = [Prompt(10 + i, f"p{i}", f"a{i}") for i in range(3)]
    src = PromptSource(prompts)
    first = src.next(4, min_version=2)
    assert [(w.index, w.prompt.prompt_id, w.min_version) for w in first] == [
        (0, 10, 2),
        (1, 11, 2),
        (2, 12, 2),
        (3, 10, 2),
    ]
    src.give_back(first[1:3], min_version=5)
    state = src.state_dict()
    again = PromptSource(prompts)
    again.load_state_dict(state)
    for s in (src, again):
        got = s.next(3)
        assert [(w.index, w.min_version) for w in got] == [(1, 5), (2, 5), (4, 0)]
    assert WorkItem.unpack(first[0].pack()) == first[0]
