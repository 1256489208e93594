"""The same GRPO spec in lock-step, ``async`` and ``colocated`` modes, side by side in one run.

Four runs, interleaved in rounds (each run's best round counts):

* ``sync-split`` — lock-step on the *disaggregated* placement: one trainer process and one
  rollout process, the cores split evenly between them (on 2 cores one thread each: the CPU
  stand-in for a trainer device and a rollout device). It is ``async`` with
  ``max_policy_lag: 0`` and ``on_lag_exceeded: throttle``: generation of step s+1 waits for the
  weights the trainer publishes after step s, so each side idles while the other works. The
  bench checks it really was lock-step (staleness 0 on every step).
* ``async`` — the same placement, ``max_policy_lag`` 1 (``--lag``): generation overlaps training.
* ``colocated`` — both phases in one process with all the cores, sharing the parameters.
* ``sync`` — lock-step in one process with all the cores (the plain baseline).

Figures are steady-state means over the steps after ``--warmup`` (start-up — spawning the rollout
process, the first queue fill — is reported apart, as wall time):

* samples/s and trained tokens/s, and the speed-up of each run over ``sync-split`` (async vs
  sync on the same devices: the headline) and over ``sync`` (one process, all cores);
* the trainer bubble fraction (time the trainer waits for data / step time);
* the overlap efficiency of ``async``: its steps/s divided by the ideal
  ``1 / max(t_generate, t_train)``, both times measured per step in the ``sync-split`` run;
* the final held-out accuracy of each run (sampled, temperature 1, 4 per prompt), from an SFT
  warm start, so the speed-up is not bought with worse learning.

Learning shapes the workload: from an SFT warm start the runs' answer lengths drift apart (each
run's policy learns its own), so their steps do different work; the table's ``resp`` column shows
it and the bench warns when async's answers differ from sync-split's by more than 5%. With
``--sft-steps 0`` (random initialisation: answers of about ``--max-new-tokens``, rewards near 0, a
policy that barely moves) the work per step is the same in every run — the length-controlled
workload for measuring the speed-up and overlap efficiency; the warm-started run measures accuracy.

The default workload (16 prompts x 8 samples, up to 24 new tokens, strings of 1-6 characters
to reverse) keeps generation and training per step of the same order on 2 cores (t_generate
about 0.5-0.7 x t_train) — the regime where overlapping them matters; ``t_generate`` and
``t_train`` are printed so the balance is visible. The split runs assume each process has a core
to itself: on a machine loaded by other jobs both phases stretch under ``async`` and the gain
shrinks, so quote figures with the load average.

Usage::

    .venv/bin/python bench/pipeline.py --quick
    .venv/bin/python bench/pipeline.py

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.evaluation.evaluator import evaluate  # noqa: E402
from runtime.metrics import read_jsonl  # noqa: E402
from runtime.models import build_policy  # noqa: E402
from runtime.pipeline import run  # noqa: E402
from runtime.pipeline.driver import thread_plan  # noqa: E402
from runtime.spec import load_spec  # noqa: E402
from runtime.workloads.llm import build_engine, build_task  # noqa: E402

# (name, pipeline.mode, extra pipeline fields, placement). "split": one trainer process and one
# rollout process sharing the cores evenly (on 2 cores: one thread each, the CPU stand-in for a
# trainer device and a rollout device); "shared": one process with all the cores.
RUNS = (
    # throttle: generation waits for fresh weights instead of dropping stale samples (an async-only knob)
    (
        "sync-split",
        "async",
        {"max_policy_lag": 0, "on_lag_exceeded": "throttle"},
        "split",
    ),  # lock-step, async placement
    ("async", "async", {"on_lag_exceeded": "throttle"}, "split"),
    ("colocated", "colocated", {}, "shared"),
    ("sync", "sync", {}, "shared"),
)
NAMES = tuple(r[0] for r in RUNS)


def base_spec(args: argparse.Namespace, out: Path, model_dir: Path | None) -> dict:
    model = {"path": str(model_dir), "builtin": None} if model_dir else {"builtin": args.model}
    return {
        "seed": 0,
        "model": model,
        "task": {"name": "reverse", "min_len": 1, "max_len": args.max_len, "train_size": 4096, "eval_size": 128},
        "algorithm": {"name": "grpo", "group_size": args.group_size},
        "trainer": {"lr": 5e-4},
        "rollout": {"max_new_tokens": args.max_new_tokens},
        "pipeline": {
            "steps": args.steps,
            "prompts_per_step": args.prompts,
            "eval_interval": 0,
        },
        "checkpoint": {"interval": 0, "keep_last": 1},
        "metrics": {"progress_bar": False},
        "output_dir": str(out / "{name}"),
    }


def heldout(spec, model_dir: Path) -> float:
    data = spec.resolved()
    data["model"] = {"path": str(model_dir), "builtin": None}
    s = load_spec(data)
    model, tok = build_policy(s.model, "cpu")
    model.eval()
    task = build_task(s)
    engine = build_engine(model, tok, torch.device("cpu"), s)
    r = s.rollout
    return evaluate(engine, tok, task, task.eval_prompts(), r.max_new_tokens, 64, temperature=1.0, n=4, seed=7)[
        "eval/accuracy"
    ]


def measure(name: str, mode: str, pipeline: dict, data: dict, warmup: int, round_: int) -> dict:
    data = json.loads(json.dumps(data))
    data["name"] = f"{name}-{round_}"
    data["pipeline"]["mode"] = mode
    data["pipeline"].update(pipeline)
    spec = load_spec(data)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    result = run(spec)
    wall = time.perf_counter() - started
    load_after = os.getloadavg()[0]
    steps, _ = read_jsonl(Path(result["output_dir"]) / "metrics.jsonl")
    steady = [r for r in steps if "time/step" in r][warmup:]

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in steady)

    step_s = mean("time/step")
    tokens = statistics.fmean(r["response_len/mean"] * spec.samples_per_step for r in steady)
    trainer_threads, rollout_threads = thread_plan(spec)
    return {
        "mode": mode,
        "max_policy_lag": spec.pipeline.max_policy_lag if mode == "async" else None,
        "threads": {"trainer": trainer_threads, "rollout": rollout_threads if mode == "async" else 0},
        "wall_s": wall,
        # 1-minute load average around the run: above the core count, the split runs share cores
        "loadavg_1m": [round(load_before, 2), round(load_after, 2)],
        "steady_steps": len(steady),
        "step_s": step_s,
        "samples_per_s": spec.samples_per_step / step_s,
        "tokens_per_s": tokens / step_s,
        "response_len": statistics.fmean(r["response_len/mean"] for r in steady),
        "t_generate": mean("time/generate"),
        "t_train": mean("time/train"),
        "t_weight_sync": mean("time/weight_sync"),
        "t_wait": mean("time/wait"),
        "bubble": mean("bubble/trainer"),
        "staleness_max": max(r["staleness/max"] for r in steady),
        "dropped_stale": steady[-1]["samples/dropped_stale"],
        "checkpoint": result["checkpoint"],
        "spec": spec,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute on 2 idle cores)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the steady-state means")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--max-len", type=int, default=6, help="task.max_len: longest string to reverse")
    parser.add_argument("--lag", type=int, default=1, help="pipeline.max_policy_lag of the async run")
    parser.add_argument("--model", default="tiny-qwen2")
    parser.add_argument("--sft-steps", type=int, default=35, help="SFT warm start first (0 = random init)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds of the four runs; each run's best round counts"
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.prompts, args.sft_steps, args.rounds = 8, 2, 8, 0, 1
    if args.lag < 1:
        parser.error("--lag: the async run needs max_policy_lag >= 1 (0 is the sync-split run)")
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()  # one bar per model load would bury the figures

    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        out = Path(tmp)
        model_dir = None
        if args.sft_steps:
            from runtime.train.sft import run_sft

            model_dir = out / "sft"
            run_sft(load_spec(base_spec(args, out, None)), args.sft_steps, model_dir)
        data = base_spec(args, out, model_dir)
        # Interleaved rounds, best round per run: on a shared machine other jobs' load comes and
        # goes, and the best round is the least disturbed measurement of each run.
        rounds = [
            # the lag bound acts in async alone (sync and colocated train on what they just generated)
            {
                name: measure(
                    name, mode, {"max_policy_lag": args.lag, **pipe} if mode == "async" else pipe, data, args.warmup, k
                )
                for name, mode, pipe, _ in RUNS
            }
            for k in range(args.rounds)
        ]
        results = {name: max((r[name] for r in rounds), key=lambda m: m["samples_per_s"]) for name in NAMES}
        accuracy_before = heldout(results["sync"]["spec"], model_dir) if model_dir else None
        for r in results.values():
            r["heldout_accuracy"] = heldout(r["spec"], Path(r["checkpoint"]) / "policy") if model_dir else None

    split, shared, asy = results["sync-split"], results["sync"], results["async"]
    if split["staleness_max"] != 0:  # lag 0 + throttle must be lock-step; anything else voids the baseline
        raise SystemExit(f"sync-split was not lock-step: staleness/max {split['staleness_max']}")
    # steps/s if, on the split placement, generation hid entirely behind training (or vice versa)
    ideal = 1.0 / max(split["t_generate"], split["t_train"])
    summary: dict = {
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "samples_per_step": args.prompts * args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "max_policy_lag": args.lag,
        "heldout_accuracy_before": accuracy_before,
        "rounds": args.rounds,
        "samples_per_s_by_round": {name: [round(r[name]["samples_per_s"], 2) for r in rounds] for name in NAMES},
    }
    print(
        f"{'run':10} {'threads':>7} {'samples/s':>10} {'tokens/s':>9} {'vs split':>8} {'vs sync':>7} {'bubble':>7} "
        f"{'t_gen':>6} {'t_train':>7} {'t_sync':>6} {'stale':>5} {'resp':>5} {'acc':>6} {'wall':>6} {'load':>5}"
    )
    for name, r in results.items():
        r["speedup_vs_sync_split"] = r["samples_per_s"] / split["samples_per_s"]
        r["speedup_vs_sync"] = r["samples_per_s"] / shared["samples_per_s"]
        acc = "-" if r["heldout_accuracy"] is None else f"{r['heldout_accuracy']:.3f}"
        t = r["threads"]
        threads = f"{t['trainer']}+{t['rollout']}" if t["rollout"] else str(t["trainer"])
        print(
            f"{name:10} {threads:>7} {r['samples_per_s']:10.1f} {r['tokens_per_s']:9.0f} "
            f"{r['speedup_vs_sync_split']:7.2f}x {r['speedup_vs_sync']:6.2f}x {r['bubble']:7.3f} "
            f"{r['t_generate']:6.3f} {r['t_train']:7.3f} {r['t_weight_sync']:6.3f} {r['staleness_max']:5.0f} "
            f"{r['response_len']:5.1f} {acc:>6} {r['wall_s']:5.0f}s {r['loadavg_1m'][1]:5.2f}"
        )
        summary[name] = {k: v for k, v in r.items() if k not in ("spec", "checkpoint")}
    summary["t_generate_over_t_train"] = split["t_generate"] / split["t_train"]
    summary["async_speedup_same_placement"] = asy["speedup_vs_sync_split"]
    summary["async_speedup_vs_sync_one_process"] = asy["speedup_vs_sync"]
    summary["colocated_speedup_vs_sync_one_process"] = results["colocated"]["speedup_vs_sync"]
    summary["overlap_efficiency"] = (1.0 / asy["step_s"]) / ideal
    summary["async_bubble"] = asy["bubble"]
    print(
        f"balance on the split placement (sync-split): t_generate {split['t_generate']:.3f}s, "
        f"t_train {split['t_train']:.3f}s per step (ratio {summary['t_generate_over_t_train']:.2f})"
    )
    print(
        f"async vs sync on the same placement: {summary['async_speedup_same_placement']:.2f}x; "
        f"vs sync in one process with all cores: {summary['async_speedup_vs_sync_one_process']:.2f}x; "
        f"overlap efficiency {summary['overlap_efficiency']:.2f} "
        f"(ideal {ideal * args.prompts * args.group_size:.1f} samples/s); bubble {summary['async_bubble']:.3f}"
    )
    # The policy shapes its own workload: runs whose answers grew apart did different work per step,
    # and their speed-up and overlap efficiency compare more than scheduling.
    drift = asy["response_len"] / split["response_len"]
    summary["response_len_async_over_split"] = drift
    if abs(drift - 1) > 0.05:
        print(
            f"warning: async answers are {drift:.2f}x as long as sync-split's: the runs did different work per "
            "step; for the scheduling comparison use a length-controlled workload (--sft-steps 0)"
        )
    if accuracy_before is not None:
        print(f"held-out sampled accuracy from the warm start: {accuracy_before:.3f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
