"""Per-token log-probs and entropy at a real vocabulary: the trainer's chunked computation
(``runtime.models.logprobs.logprobs_and_entropy``) against the whole-vocabulary one it replaced
(``log_softmax`` in float32, gathered, and the entropy from a second ``log_softmax``), side by side.

The input is what the trainer's loss sees: the logits at the response positions, ``[n, V]`` with Qwen2's
vocabulary (151,936 tokens, 152,064 embedding rows), requiring grad, in float32 or bfloat16. Each variant runs
forward and backward (the log-probs and the entropy both weighted into the loss, as with ``entropy_coef > 0``)
in a fresh process, so each one's peak is its own: figures are the process's peak RSS above what it held with
the logits and their gradient's storage allocated (both variants need those), and the best of 3 timed passes.
Both variants' log-probs, entropies and gradients are checked equal to float rounding first.

    .venv/bin/python bench/logprob_memory.py --quick    # 256 tokens
    .venv/bin/python bench/logprob_memory.py            # 1,024 and 2,048 tokens

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from runtime.models.logprobs import logprobs_and_entropy  # noqa: E402

VOCAB = 152_064  # Qwen2's embedding rows (151,936 tokens, rounded up)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def whole_vocabulary(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The computation the trainer used before: float32 ``log_softmax`` over the vocabulary, twice."""
    logp = logits.float().log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    full = torch.log_softmax(logits.float(), dim=-1)
    return logp, -(full.exp() * full).sum(-1)


def chunked(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return logprobs_and_entropy(logits, targets)


VARIANTS = {"whole-vocabulary": whole_vocabulary, "chunked": chunked}


def _inputs(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.empty(tokens, VOCAB, dtype=dtype).normal_(0.0, 2.0, generator=gen).requires_grad_()  # in place:
    # no temporary raises the process's peak before the baseline is read
    targets = torch.randint(0, VOCAB, (tokens,), generator=gen)
    weights = torch.randn(tokens, generator=gen)
    return logits, targets, weights


def _pass(fn, logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> None:
    logits.grad = None
    logp, entropy = fn(logits, targets)
    ((logp * weights).sum() + (entropy * weights).sum() * 0.01).backward()


def _status_mib(field: str) -> float:
    """``VmRSS`` or ``VmHWM`` (the peak) of this process, from /proc (kB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Start ``VmHWM`` again from the current RSS (Linux >= 4.0). ``ru_maxrss`` cannot be reset, and a spawned
    child starts with its parent's (fork keeps it and exec does not clear it)."""
    Path("/proc/self/clear_refs").write_text("5")


def measure(variant: str, tokens: int, dtype_name: str, out: mp.Queue) -> None:
    """One variant in this (fresh) process: extra peak memory of one pass, then the best of 3 timings."""
    torch.set_num_threads(1)
    logits, targets, weights = _inputs(tokens, DTYPES[dtype_name])
    # The baseline holds the logits and a tensor the size of their gradient (touched, so its pages count), freed
    # before the pass: what a variant needs beyond the input and the gradient every variant returns.
    held = torch.ones_like(logits)
    base = _status_mib("VmRSS")
    del held
    _reset_peak()
    _pass(VARIANTS[variant], logits, targets, weights)
    peak = _status_mib("VmHWM") - base
    times = []
    for _ in range(3):
        started = time.perf_counter()
        _pass(VARIANTS[variant], logits, targets, weights)
        times.append(time.perf_counter() - started)
    out.put({"extra_peak_mib": round(peak, 1), "seconds": round(min(times), 4)})


def check_equal(tokens: int, dtype_name: str) -> float:
    """Max difference of the two variants' log-probs, entropies and gradients (raises past rounding)."""
    logits, targets, weights = _inputs(tokens, DTYPES[dtype_name])
    got = {}
    for name, fn in VARIANTS.items():
        logits.grad = None
        logp, entropy = fn(logits, targets)
        ((logp * weights).sum() + (entropy * weights).sum() * 0.01).backward()
        got[name] = (logp.detach(), entropy.detach(), logits.grad.float())
    a, b = got["whole-vocabulary"], got["chunked"]
    diff = max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))
    tol = 1e-4 if dtype_name == "float32" else 1e-2  # bf16 gradients round at 8 bits
    if diff > tol:
        raise SystemExit(f"chunked log-probs differ from the whole-vocabulary ones by {diff} ({dtype_name})")
    return diff


def run_child(variant: str, tokens: int, dtype_name: str) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=measure, args=(variant, tokens, dtype_name, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256 tokens only")
    args = parser.parse_args()
    sizes = [256] if args.quick else [1024, 2048]
    figures: dict = {"vocab": VOCAB, "cases": []}
    for tokens in sizes:
        for dtype_name in DTYPES:
            diff = check_equal(min(tokens, 256), dtype_name)
            row = {"tokens": tokens, "dtype": dtype_name, "max_diff": diff}
            for variant in VARIANTS:
                row[variant] = run_child(variant, tokens, dtype_name)
            whole, chunk = row["whole-vocabulary"], row["chunked"]
            row["peak_ratio"] = round(chunk["extra_peak_mib"] / whole["extra_peak_mib"], 3)
            row["time_ratio"] = round(chunk["seconds"] / whole["seconds"], 3)
            logits_mib = tokens * VOCAB * torch.finfo(DTYPES[dtype_name]).bits / 8 / 2**20
            print(
                f"{tokens:5d} tokens {dtype_name:8s} (logits {logits_mib:7.1f} MiB): extra peak whole "
                f"{whole['extra_peak_mib']:8.1f} MiB, chunked {chunk['extra_peak_mib']:7.1f} MiB "
                f"({row['peak_ratio']:.3f}x); time {whole['seconds']:.3f} s vs {chunk['seconds']:.3f} s "
                f"({row['time_ratio']:.2f}x); max diff {diff:.1e}",
                flush=True,
            )
            figures["cases"].append(row)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
