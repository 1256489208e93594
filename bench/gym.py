"""The gym workload: env steps/s of async sampling workers vs the sync loop, and CartPole learning to target.

    .venv/bin/python bench/gym.py [--quick] [--workers 2]
    .venv/bin/python bench/gym.py --roles [--quick]

What it does, in this process (torch at one thread per process, as a cluster pins its processes):
1. *throughput*: the same CartPole-v1 PPO spec (4 envs x 128 steps per segment, 2 segments per step) run
   in ``sync`` mode and in ``async`` mode with ``--workers`` sampling worker processes (lag bound 1,
   throttle), interleaved (sync, async, sync, async): env steps trained on per second of step time in
   the steady state (the steps after the first ``WARM_UP``: the async mode's first step waits for its
   worker processes to start), and per second of wall time, start-up included;
2. *learning*: PPO (async, the example's settings) and DQN (sync) on CartPole-v1 until the evaluation
   agent's mean greedy return over 10 episodes reaches 475 (of 500), or 500,000 env steps: the env
   steps and wall time it took (``--quick``: PPO only, within 100,000 env steps).

``--roles`` measures the roles' priorities instead, side by side in one run (issue 16):
3. *evaluation*: the async throughput spec with evaluation every step (10 greedy episodes, the
   evaluation agent's process at nice 19, ``runtime.evaluation.process``) vs evaluation off, interleaved:
   the trainer's steady step time and its bubble (``bubble/trainer``, the share of the step it waited for
   samples); and a PPO learner's step alone vs beside a never-ending evaluation agent in a nice-10 thread
   of its process (what the async mode did before: it shares the interpreter lock) vs in a nice-10
   process of its own, quiet and with every core busy;
4. *target sync*: a DQN learner alone (the example's settings: 16 updates per step, a Polyak sync after
   each, on pre-sampled segments) with the sync inline, in the background (the default), and in a
   background thread niced +5, each on a quiet machine and with every core kept busy by spinning
   processes (nice 0, standing in for sampling workers): the step's time and the time its updates
   were held up by syncs (``time/target_sync_wait``), and whether all variants end bit-identical;
5. *weight refresh*: a sampling worker's switch to the newest published weights (the shared-memory
   buffer a local worker reads, ``WeightSubscriber.switch``) vs one learner update, PPO and DQN.

Targets (issue 16): async >= 1.6x sync env steps/s; PPO and DQN >= 475 within 500,000 env steps;
evaluation every step leaves the trainer's step time and bubble where they are without it; a background
target sync holds the update up for ~0 of the inline sync's time.
Prints human-readable figures; the LAST line is one JSON object of them all.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import loadavg  # noqa: E402

from runtime.contract import BUBBLE_TRAINER, ENV_STEPS, EVAL_RETURN_MEAN, TARGET_SYNC_WAIT  # noqa: E402
from runtime.pipeline import run  # noqa: E402
from runtime.spec import load_spec  # noqa: E402
from runtime.weights.service import WeightService, WeightSubscriber  # noqa: E402
from runtime.workloads.gym.build import PolicyEngine  # noqa: E402
from runtime.workloads.gym.envs import describe_spaces, make_env, make_vector_env  # noqa: E402
from runtime.workloads.gym.evaluation import greedy_returns  # noqa: E402
from runtime.workloads.gym.learners import DQNConfig, DQNLearner, PPOConfig, PPOLearner, sampling_policy  # noqa: E402
from runtime.workloads.gym.sampler import FixedPolicy, SegmentSampler  # noqa: E402

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


# ----------------------------------------------------------------------------- the roles (--roles)


def eval_cost(out: Path, steps: int, rounds: int, workers: int) -> list[dict[str, Any]]:
    """The async throughput spec with evaluation off and every step, interleaved: the trainer's steady
    step time and bubble, and the evaluations that finished (the rest were superseded by newer weights)."""
    rows = []
    for r in range(rounds):
        for every in (0, 1):
            rec = _Recorder()
            spec = _spec(out, f"roles-eval{every}-{r}", "async", steps, workers, pipeline={"eval_interval": every})
            run(spec, reporters=rec)
            steady = rec.steps[WARM_UP:]
            rows.append(
                {
                    "eval_interval": every,
                    "step_s": round(statistics.fmean(m["time/step"] for m in steady), 4),
                    "train_s": round(statistics.fmean(m["time/train"] for m in steady), 4),
                    "bubble_trainer": round(statistics.fmean(m[BUBBLE_TRAINER] for m in steady), 4),
                    "evaluations_finished": len(rec.evals),
                    "evaluations_asked": steps + 1 if every else 0,
                }
            )
    return rows


def _greedy_forever(space: Any, cfg: Any, nice: int, stop: Any) -> None:
    """An evaluation agent that never ends: greedy CartPole episodes at ``nice`` until ``stop`` is set."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)
    env, policy = make_env("CartPole-v1"), sampling_policy(space, cfg)
    while not stop.is_set():
        greedy_returns(policy, env, space, 1, seed=0)


