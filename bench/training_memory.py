"""Per-rank training state and step time of ddp vs fsdp over gloo ranks on the CPU.

For each world size (2 and 4 ranks) and strategy, every rank builds the same policy
(``--model``, a built-in architecture), trains ``--steps`` GRPO steps on its shard of synthetic
samples and reports:

* bytes of parameters + gradients + optimizer state this rank holds (measured in an optimizer step
  pre-hook, where gradients and AdamW's moments both exist; a DTensor counts its local shard);
* the mean step time after the first step (rank 0's ``train_step`` wall time);
* fsdp only: the time of one full-state gather for publication (``Trainer.publish_state``, the
  weights gathered onto rank 0's CPU), the cost every weight sync and HF export pays.

Ratios printed: fsdp / ddp per-rank state against the target ``1/N + 10%``, and fsdp / ddp step
time against ``1.5``. The last line of output is one JSON object with every figure. Threads: one
per rank, so 4 ranks on a 2-core machine share cores (quote figures with the load average).

Usage::

    .venv/bin/python bench/training_memory.py            # tiny-qwen2 and small-qwen2, 2 and 4 ranks
    .venv/bin/python bench/training_memory.py --quick    # tiny-qwen2 only, fewer steps (< 1 min)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.samples import Sample  # noqa: E402
from runtime.spec import load_spec  # noqa: E402
from runtime.train.parallel import training_state_bytes  # noqa: E402


def _samples(n: int, seed: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(4, 100, (8,), generator=gen).tolist()
        response = torch.randint(4, 100, (24,), generator=gen).tolist()
        out.append(
            Sample(
                sample_id=i,
                prompt_id=i // 8,
                group_id=i // 8,
                prompt_ids=[1, *prompt],
                response_ids=response,
                logprobs=[-4.0] * len(response),
                versions=[0] * len(response),
                finish_reason="stop",
                reward=float(i % 2),
                correct=bool(i % 2),
            )
        )
    return out


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    from runtime.models import build_policy
    from runtime.train.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for strategy in ("ddp", "fsdp"):
            spec = load_spec(
                {"seed": 1, "model": {"builtin": args.model}},
                [f"resources.trainer_devices={world}", f"trainer.strategy={strategy}", "trainer.lr=0.0001"],
            )
            policy, tok = build_policy(spec.model, "cpu", seed=1)
            trainer = Trainer(spec, policy, tok, "cpu", process_group=dist.group.WORLD)
            measured: dict[str, int] = {}
            trainer.optimizer.register_step_pre_hook(
                lambda opt, a, k, t=trainer, m=measured: m.update(training_state_bytes(t.policy, opt))
            )
            times = []
            for step in range(args.steps):
                shard = _samples(args.samples, seed=step)[rank::world]
                dist.barrier()
                started = time.perf_counter()
                trainer.train_step(shard, step)
                times.append(time.perf_counter() - started)
            dist.barrier()
            started = time.perf_counter()
            trainer.publish_state()
            publish_s = time.perf_counter() - started
            results[strategy] = {
                "bytes": measured,
                "step_s": statistics.mean(times[1:]) if len(times) > 1 else times[0],
                "publish_s": publish_s,
            }
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(world, _free_port(), args, out), nprocs=world, join=True)
        ranks = [torch.load(f"{out}/rank{r}.pt") for r in range(world)]
    row: dict = {"world": world, "model": args.model}
    for strategy in ("ddp", "fsdp"):
        per_rank = [sum(r[strategy]["bytes"].values()) for r in ranks]
        row[strategy] = {
            "state_bytes_per_rank_max": max(per_rank),
            "params_bytes": ranks[0][strategy]["bytes"]["params"],
            "grads_bytes": ranks[0][strategy]["bytes"]["grads"],
            "optimizer_bytes": ranks[0][strategy]["bytes"]["optimizer"],
            "step_s": ranks[0][strategy]["step_s"],
            "publish_s": ranks[0][strategy]["publish_s"],
        }
    row["state_ratio"] = row["fsdp"]["state_bytes_per_rank_max"] / row["ddp"]["state_bytes_per_rank_max"]
    row["state_target"] = 1 / world + 0.10
    row["step_time_ratio"] = row["fsdp"]["step_s"] / row["ddp"]["step_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny-qwen2 only, 3 steps")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--samples", type=int, default=32, help="samples per step (all ranks together)")
    args = parser.parse_args()
    models = ["tiny-qwen2"] if args.quick else ["tiny-qwen2", "small-qwen2"]
    if args.quick:
        args.steps = 3
    rows = []
    for model in models:
        for world in (2, 4):
            args.model = model
            row = measure(world, args)
            rows.append(row)
            d, f = row["ddp"], row["fsdp"]
            print(
                f"{model:12s} N={world}: state/rank ddp {d['state_bytes_per_rank_max'] / 2**20:7.2f} MiB  "
                f"fsdp {f['state_bytes_per_rank_max'] / 2**20:7.2f} MiB  ratio {row['state_ratio']:.3f} "
                f"(target <= {row['state_target']:.3f})  step ddp {d['step_s']:.3f}s fsdp {f['step_s']:.3f}s "
                f"ratio {row['step_time_ratio']:.2f} (target <= 1.5)  publish ddp {d['publish_s'] * 1e3:.1f} ms "
                f"fsdp {f['publish_s'] * 1e3:.1f} ms",
                flush=True,
            )
    load = os.getloadavg()[0]
    print(json.dumps({"bench": "training_memory", "quick": args.quick, "load_avg_1m": load, "rows": rows}))


if __name__ == "__main__":
    main()
