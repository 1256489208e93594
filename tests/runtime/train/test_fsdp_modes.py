"""fsdp in the modes other than a plain sync run: colocated (the engine gets the gathered state each step,
the sharded optimizer state offloaded while generating), async (publication and checkpoints are collectives
the leader commands from its loop; the probe and evaluator read published weights), and a rollback (every
rank loads its shards back)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from runtime.checkpoint import HF_DIR
from runtime.control import Directive
from runtime.metrics import read_jsonl
from runtime.pipeline import run
from runtime.pipeline.driver import CHECKPOINT_DIR
from tests.runtime.helpers import assert_each_group_once, derived, tiny_spec
from tests.runtime.pipeline.test_control import _run

TWO_RANKS = {"threads_per_process": 1, "trainer_devices": 2}


def _spec(tmp_path, name, strategy, **sections):
    data = derived(
        seed=11,
        trainer={"collective_timeout_s": 60, "strategy": strategy},
        resources=TWO_RANKS,
        **sections,
    )
    return tiny_spec(tmp_path, name, data)


def _losses(tmp_path, name):
    steps, _ = read_jsonl(tmp_path / name / "metrics.jsonl")
    return [s["loss/policy"] for s in steps], [s["grad_norm"] for s in steps]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.mark.slow
def test_colocated_fsdp_with_the_optimizer_offloaded_trains_as_ddp_does(tmp_path):
    sections = {"pipeline": {"mode": "colocated", "steps": 3, "offload_optimizer": True}}
    ddp = run(_spec(tmp_path, "ddp", "ddp", **sections))
    fsdp = run(_spec(tmp_path, "fsdp", "fsdp", **sections))

    assert ddp["outcome"] == fsdp["outcome"] == "completed"
    assert fsdp["trace"]["consumed"] == ddp["trace"]["consumed"]  # same prompts: the same generated batches
    (loss_ddp, norm_ddp), (loss_fsdp, norm_fsdp) = _losses(tmp_path, "ddp"), _losses(tmp_path, "fsdp")
    # the engine generated from the gathered fsdp weights: the same samples, so the same losses
    torch.testing.assert_close(loss_fsdp, loss_ddp, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(norm_fsdp, norm_ddp, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_async_fsdp_trains_every_group_once_and_evaluates_published_weights(tmp_path):
    spec = _spec(
        tmp_path,
        "async",
        "fsdp",
        pipeline={"mode": "async", "steps": 4, "eval_interval": 2, "max_policy_lag": 1},
        checkpoint={"interval": 2},
    )
    result = run(spec)

    assert result["outcome"] == "completed" and result["steps"] == 4
    assert_each_group_once(result["trace"]["consumed"], result["trace"]["dropped"], result["trace"]["leftover"])
    assert [e["step"] for e in result["eval"]][-1] == 4  # the final evaluation always runs
    steps, _ = read_jsonl(tmp_path / "async" / "metrics.jsonl")
    trained = [s for s in steps if "staleness/max" in s]  # the evaluations are lines of their own
    assert len(trained) == 4 and all(s["staleness/max"] <= 1 for s in trained)
    policy = load_file(tmp_path / "async" / CHECKPOINT_DIR / "step-00000004" / HF_DIR / "model.safetensors")
    assert policy and all(torch.isfinite(t).all() for t in policy.values())


@pytest.mark.slow
def test_a_rollback_of_an_fsdp_run_continues_as_a_resume_from_that_checkpoint(tmp_path):
    sections = {"pipeline": {"steps": 4}, "checkpoint": {"interval": 1, "keep_last": 10}}
    spec = _spec(tmp_path, "rb", "fsdp", **sections)
    target = tmp_path / "rb" / CHECKPOINT_DIR / "step-00000002"
    result, control, _ = _run(spec, {3: [Directive(1, "rollback", {"path": str(target), "step": 2})]})
    fresh, _, _ = _run(_spec(tmp_path, "fresh", "fsdp", **sections), {}, resume=target)

    assert [(r.ok, r.message) for r in control.results] == [(True, "restored step 2")]
    assert result["outcome"] == fresh["outcome"] == "completed"
    final = f"{CHECKPOINT_DIR}/step-00000004/{HF_DIR}/model.safetensors"
    ours, theirs = load_file(tmp_path / "rb" / final), load_file(tmp_path / "fresh" / final)
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name