def eval_contention(steps: int, rounds: int) -> list[dict[str, Any]]:
    """A PPO learner's step (the throughput spec's) alone, beside an evaluation agent in a nice-10 thread of
    its process (the async mode's before), and beside one in a nice-10 process of its own, on a quiet machine
    and with every core kept busy (nice 0, as sampling workers would): median ms."""
    out = []
    for load in ("quiet", "busy"):
        spinners = _spinners(os.cpu_count() or 1) if load == "busy" else []
        try:
            out += [{"load": load, **row} for row in _eval_contention(steps, rounds)]
        finally:
            for proc in spinners:
                proc.kill()
                proc.wait()
    return out


def _eval_contention(steps: int, rounds: int) -> list[dict[str, Any]]:
    space = describe_spaces(make_env("CartPole-v1"))
    cfg = PPOConfig(minibatches=8)
    segments = _segments(space, cfg, 2, num_envs=4, length=128)
    learner = PPOLearner(space, cfg, seed=0)
    rows: dict[str, list[float]] = {"alone": [], "eval_thread": [], "eval_process": []}
    for _ in range(rounds):
        for where in rows:
            stop: Any = None
            if where == "eval_thread":
                stop = threading.Event()
                agent: Any = threading.Thread(target=_greedy_forever, args=(space, cfg, 10, stop))
            elif where == "eval_process":
                ctx = multiprocessing.get_context("fork")
                stop = ctx.Event()
                agent = ctx.Process(target=_greedy_forever, args=(space, cfg, 10, stop))
            if stop is not None:
                agent.start()
            try:
                times = []
                for i in range(steps):
                    started = time.perf_counter()
                    learner.train_step(segments, i)
                    times.append(time.perf_counter() - started)
                rows[where].append(statistics.median(times) * 1e3)
            finally:
                if stop is not None:
                    stop.set()
                    agent.join()
    return [{"evaluation": where, "step_ms": round(statistics.median(ms), 1)} for where, ms in rows.items()]


def _segments(space: Any, cfg: Any, count: int, num_envs: int, length: int) -> list[Any]:
    """``count`` segments of a fresh (random-weighted) sampling policy, sampled once and reused."""
    make = lambda: make_env("CartPole-v1")  # noqa: E731
    sampler = SegmentSampler(make_vector_env(make, num_envs), space, length, seed=0)
    policy = sampling_policy(space, cfg)
    return [sampler.sample(FixedPolicy(policy, 0), sample_id=i, group_id=i) for i in range(count)]


