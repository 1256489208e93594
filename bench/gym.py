"""The gym workload: env steps/s of async sampling workers vs the sync loop, and CartPole learning to target.

    .venv/bin/python bench/gym.py [--quick] [--workers 2]

What it does, in this process (torch at one thread per process, as a cluster pins its processes):
1. *throughput*: the same CartPole-v1 PPO spec (4 envs x 128 steps per segment, 2 segments per step) run
   in ``sync`` mode and in ``async`` mode with ``--workers`` sampling worker processes (lag bound 1,
   throttle), interleaved (sync, async, sync, async): env steps trained on per second of step time in
   the steady state (the steps after the first ``WARM_UP``: the async mode's first step waits for its
   worker processes to start), and per second of wall time, start-up included;
2. *learning*: PPO (async, the example's settings) and DQN (sync) on CartPole-v1 until the evaluation
   agent's mean greedy return over 10 episodes reaches 475 (of 500), or 500,000 env steps: the env
   steps and wall time it took (``--quick``: PPO only, within 100,000 env steps).

Targets (issue 16): async >= 1.6x sync env steps/s; PPO and DQN >= 475 within 500,000 env steps.
Prints human-readable figures; the LAST line is one JSON object of them all.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import loadavg  # noqa: E402

from runtime.contract import ENV_STEPS, EVAL_RETURN_MEAN  # noqa: E402
from runtime.pipeline import run  # noqa: E402
from runtime.spec import load_spec  # noqa: E402

TARGET_RETURN = 475.0
WARM_UP = 3  # steps left out of the steady-state figure


def _spec(out: Path, name: str, mode: str, steps: int, workers: int, agent: dict | None = None, **extra: Any):
    data: dict[str, Any] = {
        "name": name,
        "seed": 0,
        "workload": "gym",
        "output_dir": str(out / name),
        "env": {"id": "CartPole-v1", "num_envs": 4, "segment_length": 128, "segments_per_step": 2},
        "agent": agent or {"algorithm": "ppo", "minibatches": 8},
        "pipeline": {"mode": mode, "steps": steps, "eval_interval": 0},
        "checkpoint": {"interval": 0},
        "metrics": {"progress_bar": False, "jsonl": False},
    }
    if mode == "async":
        data["pipeline"].update(max_policy_lag=1, on_lag_exceeded="throttle")
        data["resources"] = {"rollout_workers": workers}
    for section, values in extra.items():
        data[section] = {**data.get(section, {}), **values}
    return load_spec(data)


class _Recorder:
    """A reporter that keeps every step's metrics and the evaluations (the benchmark reads them)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.evals: list[tuple[int, float, float]] = []  # (step, return, wall s since start)
        self.env_steps = 0.0
        self.started = time.perf_counter()

    def report(self, step: int, metrics: Any) -> None:
        if EVAL_RETURN_MEAN in metrics:
            self.evals.append((step, float(metrics[EVAL_RETURN_MEAN]), time.perf_counter() - self.started))
        else:
            self.steps.append(dict(metrics))
            self.env_steps = float(metrics.get(ENV_STEPS, self.env_steps))

    def event(self, kind: str, payload: Any) -> None:
        pass

    def close(self) -> None:
        pass


def throughput(out: Path, mode: str, steps: int, workers: int) -> dict[str, float]:
    rec = _Recorder()
    started = time.perf_counter()
    run(_spec(out, f"tp-{mode}", mode, steps, workers), reporters=rec)
    wall = time.perf_counter() - started
    steady = rec.steps[WARM_UP:]
    steady_env_steps = steady[-1][ENV_STEPS] - rec.steps[WARM_UP - 1][ENV_STEPS]
    return {
        "env_steps": rec.env_steps,
        "env_steps_per_s": round(steady_env_steps / sum(m["time/step"] for m in steady), 1),
        "env_steps_per_wall_s": round(rec.env_steps / wall, 1),
        "wall_s": round(wall, 2),
    }


