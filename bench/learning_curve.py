"""A learning curve: GRPO from an SFT warm start on a built-in task, for a fixed wall-clock budget.

1. SFT warm start (``--sft-steps``), deliberately short so the policy sometimes succeeds.
2. GRPO in ``--mode`` (default async) until ``--minutes`` of wall-clock time are spent
   (the pipeline's ``stop`` hook ends the run as if that step were the last), with greedy
   held-out evaluation every ``--eval-interval`` steps (the curve).
3. Held-out accuracy before and after, greedy and sampled (temperature 1, 4 per prompt).

Usage::

    .venv/bin/python bench/learning_curve.py --quick        # about a minute
    .venv/bin/python bench/learning_curve.py --minutes 10   # the recorded figure

The last line printed is one JSON object with every figure. Target: +15 points or more.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.evaluation.evaluator import evaluate  # noqa: E402
from runtime.models import build_policy  # noqa: E402
from runtime.pipeline import run  # noqa: E402
from runtime.spec import load_spec  # noqa: E402
from runtime.train.sft import run_sft  # noqa: E402
from runtime.workloads.llm import build_engine, build_task  # noqa: E402


def spec_data(args: argparse.Namespace, out: Path, model_dir: Path | None) -> dict:
    model = {"path": str(model_dir), "builtin": None} if model_dir else {"builtin": "tiny-qwen2"}
    return {
        "name": f"curve-{args.mode}",
        "seed": args.seed,
        "output_dir": str(out / "{name}"),
        "model": model,
        "task": {"name": args.task, "min_len": 1, "max_len": 6, "train_size": 8192, "eval_size": args.eval_size},
        "algorithm": {
            "name": "grpo",
            "group_size": args.group_size,
            "entropy_coef": args.entropy_coef,
            "clip_eps_high": args.clip_high,
        },
        "trainer": {"lr": args.lr},
        "rollout": {"max_new_tokens": 12, "temperature": args.temperature},
        "pipeline": {
            "mode": args.mode,
            "steps": 1_000_000,
            "prompts_per_step": 16,
            "eval_interval": args.eval_interval,
            "max_policy_lag": 1,
        },
        "checkpoint": {"interval": 0, "keep_last": 1},
        "metrics": {"progress_bar": False},
    }


def heldout(data: dict, model_dir: Path) -> dict[str, float]:
    data = json.loads(json.dumps(data))
    data["model"] = {"path": str(model_dir), "builtin": None}
    spec = load_spec(data)
    model, tok = build_policy(spec.model, "cpu")
    model.eval()
    task = build_task(spec)
    engine = build_engine(model, tok, torch.device("cpu"), spec)
    prompts, n_tok = task.eval_prompts(), spec.rollout.max_new_tokens
    greedy = evaluate(engine, tok, task, prompts, n_tok, 64)["eval/accuracy"]
    sampled = evaluate(engine, tok, task, prompts, n_tok, 64, temperature=1.0, n=4, seed=7)["eval/accuracy"]
    return {"greedy": greedy, "sampled": sampled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="about a minute in all")
    parser.add_argument("--minutes", type=float, default=10.0, help="wall-clock budget of the GRPO run")
    parser.add_argument("--mode", choices=("sync", "async", "colocated"), default="async")
    parser.add_argument("--task", default="reverse")
    parser.add_argument("--sft-steps", type=int, default=35)
    parser.add_argument(
        "--lr", type=float, default=1e-4, help="trainer.lr (5e-4 collapses the policy within ~100 steps)"
    )
    parser.add_argument("--group-size", type=int, default=8, help="algorithm.group_size")
    parser.add_argument("--temperature", type=float, default=1.0, help="rollout.temperature of the GRPO run")
    parser.add_argument("--entropy-coef", type=float, default=0.0, help="algorithm.entropy_coef")
    parser.add_argument("--clip-high", type=float, default=None, help="algorithm.clip_eps_high (clip-higher)")
    parser.add_argument("--eval-size", type=int, default=256)
    parser.add_argument("--eval-interval", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.minutes, args.eval_size, args.eval_interval = 0.5, 128, 10
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(prefix="bench-curve-") as tmp:
        out = Path(tmp)
        model_dir = out / "sft"
        started = time.perf_counter()
        run_sft(load_spec(spec_data(args, out, None)), args.sft_steps, model_dir)
        sft_s = time.perf_counter() - started
        data = spec_data(args, out, model_dir)
        before = heldout(data, model_dir)

        budget = args.minutes * 60.0
        t0 = time.perf_counter()
        result = run(load_spec(data), stop=lambda step, metrics: time.perf_counter() - t0 >= budget)
        rl_s = time.perf_counter() - t0
        after = heldout(data, Path(result["checkpoint"]) / "policy")

    curve = [(e["step"], round(e["eval/accuracy"], 4)) for e in result["eval"]]
    print(f"SFT warm start: {args.sft_steps} steps in {sft_s:.0f}s")
    print(f"GRPO ({args.mode}): {result['steps']} steps in {rl_s:.0f}s (budget {budget:.0f}s)")
    print("greedy held-out accuracy by step: " + ", ".join(f"{s}: {a:.3f}" for s, a in curve))
    for kind in ("greedy", "sampled"):
        delta = 100 * (after[kind] - before[kind])
        print(f"held-out accuracy ({kind}): {before[kind]:.3f} -> {after[kind]:.3f} ({delta:+.1f} points)")
    print(
        json.dumps(
            {
                "mode": args.mode,
                "task": args.task,
                "budget_s": budget,
                "rl_seconds": rl_s,
                "steps": result["steps"],
                "sft_steps": args.sft_steps,
                "before": before,
                "after": after,
                "delta_points_greedy": 100 * (after["greedy"] - before["greedy"]),
                "delta_points_sampled": 100 * (after["sampled"] - before["sampled"]),
                "curve": curve,
            }
        )
    )


if __name__ == "__main__":
    main()
