"""What device telemetry costs a run: samples/s of a short built-in sync run with telemetry on vs off.

Each round runs the same tiny-qwen2 spec (one thread, same seed) with ``metrics.telemetry_interval_s`` 0 (off),
5 (the default) and 0.1 (fifty times denser than the default), in an order rotated per round (off on 5 dense,
on 5 dense off, ...), so drift on the machine falls on every variant alike. A run's figure is its samples over
the summed ``time/step`` of every step but the first (model build and warm-up are left out); the result is
each variant's median over rounds, and its ratio to off. The check: telemetry at its default period no more than
2% slower than off (``within_2pct``: ratio >= 0.98; a faster variant is the machine's noise, which on a shared
2-core VM is a few percent either way); ``dense_within_2pct`` says the same of the 0.1 s period, a stress case. Beside it, the direct cost: the median time of one sample (``Telemetry.sample`` with this
run's samplers, the GIL held throughout) and that time as a share of the sampling period, an upper bound on what
the sampling thread takes from the run.

    .venv/bin/python bench/telemetry.py --quick     # 7 rounds of 16 steps, under a minute
    .venv/bin/python bench/telemetry.py             # 15 rounds of 40 steps

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from harness import interleaved  # noqa: E402

from runtime.pipeline import run  # noqa: E402
from runtime.spec import load_spec  # noqa: E402
from runtime.telemetry import Telemetry, samplers_for  # noqa: E402

VARIANTS = {"off": 0.0, "default_5s": 5.0, "dense_0.1s": 0.1}
SPEC: dict[str, Any] = {
    "seed": 3,
    "model": {"builtin": "tiny-qwen2"},
    "task": {"name": "reverse", "min_len": 2, "max_len": 6, "train_size": 512, "eval_size": 8},
    "algorithm": {"name": "grpo", "group_size": 4},
    "rollout": {"max_new_tokens": 8, "max_batch_size": 32},
    "pipeline": {"mode": "sync", "prompts_per_step": 8, "eval_interval": 0},
    "resources": {"threads_per_process": 1},
    "checkpoint": {"interval": 0},
    "metrics": {"progress_bar": False, "jsonl": False},
}


class Steps:
    """A reporter keeping each training step's time/step and sample count."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, bool]] = []  # (seconds, samples, device metrics in it)

    def report(self, step: int, metrics: dict) -> None:
        if "time/step" in metrics:
            samples = metrics["throughput/samples_per_s"] * metrics["time/step"]
            device = any(k.startswith("device/") for k in metrics)
            self.steps.append((metrics["time/step"], samples, device))

    def event(self, kind: str, payload: dict) -> None:
        pass

    def close(self) -> None:
        pass


def one_run(interval: float, steps: int, out: Path) -> tuple[float, int]:
    data = json.loads(json.dumps(SPEC))
    data["name"] = f"tel-{interval}"
    data["output_dir"] = str(out / f"tel-{interval}-{time.monotonic_ns()}")
    data["pipeline"]["steps"] = steps
    data["metrics"]["telemetry_interval_s"] = interval
    keep = Steps()
    run(load_spec(data), reporters=keep)
    timed = keep.steps[1:]
    seconds = sum(s for s, _, _ in timed)
    samples = sum(n for _, n, _ in timed)
    return samples / seconds, sum(d for _, _, d in keep.steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="7 rounds of 16 steps (under a minute)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    rounds = args.rounds or (7 if args.quick else 15)
    steps = args.steps or (16 if args.quick else 40)
    torch.set_num_threads(1)
    names = list(VARIANTS)
    started = time.perf_counter()

    def progress(r: int, runs: dict[str, list[tuple[float, int]]]) -> None:
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {runs[n][-1][0]:.1f}" for n in names), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        one_run(0.0, 2, Path(tmp))  # warm-up: imports, allocator
        runs = interleaved(names, rounds, lambda name, _r: one_run(VARIANTS[name], steps, Path(tmp)), progress)
    rates = {n: [rate for rate, _ in runs[n]] for n in names}
    sampled = {n: [with_device for _, with_device in runs[n]] for n in names}
    telemetry = Telemetry("trainer-0", samplers_for("cpu"), 5.0)
    costs = []
    for _ in range(200):
        t0 = time.perf_counter()
        telemetry.sample()
        costs.append(time.perf_counter() - t0)
    sample_s = statistics.median(costs)
    median = {n: statistics.median(rates[n]) for n in names}
    ratio = {n: median[n] / median["off"] for n in names}
    result = {
        "bench": "telemetry",
        "rounds": rounds,
        "steps_per_run": steps,
        "samples_per_s_median": {n: round(v, 2) for n, v in median.items()},
        "ratio_to_off": {n: round(v, 4) for n, v in ratio.items()},
        "steps_with_device_metrics_median": {n: statistics.median(v) for n, v in sampled.items()},
        "within_2pct": ratio["default_5s"] >= 0.98,
        "dense_within_2pct": ratio["dense_0.1s"] >= 0.98,
        "sample_us_median": round(sample_s * 1e6, 1),
        "sample_share_of_period": {n: round(sample_s / v, 7) for n, v in VARIANTS.items() if v > 0},
        "wall_s": round(time.perf_counter() - started, 1),
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