def learn(out: Path, algorithm: str, mode: str, budget: int, workers: int) -> dict[str, Any]:
    """Train until the evaluation return reaches the target or ``budget`` env steps; what it took."""
    if algorithm == "ppo":
        spec = _spec(out, "learn-ppo", mode, 10_000, workers, pipeline={"eval_interval": 5})
    else:  # the example's DQN settings: 64 env steps per training step
        env = {"segment_length": 16, "segments_per_step": 1}
        spec = _spec(
            out, "learn-dqn", mode, 10_000, workers, {"algorithm": "dqn"}, env=env, pipeline={"eval_interval": 80}
        )
    rec = _Recorder()

    def stop(step: int, metrics: dict[str, float]) -> bool:
        reached = bool(rec.evals) and rec.evals[-1][1] >= TARGET_RETURN
        return reached or float(metrics.get(ENV_STEPS, 0.0)) >= budget

    started = time.perf_counter()
    run(spec, reporters=rec, stop=stop)
    wall = time.perf_counter() - started
    hit = next(((s, r, t) for s, r, t in rec.evals if r >= TARGET_RETURN), None)
    per_step = spec.env.num_envs * spec.env.segment_length * spec.env.segments_per_step
    return {
        "algorithm": algorithm,
        "mode": mode,
        "reached": hit is not None,
        "env_steps": hit[0] * per_step if hit else rec.env_steps,
        "eval_return": hit[1] if hit else (rec.evals[-1][1] if rec.evals else None),
        "wall_s_to_target": round(hit[2], 1) if hit else None,
        "wall_s": round(wall, 1),
        "budget_env_steps": budget,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short throughput runs, PPO learning only")
    parser.add_argument("--workers", type=int, default=2, help="sampling worker processes in async mode")
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = 10 if args.quick else 40
    figures: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared with other work: figures are indicative)",
        "quick": args.quick,
        "loadavg_start": loadavg(),
        "throughput": [],
    }
    print(f"load average at start: {figures['loadavg_start']} (1/5/15 min, {os.cpu_count()} cores)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for _ in range(1 if args.quick else 2):  # interleaved: the machine's drift hits both modes alike
            for mode in ("sync", "async"):
                row = {"mode": mode, **throughput(out, mode, steps, args.workers)}
                figures["throughput"].append(row)
                print(
                    f"{mode:>5}: {row['env_steps_per_s']:>8} env steps/s of step time (steady), "
                    f"{row['env_steps_per_wall_s']:>8} per wall s ({row['env_steps']:.0f} env steps, {row['wall_s']} s)"
                )

        def mean(mode: str, key: str) -> float:
            rows = [r[key] for r in figures["throughput"] if r["mode"] == mode]
            return sum(rows) / len(rows)

        figures["async_vs_sync_env_steps_per_s"] = round(
            mean("async", "env_steps_per_s") / mean("sync", "env_steps_per_s"), 2
        )
        figures["async_vs_sync_wall"] = round(
            mean("async", "env_steps_per_wall_s") / mean("sync", "env_steps_per_wall_s"), 2
        )
        print(
            f"async ({args.workers} workers) vs sync: {figures['async_vs_sync_env_steps_per_s']}x env steps/s "
            f"(steady step time), {figures['async_vs_sync_wall']}x per wall second (start-up included)"
        )
        runs = [("ppo", "async", 100_000 if args.quick else 500_000)]
        if not args.quick:
            runs.append(("dqn", "sync", 500_000))
        figures["learning"] = []
        for algorithm, mode, budget in runs:
            row = learn(out, algorithm, mode, budget, args.workers)
            figures["learning"].append(row)
            print(
                f"{algorithm} ({mode}): {'reached' if row['reached'] else 'did NOT reach'} {TARGET_RETURN:g} "
                f"(eval return {row['eval_return']}) at {row['env_steps']:.0f} env steps, "
                f"{row['wall_s_to_target']} s (run {row['wall_s']} s)"
            )
    figures["targets"] = {
        "async_at_least_1.6x_sync": figures["async_vs_sync_env_steps_per_s"] >= 1.6,
        **{f"{r['algorithm']}_reaches_475_within_budget": r["reached"] for r in figures["learning"]},
    }
    figures["loadavg_end"] = loadavg()
    print(f"targets: {figures['targets']}")
    print(f"load average at end: {figures['loadavg_end']}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
