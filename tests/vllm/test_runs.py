"""Every LLM mode through the real vLLM (0.30, CPU build), each an end-to-end ``python -m runtime run``: sync
(learning), async (a rollout process on vLLM, the staleness bound, the evaluator), colocated (no sleep mode on
CPU), a remote rollout instance, ``python -m runtime eval``, and the bad input refused before any work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from runtime.metrics import read_jsonl
from tests.vllm.helpers import vllm_spec

ROOT = Path(__file__).resolve().parents[2]
GAP = 1e-3  # engine vs trainer log-probs of the same tokens, fp32 on both sides


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "runtime", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def write(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run(tmp_path: Path, data: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """The run through the command line; its step and eval records (metrics.jsonl)."""
    done = cli("run", str(write(tmp_path, data)))
    assert done.returncode == 0, done.stderr[-4000:]
    records, _ = read_jsonl(Path(data["output_dir"]) / "metrics.jsonl")
    steps = [r for r in records if "reward/mean" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    return steps, evals


def assert_weights_landed(steps: list[dict]) -> None:
    """Every step's fresh samples were scored by vLLM as the trainer scores them: the published weights arrived."""
    gaps = [r["consistency/logprob_diff_max"] for r in steps if "consistency/logprob_diff_max" in r]
    assert gaps and max(gaps) < GAP, gaps


def test_a_sync_run_learns_on_vllm_and_its_weights_land_every_step(tmp_path, sft_model):
    data = vllm_spec(
        tmp_path, "sync", sft_model, pipeline={"steps": 40, "prompts_per_step": 16}, algorithm={"group_size": 8}
    )
    steps, _ = run(tmp_path, data)
    assert [r["weights/version"] for r in steps] == list(range(1, 41))
    assert len(steps) == sum(1 for r in steps if "consistency/logprob_diff_max" in r)  # every step: fresh samples
    assert_weights_landed(steps)
    rewards = [r["reward/mean"] for r in steps]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.1, rewards  # measured here: 0.22 -> 0.46 (the built-in engine: 0.28 -> 0.45)
    resolved = yaml.safe_load((tmp_path / "sync" / "resolved_spec.yaml").read_text())
    assert resolved["rollout"]["engine"] == "vllm" and "gpu_memory_utilization" not in resolved["rollout"]
    # python -m runtime eval on the checkpoint, through vLLM and through the built-in engine: the same greedy answers
    checkpoint = tmp_path / "sync" / "checkpoints" / "step-00000040"
    by_engine = {}
    for engine in ("vllm", "builtin"):
        extra = ["rollout.kv_cache_gib=null"] if engine == "builtin" else []  # a vLLM knob: refused with builtin
        done = cli("eval", "--checkpoint", str(checkpoint), f"rollout.engine={engine}", *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        by_engine[engine] = json.loads(done.stdout.strip().splitlines()[-1])
    assert by_engine["vllm"]["eval/accuracy"] == by_engine["builtin"]["eval/accuracy"]


def test_an_async_run_on_a_vllm_rollout_process_keeps_its_staleness_bound_and_evaluates(tmp_path, sft_model):
    data = vllm_spec(
        tmp_path, "async", sft_model, pipeline={"mode": "async", "steps": 12, "max_policy_lag": 1, "eval_interval": 6}
    )
    steps, evals = run(tmp_path, data)
    assert [r["weights/version"] for r in steps] == list(range(1, 13))
    assert max(r["staleness/max"] for r in steps) <= 1
    assert_weights_landed(steps)
    assert [r["step"] for r in evals] == [0, 6, 12] and all(0 <= r["eval/accuracy"] <= 1 for r in evals)
    assert all(r["rollout/active_instances"] == 1 for r in steps)


def test_a_colocated_run_shares_the_host_with_vllm_without_sleep_mode(tmp_path, sft_model):
    steps, _ = run(tmp_path, vllm_spec(tmp_path, "colocated", sft_model, pipeline={"mode": "colocated", "steps": 3}))
    assert [r["weights/version"] for r in steps] == [1, 2, 3]
    assert_weights_landed(steps)


def test_a_remote_rollout_instance_on_vllm_feeds_the_trainer(tmp_path, sft_model):
    data = vllm_spec(
        tmp_path,
        "remote",
        sft_model,
        pipeline={"mode": "async", "steps": 4},
        resources={"rollout_workers": 0, "remote_rollout_workers": 1},
    )
    spec = write(tmp_path, data)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = (tmp_path / "remote.log").open("wb")
    remote = subprocess.Popen(
        [sys.executable, "-m", "runtime", "rollout", str(spec), "--index", "0"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        steps, _ = run(tmp_path, data)
        assert remote.wait(timeout=120) == 0  # told the run ended
    finally:
        remote.kill()
    assert [r["weights/version"] for r in steps] == [1, 2, 3, 4]
    assert sum(r["rollout/instance/0/busy_s"] for r in steps) > 0  # it generated
    assert_weights_landed(steps)


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ("model.path={base16}", "model.path: {base16} has head_dim 16"),
        ("rollout.kv_cache_gib=60000", "rollout.kv_cache_gib: a KV cache of 60000.00 GiB is more than"),
        ("rollout.gpu_memory_utilization=0.3", "rollout.gpu_memory_utilization: acts only with rollout.engine vllm"),
    ],
)
def test_what_vllm_cannot_serve_exits_2_before_any_work(tmp_path, sft_model, override, error):
    base16 = tmp_path / "m16"  # make-model's default preset: 4 heads of 16, which vLLM's CPU attention refuses
    assert cli("make-model", str(base16), "--from-task", "reverse").returncode == 0
    data = vllm_spec(tmp_path, "bad", sft_model)
    done = cli("run", str(write(tmp_path, data)), override.format(base16=base16))
    assert done.returncode == 2
    assert error.format(base16=base16) in done.stderr
    assert not (tmp_path / "bad").exists()
