"""Per-rank training state, measured peak memory and step time of ddp vs fsdp, full fine-tuning vs LoRA,
over gloo ranks on the CPU.

Each configuration (model × world size × strategy × full / LoRA) runs in fresh rank processes (forked
from this one after its imports, so a rank starts from the same resident set every time). Every rank
builds the same policy (a built-in architecture; LoRA: ``model.lora: {r: 16, alpha: 32}`` on every
projection), trains ``--steps`` GRPO steps on its shard of synthetic samples and reports:

* computed: bytes of trainable parameters + gradients + optimizer state this rank holds
  (``runtime.train.parallel.training_state_bytes`` in an optimizer step pre-hook, where gradients and
  AdamW's moments both exist; a DTensor counts its local shard), and the bytes of all its weights,
  frozen ones included;
* measured: the process's own peak resident memory. After the imports and the process group, and
  before building the model, the rank resets its peak (``5`` into ``/proc/self/clear_refs``) and reads
  its resident set; after the last step it reads ``VmHWM`` from ``/proc/self/status``: the peak over
  building the model and training, as the absolute peak and as peak minus the resident set at the reset
  (what the model and training added). The same once more after the publication gather. Part of what
  is added is not the model's: the libraries' code pages the first steps fault in (a forked rank maps its
  parent's code but must fault it in again), reported as ``file_added_kb`` (``RssFile`` growth), and the
  activations of the rank's micro-batches;
* with ``--malloc-mmap-threshold``: the same with glibc's mmap threshold fixed in the ranks, so that
  freed tensors leave the resident set (by default the heap keeps what it grew to: see bench/RESULTS.md);
* the mean step time after the first step (rank 0's ``train_step`` wall time), and the time of one
  full-state gather for publication (``Trainer.publish_state``; fsdp: onto rank 0's CPU).

Ratios printed: fsdp / ddp per-rank state against the target ``1/N + 10%``, fsdp / ddp step time
against ``1.5``, LoRA / full per-rank state and measured peak added. The last line of output is one
JSON object with every figure. Threads: one per rank, so 4 ranks on a 2-core machine share cores
(quote figures with the load average). Linux only (``/proc``).

Usage::

    .venv/bin/python bench/training_memory.py            # tiny-, small- and medium-qwen2, 2 and 4 ranks
    .venv/bin/python bench/training_memory.py --quick    # tiny-qwen2 only, 3 steps (< 1 min)
    .venv/bin/python bench/training_memory.py --malloc-mmap-threshold 65536   # the peaks without heap retention
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import os
import re
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

# Everything a rank imports is imported here, before the ranks fork and reset their peak: a module imported
# lazily while the model is built or trains would count as the model's memory (each rank reports the modules
# it still imported after its reset, ``late_imports``).
import peft  # noqa: E402, F401  # runtime.models.lora imports it when it injects adapters
import peft.utils.transformers_weight_conversion  # noqa: E402, F401  # ... and this when it does
import torch.distributed.checkpoint.state_dict  # noqa: E402, F401  # the fsdp publication gather
import torch.distributed.fsdp  # noqa: E402, F401
import torch.profiler._cupti_monitor  # noqa: E402, F401  # the first train step imports it

from runtime.models import build_policy  # noqa: E402
from runtime.samples import Sample  # noqa: E402
from runtime.spec import load_spec  # noqa: E402
from runtime.train.parallel import local_bytes, training_state_bytes  # noqa: E402
from runtime.train.trainer import Trainer  # noqa: E402

STRATEGIES = ("ddp", "fsdp")
TUNINGS = ("full", "lora")
LORA = {"r": 16, "alpha": 32}
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def _status_kb() -> dict[str, int]:
    """This process's ``VmRSS``, ``VmHWM`` (peak resident set) and ``RssFile`` (its file-backed part) in kB."""
    text = Path("/proc/self/status").read_text()
    return {key: int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1)) for key in ("VmRSS", "VmHWM", "RssFile")}


