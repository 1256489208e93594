"""AdamW's step on CPU, ``torch.optim.AdamW``'s three kernels side by side on the same parameters: ``single``
(a loop over parameters), ``foreach`` (multi-tensor: the update the runtime's own AdamW ran, bit for bit, until
this measurement retired it) and ``fused`` (what ``runtime.train.optimizer.AdamW`` builds on cpu, cuda and npu).

Each model is a built-in decoder preset (``tiny-qwen2``, ``small-qwen2`` and ``medium-qwen2``: about 12.6 M
parameters, hidden 384, 8 layers, head_dim 64; ``--models`` names others) with a fixed random gradient on every
parameter. Rounds interleave the variants (A B C, B C A, ...), each timing ``step()`` after a warm-up step; the
figure is the median over rounds of each round's mean step, and the ratios are against ``foreach``.
After the same steps from the same state all three must hold the same parameters to float rounding (checked).

    .venv/bin/python bench/optimizer_step.py --quick
    .venv/bin/python bench/optimizer_step.py

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from harness import interleaved  # noqa: E402

from runtime.models.configs import builtin_config  # noqa: E402
from runtime.models.decoder import DecoderForCausalLM  # noqa: E402
from runtime.train.optimizer import AdamW  # noqa: E402

MODELS = ("tiny-qwen2", "small-qwen2", "medium-qwen2")  # built-in presets (runtime.models.configs)


def parameters(name: str) -> list[torch.Tensor]:
    cfg = builtin_config(name, vocab_size=100, pad_id=0, bos_id=None, eos_id=1)
    torch.manual_seed(0)
    params = list(DecoderForCausalLM(cfg).parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    return params


def build(variant: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if variant == "trainer":
        optimizer = AdamW(params, lr=1e-3, weight_decay=0.01)
        assert optimizer.fused
        return optimizer
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=variant == "foreach")


def clone(params: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for p in params:
        q = p.detach().clone().requires_grad_(True)
        q.grad = p.grad.clone()
        out.append(q)
    return out


def mean_step_s(optimizer: torch.optim.Optimizer, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and steps (well under a minute)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--models", nargs="+", default=list(MODELS), help="built-in presets (runtime.models.configs)")
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 9)
    steps = args.steps or (5 if args.quick else 20)
    variants = ["foreach", "single", "trainer"]  # trainer: runtime.train.optimizer.AdamW, fused
    result: dict = {"threads": torch.get_num_threads(), "rounds": rounds, "steps": steps, "models": {}}
    for name in args.models:
        base = parameters(name)
        n_params = sum(p.numel() for p in base)
        sets = {v: clone(base) for v in variants}
        opts = {v: build(v, sets[v]) for v in variants}
        for v in variants:
            opts[v].step()  # warm-up: state allocated
        times = interleaved(variants, rounds, lambda v, _r, opts=opts: mean_step_s(opts[v], steps))
        ref = sets["foreach"]
        gap = {
            v: max(float((a - b).detach().abs().max()) for a, b in zip(ref, sets[v], strict=True)) for v in variants[1:]
        }
        med = {v: statistics.median(times[v]) for v in variants}
        row = {
            "parameters": n_params,
            "step_ms": {v: round(med[v] * 1e3, 3) for v in variants},
            "vs_foreach": {v: round(med[v] / med["foreach"], 3) for v in variants},
            "max_param_gap": gap,
        }
        result["models"][name] = row
        print(
            f"{name:12s} {n_params / 1e6:6.2f} M  "
            + "  ".join(f"{v} {row['step_ms'][v]:8.3f} ms ({row['vs_foreach'][v]:.2f}x)" for v in variants)
            + f"  max gap {max(gap.values()):.1e}",
            flush=True,
        )
        for v in variants[1:]:
            if gap[v] > 1e-5:
                raise SystemExit(f"{v} left parameters {gap[v]:.2e} away from the foreach update")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
