"""Mixed precision learns like float32: GRPO learning curves with ``trainer.mixed_precision`` off and bf16.

One SFT warm start (as ``bench/learning_curve.py``), then GRPO runs of the same number of *steps* (not
the same wall-clock time: the question is what a step learns, not how fast it runs) in sync mode, once
with float32 training and once with bf16 compute on float32 master weights, for each seed, interleaved.
Greedy held-out accuracy every ``--eval-interval`` steps (the curves), and held-out greedy and sampled
accuracy of each final model scored by the same evaluator, with the binomial standard error of each.
On this CPU bf16 is emulated and slower; the step-time ratio is printed for the record, not as a target.

Usage::

    .venv/bin/python bench/mixed_precision.py --quick       # under a minute
    .venv/bin/python bench/mixed_precision.py               # the recorded figure

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from learning_curve import heldout, spec_data  # noqa: E402

from runtime.pipeline import run  # noqa: E402
from runtime.spec import load_spec  # noqa: E402
from runtime.train.sft import run_sft  # noqa: E402

PRECISIONS = ("off", "bf16")


def curve_args(args: argparse.Namespace, seed: int) -> argparse.Namespace:
    """The learning-curve settings of one run (bench/learning_curve.py's spec, sync mode)."""
    return argparse.Namespace(
        mode="sync",
        task=args.task,
        seed=seed,
        group_size=8,
        entropy_coef=0.0,
        clip_high=None,
        lr=args.lr,
        temperature=1.0,
        eval_size=args.eval_size,
        eval_interval=args.eval_interval,
    )


def standard_error(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 0.0) / max(n, 1))


def one_run(args: argparse.Namespace, seed: int, precision: str, out: Path, model_dir: Path) -> dict:
    data = spec_data(curve_args(args, seed), out / f"{precision}-{seed}", model_dir)
    data["name"] = f"mp-{precision}-{seed}"
    data["trainer"]["mixed_precision"] = precision
    data["pipeline"]["steps"] = args.steps
    started = time.perf_counter()
    result = run(load_spec(data))
    seconds = time.perf_counter() - started
    after = heldout(data, Path(result["checkpoint"]) / "policy")
    return {
        "precision": precision,
        "seed": seed,
        "steps": result["steps"],
        "seconds": seconds,
        "after": after,
        "curve": [(e["step"], round(e["eval/accuracy"], 4)) for e in result["eval"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="under a minute: one seed, few steps")
    parser.add_argument("--steps", type=int, default=150, help="GRPO steps of every run")
    parser.add_argument("--seeds", type=int, default=2, help="runs per precision")
    parser.add_argument("--task", default="reverse")
    parser.add_argument("--sft-steps", type=int, default=35)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--eval-size", type=int, default=256)
    parser.add_argument("--eval-interval", type=int, default=25)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.seeds, args.eval_size, args.eval_interval = 12, 1, 64, 6
    torch.set_num_threads(1)

    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-mp-") as tmp:
        out = Path(tmp)
        model_dir = out / "sft"
        run_sft(load_spec(spec_data(curve_args(args, 0), out, None)), args.sft_steps, model_dir)
        before = heldout(spec_data(curve_args(args, 0), out, model_dir), model_dir)
        for seed in range(args.seeds):
            for precision in PRECISIONS:  # interleaved: the machine's drift hits both alike
                runs.append(one_run(args, seed, precision, out, model_dir))
                r = runs[-1]
                print(
                    f"{precision:>4} seed {seed}: {r['steps']} steps in {r['seconds']:.0f}s, held-out greedy "
                    f"{r['after']['greedy']:.3f}, sampled {r['after']['sampled']:.3f}"
                )

    summary: dict[str, dict] = {}
    for precision in PRECISIONS:
        mine = [r for r in runs if r["precision"] == precision]
        greedy = sum(r["after"]["greedy"] for r in mine) / len(mine)
        sampled = sum(r["after"]["sampled"] for r in mine) / len(mine)
        summary[precision] = {
            "greedy": greedy,
            "greedy_se": standard_error(greedy, args.eval_size * len(mine)),
            "sampled": sampled,
            "sampled_se": standard_error(sampled, 4 * args.eval_size * len(mine)),  # 4 samples per prompt
            "seconds": sum(r["seconds"] for r in mine),
        }
    gap = summary["bf16"]["greedy"] - summary["off"]["greedy"]
    noise = math.hypot(summary["bf16"]["greedy_se"], summary["off"]["greedy_se"])
    print(f"held-out greedy before GRPO: {before['greedy']:.3f}")
    print(f"bf16 - fp32 held-out greedy: {gap:+.3f} (standard error of the difference {noise:.3f})")
    print(
        json.dumps(
            {
                "task": args.task,
                "steps": args.steps,
                "seeds": args.seeds,
                "before": before,
                "fp32": summary["off"],
                "bf16": summary["bf16"],
                "greedy_gap": gap,
                "greedy_gap_se": noise,
                "within_two_se": abs(gap) <= 2 * noise,
                "step_time_ratio_bf16_over_fp32": summary["bf16"]["seconds"] / summary["off"]["seconds"],
                "runs": runs,
            }
        )
    )


if __name__ == "__main__":
    main()