def _reset_peak() -> int:
    """Reset this process's peak resident set to its current one (Linux >= 4.0); return that, in kB."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kb()["VmRSS"]


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


def _worker(rank: int, world: int, port: int, config: dict, args: argparse.Namespace, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = {"builtin": config["model"]}
        if config["tuning"] == "lora":
            model["lora"] = LORA
        spec = load_spec(
            {"seed": 1, "model": model},
            [f"resources.trainer_devices={world}", f"trainer.strategy={config['strategy']}", "trainer.lr=0.0001"],
        )
        shards = [_samples(args.samples, seed=step)[rank::world] for step in range(args.steps)]
        if args.malloc_mmap_threshold:
            # A fixed threshold (glibc's is dynamic: it rises to the size of each mmapped block freed, up to
            # 32 MiB, after which such blocks stay in the heap): every block above it is its own mapping,
            # unmapped when freed, so the resident set follows the live tensors rather than the heap's
            # high-water mark.
            libc = ctypes.CDLL(ctypes.util.find_library("c"))
            if libc.mallopt(M_MMAP_THRESHOLD, args.malloc_mmap_threshold) != 1:
                raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")
        dist.barrier()
        gc.collect()
        modules = set(sys.modules)
        rss_at_reset = _reset_peak()
        file_at_reset = _status_kb()["RssFile"]

        policy, tok = build_policy(spec.model, "cpu", seed=1)
        trainer = Trainer(spec, policy, tok, "cpu", process_group=dist.group.WORLD)
        state: dict[str, int] = {}
        trainer.optimizer.register_step_pre_hook(
            lambda opt, a, k, t=trainer, m=state: m.update(training_state_bytes(t.policy, opt))
        )
        times = []
        for step, shard in enumerate(shards):
            dist.barrier()
            started = time.perf_counter()
            trainer.train_step(shard, step)
            times.append(time.perf_counter() - started)
        trained = _status_kb()
        dist.barrier()
        started = time.perf_counter()
        trainer.publish_state()
        publish_s = time.perf_counter() - started
        published = _status_kb()
        params = list(trainer.policy.parameters())
        result = {
            "params": sum(p.numel() for p in params),
            "trainable_params": sum(p.numel() for p in params if p.requires_grad),
            "weights_bytes": sum(local_bytes(p) for p in params),  # this rank's, frozen ones included
            "bytes": state,
            "rss_at_reset_kb": rss_at_reset,
            "peak_kb": trained["VmHWM"],
            "peak_added_kb": trained["VmHWM"] - rss_at_reset,
            "peak_with_publish_kb": published["VmHWM"],
            "peak_added_with_publish_kb": published["VmHWM"] - rss_at_reset,
            "rss_end_kb": published["VmRSS"],
            # file-backed pages that became resident over building and training: the libraries' code the first
            # steps ran (a forked rank faults its parent's code pages in again), part of the peak added
            "file_added_kb": trained["RssFile"] - file_at_reset,
            "step_s": statistics.mean(times[1:]) if len(times) > 1 else times[0],
            "publish_s": publish_s,
            "late_imports": sorted(set(sys.modules) - modules),
        }
        Path(f"{out_dir}/rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(config: dict, world: int, args: argparse.Namespace) -> dict:
    """One configuration over ``world`` fresh rank processes: its per-rank figures and their max over ranks."""
    with tempfile.TemporaryDirectory() as out:
        # fork: the ranks inherit this process's imports (spawn would re-import torch for every configuration)
        mp.start_processes(
            _worker, args=(world, _free_port(), config, args, out), nprocs=world, join=True, start_method="fork"
        )
        ranks = [json.loads(Path(f"{out}/rank{r}.json").read_text()) for r in range(world)]
    state = [sum(r["bytes"].values()) for r in ranks]
    return {
        "params": ranks[0]["params"],
        "trainable_params": ranks[0]["trainable_params"],
        # computed, rank 0 (every rank holds the same up to fsdp's uneven last shards); max over ranks
        "params_bytes": ranks[0]["bytes"]["params"],
        "grads_bytes": ranks[0]["bytes"]["grads"],
        "optimizer_bytes": ranks[0]["bytes"]["optimizer"],
        "weights_bytes": ranks[0]["weights_bytes"],
        "state_bytes_per_rank": state,
        "state_bytes_per_rank_max": max(state),
        # measured, per rank and max over ranks
        "rss_at_reset_kb_per_rank": [r["rss_at_reset_kb"] for r in ranks],
        "peak_added_kb_per_rank": [r["peak_added_kb"] for r in ranks],
        "peak_added_kb_max": max(r["peak_added_kb"] for r in ranks),
        "peak_kb_per_rank": [r["peak_kb"] for r in ranks],
        "peak_kb_max": max(r["peak_kb"] for r in ranks),
        "peak_added_with_publish_kb_per_rank": [r["peak_added_with_publish_kb"] for r in ranks],
        "peak_added_with_publish_kb_max": max(r["peak_added_with_publish_kb"] for r in ranks),
        "rss_end_kb_per_rank": [r["rss_end_kb"] for r in ranks],
        "file_added_kb_per_rank": [r["file_added_kb"] for r in ranks],
        # the peak added less the code pages faulted in: a lower bound on the anonymous memory added at the peak
        "peak_added_less_file_kb_max": max(r["peak_added_kb"] - r["file_added_kb"] for r in ranks),
        "late_imports": sorted({m for r in ranks for m in r["late_imports"]}),
        "step_s": ranks[0]["step_s"],
        "publish_s": ranks[0]["publish_s"],
    }


def _mib(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:7.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny-qwen2 only, 3 steps")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--samples", type=int, default=32, help="samples per step (all ranks together)")
    parser.add_argument("--models", nargs="+", help="built-in models (default: tiny-, small- and medium-qwen2)")
    parser.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=0,
        metavar="BYTES",
        help="fix glibc's mmap threshold in the ranks (mallopt), e.g. 65536: the peak without the heap's retention",
    )
    args = parser.parse_args()
    models = args.models or (["tiny-qwen2"] if args.quick else ["tiny-qwen2", "small-qwen2", "medium-qwen2"])
    if args.quick:
        args.steps = 3
    load_start = os.getloadavg()[0]
    rows = []
    for model in models:
        for world in (2, 4):
            row: dict = {"model": model, "world": world}
            for strategy in STRATEGIES:
                row[strategy] = {}
                for tuning in TUNINGS:
                    config = {"model": model, "strategy": strategy, "tuning": tuning}
                    c = row[strategy][tuning] = measure(config, world, args)
                    print(
                        f"{model:12s} N={world} {strategy:4s} {tuning:4s}: params {c['params'] / 1e6:6.2f} M "
                        f"(trainable {c['trainable_params'] / 1e6:6.3f} M)  state/rank params {_mib(c['params_bytes'])} "
                        f"grads {_mib(c['grads_bytes'])} optim {_mib(c['optimizer_bytes'])} MiB  "
                        f"measured peak added/rank max {c['peak_added_kb_max'] / 1024:7.1f} MiB "
                        f"(abs {c['peak_kb_max'] / 1024:6.1f}, code pages {max(c['file_added_kb_per_rank']) / 1024:.1f}, "
                        f"with publish +{c['peak_added_with_publish_kb_max'] / 1024:.1f})"
                        f"  step {c['step_s']:.3f}s publish {c['publish_s'] * 1e3:.1f} ms"
                        + (f"  late imports {len(c['late_imports'])}" if c["late_imports"] else ""),
                        flush=True,
                    )
                full, lora = row[strategy]["full"], row[strategy]["lora"]
                row[strategy]["lora_to_full"] = {
                    "state": lora["state_bytes_per_rank_max"] / full["state_bytes_per_rank_max"],
                    "peak_added": lora["peak_added_kb_max"] / full["peak_added_kb_max"],
                    "step_time": lora["step_s"] / full["step_s"],
                }
            for tuning in TUNINGS:
                d, f = row["ddp"][tuning], row["fsdp"][tuning]
                row[f"{tuning}_fsdp_to_ddp"] = {
                    "state": f["state_bytes_per_rank_max"] / d["state_bytes_per_rank_max"],
                    "state_target": 1 / world + 0.10,
                    "peak_added": f["peak_added_kb_max"] / d["peak_added_kb_max"],
                    "step_time": f["step_s"] / d["step_s"],
                }
            rows.append(row)
            ratios = "  ".join(
                f"{s} lora/full state {row[s]['lora_to_full']['state']:.3f} peak {row[s]['lora_to_full']['peak_added']:.3f}"
                for s in STRATEGIES
            )
            fr = row["full_fsdp_to_ddp"]
            print(
                f"{model:12s} N={world}: full fsdp/ddp state {fr['state']:.3f} (target <= {fr['state_target']:.3f}) "
                f"peak {fr['peak_added']:.3f} step {fr['step_time']:.2f} (target <= 1.5)  {ratios}",
                flush=True,
            )
    result = {
        "bench": "training_memory",
        "quick": args.quick,
        "steps": args.steps,
        "samples": args.samples,
        "lora": LORA,
        "malloc_mmap_threshold": args.malloc_mmap_threshold or None,
        "load_avg_1m_start": load_start,
        "load_avg_1m": os.getloadavg()[0],
        "rows": rows,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
