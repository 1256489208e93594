"""bench/accelerator_smoke.py: on CPU it runs every part it can, passes them, and names the rest as skipped
with a reason; what it would run on one or two accelerators is checked without one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import accelerator_smoke as smoke
from runtime.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
CPU_PARTS = {"discovery", "collectives", "fsdp_step", "builtin_engine", "grpo_sync", "grpo_async", "grpo_colocated"}


@pytest.fixture(scope="module")
def quick_report() -> dict:
    # A budget above the default so a loaded shared machine slows the parts down instead of skipping them.
    proc = subprocess.run(
        [sys.executable, "bench/accelerator_smoke.py", "--quick", "--device", "cpu", "--budget-s", "600"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=700,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_quick_on_cpu_names_every_part_with_its_status(quick_report):
    assert set(quick_report["parts"]) == set(smoke.PARTS)
    for name, part in quick_report["parts"].items():
        assert part["status"] in ("passed", "failed", "skipped"), name
        assert part["status"] == "passed" or part["reason"], name
    summary = quick_report["summary"]
    assert sorted(summary["passed"] + summary["failed"] + summary["skipped"]) == sorted(smoke.PARTS)


def test_quick_on_cpu_runs_and_passes_the_cpu_parts(quick_report):
    assert quick_report["device"] == "cpu"
    assert set(quick_report["summary"]["passed"]) == CPU_PARTS
    assert quick_report["summary"]["failed"] == []
    assert quick_report["summary"]["skipped"] == ["vllm"]
    assert "cpu" in quick_report["parts"]["vllm"]["reason"]


def test_quick_on_cpu_reports_what_each_part_measured(quick_report):
    parts = quick_report["parts"]
    assert parts["collectives"]["pair_backend"] == "gloo"
    assert parts["collectives"]["all_reduce_correct"] and parts["collectives"]["broadcast_same_weights"]
    assert parts["fsdp_step"]["master_param_dtypes"] == ["float32"]
    assert parts["fsdp_step"]["losses"][-1] < parts["fsdp_step"]["losses"][0]
    assert parts["builtin_engine"]["logprob_gap"]["mean"] < 1e-3
    for mode in ("sync", "async", "colocated"):
        run = parts[f"grpo_{mode}"]
        assert run["mode"] == mode and run["steps"] == smoke.GRPO_STEPS["quick"]
        assert run["final"]["weights/version"] >= 1


def test_a_part_that_fails_is_reported_and_the_others_still_run(tmp_path):
    # cuda asked for on a machine without it: every device part fails on its own, the rest still report.
    report = smoke.run_smoke("cuda", quick=True, names=["discovery", "builtin_engine", "vllm"], budget_s=120)
    assert report["parts"]["discovery"]["status"] == "failed"
    assert "cuda" in report["parts"]["discovery"]["reason"]
    assert report["parts"]["builtin_engine"]["status"] == "failed"
    assert report["parts"]["vllm"]["status"] in ("skipped", "failed")


@pytest.mark.parametrize(
    ("kind", "count", "expected"),
    [
        ("cpu", 1, ("gloo", "cpu", [0, 0])),
        ("cuda", 2, ("nccl", "cuda", [0, 1])),
        ("npu", 8, ("hccl", "npu", [0, 1])),
        ("cuda", 1, ("gloo", "cuda", [0, 0])),  # NCCL refuses two ranks on one GPU
        ("npu", 1, ("gloo", "cpu", [0, 0])),  # ... and gloo cannot read NPU tensors
    ],
)
def test_the_collective_pair_uses_the_native_backend_only_across_two_devices(kind, count, expected):
    assert smoke.pair_plan(kind, count) == expected


@pytest.mark.parametrize("mode", ["sync", "async", "colocated"])
def test_the_grpo_runs_on_two_gpus_are_valid_specs(mode, tmp_path):
    ctx = smoke.Context(kind="cuda", count=2, quick=False, workdir=tmp_path)
    spec = load_spec(ROOT / f"examples/grpo-{mode}.yaml", smoke.grpo_overrides(ctx, mode, tmp_path / "out"))
    assert spec.resources.device == "cuda"
    assert spec.pipeline.steps == smoke.GRPO_STEPS["full"] == 30
    assert spec.resources.rollout_devices == (1 if mode == "async" else 0)


def test_async_on_one_accelerator_shares_the_trainers_device(tmp_path):
    ctx = smoke.Context(kind="cuda", count=1, quick=True, workdir=tmp_path)
    spec = load_spec(ROOT / "examples/grpo-async.yaml", smoke.grpo_overrides(ctx, "async", tmp_path / "out"))
    assert spec.resources.device == "cuda" and spec.resources.rollout_devices == 0
