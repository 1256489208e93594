"""A rollout instance across the network link vs the same instance on the trainer's host, in one run.

The same async spec runs three times per round: (a) one local rollout instance (a child of the
trainer: weights through shared memory, samples through a pipe, large messages in shared memory),
(b) one remote instance (``python -m runtime rollout``, a process of its own connected over TCP on
localhost: weights pushed as safetensors bytes every version, samples inline) and (c) the same remote
instance with ``pipeline.remote_weight_sync: broadcast`` (weights by a torch.distributed broadcast in a
gloo group of its own). Figures per run, from the steps after the first ``--skip`` (start-up
excluded): samples/s, the trainer's bubble (time it waited for data) and its weight-sync time per
step; then the remote / local and broadcast / link ratios of samples/s. Rounds alternate (a), (b),
(c); the best round of each counts (the machine is shared).

    .venv/bin/python bench/remote_rollout.py --quick
    .venv/bin/python bench/remote_rollout.py --model small-qwen2 --steps 40 --rounds 2

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime.metrics import read_jsonl  # noqa: E402
from runtime.pipeline import run  # noqa: E402
from runtime.spec import load_spec  # noqa: E402


def spec_data(out: Path, args: argparse.Namespace, kind: str) -> dict:
    remote = kind != "local"
    return {
        "name": kind,
        "seed": 0,
        "output_dir": str(out / "{name}"),
        "model": {"builtin": args.model},
        "task": {"name": "reverse", "min_len": 2, "max_len": 12, "train_size": 4096, "eval_size": 8},
        "algorithm": {"name": "grpo", "group_size": 4},
        "rollout": {"max_new_tokens": args.max_new_tokens, "max_batch_size": 32},
        "pipeline": {
            "mode": "async",
            "steps": args.steps,
            "prompts_per_step": 8,
            "max_policy_lag": 1,
            "eval_interval": 0,
            "rollout_listen": "127.0.0.1:0",
            "remote_weight_sync": "broadcast" if kind == "broadcast" else "link",
        },
        "resources": {
            "rollout_workers": 0 if remote else 1,
            "remote_rollout_workers": 1 if remote else 0,
            "threads_per_process": 1,
        },
        "checkpoint": {"interval": 0},
        "metrics": {"progress_bar": False},
    }


def one_run(out: Path, args: argparse.Namespace, kind: str) -> dict:
    spec = load_spec(spec_data(out, args, kind))
    proc = None
    if kind != "local":
        path = out / f"{kind}.yaml"
        path.write_text(yaml.safe_dump(spec.resolved()))
        env = {**os.environ, "TANDEM_ROLLOUT_KEY": "bench-" + "k" * 40}
        os.environ["TANDEM_ROLLOUT_KEY"] = env["TANDEM_ROLLOUT_KEY"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "runtime", "rollout", str(path), "--index", "0"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    try:
        run(spec)
        if proc is not None and proc.wait(timeout=60) != 0:
            raise SystemExit(f"the remote instance exited with {proc.returncode}")
    finally:
        if proc is not None:
            proc.kill()
    steps, _ = read_jsonl(spec.resolved_output_dir() / "metrics.jsonl")
    kept = steps[args.skip :]
    wall = sum(r["time/step"] for r in kept)
    samples = sum(r["throughput/samples_per_s"] * r["time/step"] for r in kept)
    return {
        "samples_per_s": samples / wall,
        "bubble": sum(r["bubble/trainer"] * r["time/step"] for r in kept) / wall,
        "weight_sync_ms": 1000 * sum(r["time/weight_sync"] for r in kept) / len(kept),
        "response_len": sum(r["response_len/mean"] for r in kept) / len(kept),
    }


def weight_bytes(model: str) -> int:
    from safetensors.torch import save

    from runtime.models import build_policy
    from runtime.spec import ModelSpec

    policy, _ = build_policy(ModelSpec(builtin=model), "cpu", seed=0)
    return len(save({k: v.clone() for k, v in policy.state_dict().items()}))  # tied weights: one copy each


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, one round of 12 steps each: under a minute")
    ap.add_argument("--model", default="tiny-qwen2")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=4, help="first steps not counted (start-up)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args()
    if args.quick:
        args.model, args.steps, args.rounds = "tiny-qwen2", 12, 1
    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
        for r in range(args.rounds):
            for kind in ("local", "remote", "broadcast"):
                out = Path(tmp) / f"round-{r}"
                out.mkdir(exist_ok=True)
                got = one_run(out, args, kind)
                print(
                    f"round {r + 1} {kind:<9}: {got['samples_per_s']:.1f} samples/s, trainer bubble "
                    f"{got['bubble']:.2f}, weight sync {got['weight_sync_ms']:.2f} ms/step, "
                    f"answers {got['response_len']:.1f} tokens"
                )
                if kind not in best or got["samples_per_s"] > best[kind]["samples_per_s"]:
                    best[kind] = got
    ratio = best["remote"]["samples_per_s"] / best["local"]["samples_per_s"]
    by_broadcast = best["broadcast"]["samples_per_s"] / best["remote"]["samples_per_s"]
    size = weight_bytes(args.model)
    load = os.getloadavg()[0]
    print(
        f"{args.model}: remote / local samples/s {ratio:.2f}x, broadcast / link {by_broadcast:.2f}x "
        f"(weights {size / 1e6:.1f} MB per version, pushed every step); load average {load:.2f}"
    )
    print(
        json.dumps(
            {
                "bench": "remote_rollout",
                "model": args.model,
                "steps": args.steps,
                "rounds": args.rounds,
                "weight_bytes": size,
                "local": {k: round(v, 4) for k, v in best["local"].items()},
                "remote": {k: round(v, 4) for k, v in best["remote"].items()},
                "broadcast": {k: round(v, 4) for k, v in best["broadcast"].items()},
                "remote_over_local": round(ratio, 3),
                "broadcast_over_link": round(by_broadcast, 3),
                "load_avg_1m": round(load, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
