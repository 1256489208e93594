"""Every mode learns: GRPO from an SFT warm start raises held-out accuracy on a built-in task.

Held-out accuracy is measured on the task's evaluation prompts (never trained on) with the
policy as sampled (temperature 1, 4 samples per prompt, fixed seed): RL shifts probability
mass before it changes the greedy mode, so this is where a short run shows. The warm start is
deliberately weak (sampled accuracy ~0.15) to leave room; the margin is several standard
errors of the 512-sample estimate (~0.02).
"""

from __future__ import annotations

import pytest
import torch

from runtime.evaluation.evaluator import evaluate
from runtime.models import build_policy
from runtime.pipeline import run
from runtime.spec import load_spec
from runtime.train.sft import run_sft
from runtime.workloads.llm import build_engine, build_task

MARGIN = 0.08

BASE = {
    "seed": 0,
    "model": {"builtin": "tiny-qwen2"},
    "task": {"name": "reverse", "min_len": 1, "max_len": 6, "train_size": 4096, "eval_size": 128},
    "algorithm": {"name": "grpo", "group_size": 8},
    "trainer": {"lr": 5e-4},
    "rollout": {"max_new_tokens": 12},
    "pipeline": {"steps": 40, "prompts_per_step": 16, "eval_interval": 0, "max_policy_lag": 1},
    "metrics": {"progress_bar": False},
}


def _spec(**sections):
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    for name, values in sections.items():
        if isinstance(values, dict):
            data.setdefault(name, {}).update(values)
        else:
            data[name] = values
    return load_spec(data)


def heldout_accuracy(model_dir) -> float:
    spec = _spec(model={"path": str(model_dir), "builtin": None})
    model, tokenizer = build_policy(spec.model, "cpu")
    model.eval()
    engine = build_engine(model, tokenizer, torch.device("cpu"), spec)
    task = build_task(spec)
    result = evaluate(engine, tokenizer, task, task.eval_prompts(), 12, 64, temperature=1.0, n=4, seed=7)
    return result["eval/accuracy"]


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("sft") / "model"
    run_sft(_spec(resources={"threads_per_process": 1}), 35, out)
    return out, heldout_accuracy(out)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async", "colocated"])
def test_grpo_from_warm_start_raises_heldout_accuracy(warm_start, tmp_path, mode):
    model_dir, before = warm_start
    assert 0.02 < before < 0.6  # a policy that sometimes succeeds
    threads = {"threads_per_process": 1}
    spec = _spec(
        name=f"learn-{mode}",
        output_dir=str(tmp_path / mode),
        model={"path": str(model_dir), "builtin": None},
        pipeline={"mode": mode},
        resources=threads,
    )
    result = run(spec)
    after = heldout_accuracy(result["checkpoint"] + "/policy")
    print(f"{mode}: held-out sampled accuracy {before:.3f} -> {after:.3f}")
    assert after >= before + MARGIN, f"{mode}: held-out accuracy {before:.3f} -> {after:.3f}"