def _spinners(count: int) -> list[subprocess.Popen]:
    """Processes that keep ``count`` cores busy at nice 0, as sampling workers would."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def target_sync_cost(steps: int, rounds: int) -> dict[str, Any]:
    """A DQN learner alone (16 updates per step, a Polyak sync after each), sync inline vs background vs
    background niced +5, on a quiet machine and with every core busy: median step time and sync wait."""
    space = describe_spaces(make_env("CartPole-v1"))
    cfg = DQNConfig(learning_starts=0)
    segments = _segments(space, cfg, steps, num_envs=4, length=16)
    variants: dict[str, dict[str, Any]] = {
        "inline": {"background_target_sync": False},
        "background": {},
        "background_nice5": {"target_sync_nice": 5},
    }
    rows: list[dict[str, Any]] = []
    finals: dict[str, dict[str, Any]] = {}
    for load in ("quiet", "busy"):
        spinners = _spinners(os.cpu_count() or 1) if load == "busy" else []
        try:
            for _ in range(rounds):  # interleaved: drift hits every variant alike
                for name, kwargs in variants.items():
                    learner = DQNLearner(space, cfg, seed=0, **kwargs)
                    step_s, wait_s = [], []
                    for i, seg in enumerate(segments):
                        started = time.perf_counter()
                        metrics = learner.train_step([seg], i)
                        step_s.append(time.perf_counter() - started)
                        wait_s.append(metrics[TARGET_SYNC_WAIT])
                    rows.append(
                        {
                            "load": load,
                            "sync": name,
                            "step_ms": statistics.median(step_s[WARM_UP:]) * 1e3,
                            "sync_wait_us": statistics.median(wait_s[WARM_UP:]) * 1e6,
                        }
                    )
                    finals.setdefault(name, learner.state_dict())
        finally:
            for proc in spinners:
                proc.kill()
                proc.wait()
    same = all(
        all(torch.equal(a, b) for a, b in zip(state[net].values(), finals["inline"][net].values(), strict=True))
        for state in finals.values()
        for net in ("q", "target")
    )
    summary = []
    for load in ("quiet", "busy"):
        for name in variants:
            mine = [r for r in rows if r["load"] == load and r["sync"] == name]
            summary.append(
                {
                    "load": load,
                    "sync": name,
                    "step_ms": round(statistics.median(r["step_ms"] for r in mine), 2),
                    "sync_wait_us": round(statistics.median(r["sync_wait_us"] for r in mine), 1),
                }
            )
    return {"updates_per_step": cfg.updates_per_step, "rows": summary, "bit_identical": same}


def refresh_cost(steps: int) -> list[dict[str, Any]]:
    """A sampling worker's weight refresh (shared-memory buffer -> its policy) vs the learner's update."""
    space = describe_spaces(make_env("CartPole-v1"))
    rows = []
    for algorithm in ("ppo", "dqn"):
        cfg: PPOConfig | DQNConfig
        if algorithm == "ppo":
            cfg = PPOConfig(minibatches=8)  # the throughput spec's: 2 segments of 4 x 128 per step
            learner: PPOLearner | DQNLearner = PPOLearner(space, cfg, seed=0)
            per_step, updates = 2, cfg.epochs * cfg.minibatches
            segments = _segments(space, cfg, per_step * steps, num_envs=4, length=128)
        else:
            cfg = DQNConfig(learning_starts=0)  # the example's: 1 segment of 4 x 16 per step
            learner = DQNLearner(space, cfg, seed=0)
            per_step, updates = 1, cfg.updates_per_step
            segments = _segments(space, cfg, steps, num_envs=4, length=16)
        service = WeightService(keep=0)
        subscriber = WeightSubscriber(service.shared_handle(learner.publish_state()))
        engine = PolicyEngine(space, cfg, torch.device("cpu"))
        train_s, refresh_s = [], []
        for i in range(steps):
            started = time.perf_counter()
            learner.train_step(segments[i * per_step : (i + 1) * per_step], i)
            train_s.append(time.perf_counter() - started)
            service.publish(learner.publish_state(), version=learner.version)
            started = time.perf_counter()
            subscriber.switch(engine.update_weights)
            refresh_s.append(time.perf_counter() - started)
        update_us = statistics.median(train_s[WARM_UP:]) / updates * 1e6
        refresh_us = statistics.median(refresh_s[WARM_UP:]) * 1e6
        rows.append(
            {
                "algorithm": algorithm,
                "refresh_us": round(refresh_us, 1),
                "update_us": round(update_us, 1),
                "updates_per_step": updates,
                "update_vs_refresh": round(update_us / refresh_us, 1),
            }
        )
    return rows


def roles(quick: bool, workers: int) -> dict[str, Any]:
    """The three measurements of ``--roles``, printed as they finish."""
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        rows = eval_cost(Path(tmp), steps=10 if quick else 30, rounds=1 if quick else 2, workers=workers)
    figures["evaluation"] = rows

    def mean(every: int, key: str) -> float:
        return statistics.fmean(r[key] for r in rows if r["eval_interval"] == every)

    figures["eval_step_time_ratio"] = round(mean(1, "step_s") / mean(0, "step_s"), 3)
    figures["eval_bubble_delta"] = round(mean(1, "bubble_trainer") - mean(0, "bubble_trainer"), 4)
    for r in rows:
        print(
            f"evaluation {'every step' if r['eval_interval'] else 'off':>10}: step {r['step_s'] * 1e3:7.1f} ms "
            f"(training {r['train_s'] * 1e3:6.1f} ms), "
            f"bubble/trainer {r['bubble_trainer']:.3f}, evaluations {r['evaluations_finished']}/{r['evaluations_asked']}"
        )
    print(
        f"evaluation every step vs off: {figures['eval_step_time_ratio']}x step time, "
        f"bubble/trainer {figures['eval_bubble_delta']:+.4f}"
    )
    figures["eval_contention"] = eval_contention(steps=8 if quick else 15, rounds=1 if quick else 3)
    alone = {r["load"]: r["step_ms"] for r in figures["eval_contention"] if r["evaluation"] == "alone"}
    for r in figures["eval_contention"]:
        r["vs_alone"] = round(r["step_ms"] / alone[r["load"]], 2)
        print(
            f"PPO learner step ({r['load']}), evaluation agent {r['evaluation']:>12}: "
            f"{r['step_ms']:7.1f} ms ({r['vs_alone']}x)"
        )
    sync = target_sync_cost(steps=30 if quick else 60, rounds=1 if quick else 3)
    figures["target_sync"] = sync
    for r in sync["rows"]:
        print(
            f"target sync {r['sync']:>16} ({r['load']}): step {r['step_ms']:6.2f} ms, held up {r['sync_wait_us']:7.1f} us"
        )
    by = {(r["load"], r["sync"]): r for r in sync["rows"]}
    for load in ("quiet", "busy"):
        inline, background = by[(load, "inline")], by[(load, "background")]
        figures[f"sync_wait_background_vs_inline_{load}"] = round(
            background["sync_wait_us"] / inline["sync_wait_us"], 3
        )
        figures[f"step_time_background_vs_inline_{load}"] = round(background["step_ms"] / inline["step_ms"], 3)
    print(
        f"background vs inline sync: held up {figures['sync_wait_background_vs_inline_quiet']}x (quiet), "
        f"{figures['sync_wait_background_vs_inline_busy']}x (busy); step time "
        f"{figures['step_time_background_vs_inline_quiet']}x / {figures['step_time_background_vs_inline_busy']}x; "
        f"bit-identical: {sync['bit_identical']}"
    )
    figures["refresh"] = refresh_cost(steps=20 if quick else 60)
    for r in figures["refresh"]:
        print(
            f"{r['algorithm']}: a worker's weight refresh {r['refresh_us']} us vs a learner update {r['update_us']} us "
            f"({r['update_vs_refresh']}x; {r['updates_per_step']} updates per step)"
        )
    figures["targets"] = {
        "eval_step_time_within_10pct": figures["eval_step_time_ratio"] <= 1.10,
        # the async mode's evaluator is a process of its own (runtime.evaluation.process); the thread is the
        # alternative it replaced
        "eval_process_within_10pct_of_alone": all(
            r["vs_alone"] <= 1.10 for r in figures["eval_contention"] if r["evaluation"] == "eval_process"
        ),
        "background_sync_wait_under_half_inline": figures["sync_wait_background_vs_inline_quiet"] < 0.5,
        "bit_identical": sync["bit_identical"],
    }
    return figures


def main_roles(quick: bool, workers: int) -> None:
    figures: dict[str, Any] = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "quick": quick}
    figures["loadavg_start"] = loadavg()
    print(f"load average at start: {figures['loadavg_start']} (1/5/15 min, {os.cpu_count()} cores)")
    figures.update(roles(quick, workers))
    figures["loadavg_end"] = loadavg()
    print(f"targets: {figures['targets']}")
    print(f"load average at end: {figures['loadavg_end']}")
    print(json.dumps(figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short throughput runs, PPO learning only")
    parser.add_argument("--workers", type=int, default=2, help="sampling worker processes in async mode")
    parser.add_argument("--roles", action="store_true", help="the roles' priorities instead (issue 16)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.roles:
        main_roles(args.quick, args.workers)
        return
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
