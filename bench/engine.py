"""Built-in generation engine vs Hugging Face ``model.generate()`` on the same model and prompts.

Both sample at temperature 1 with no top-k/top-p and ignore eos, so both produce exactly
``batch x max_new_tokens`` tokens; tokens/s is measured side by side in one process, best of
``--repeats`` interleaved runs after a warm-up. A second comparison runs the engine on long-tailed
response lengths (each request generates its own hidden length, eos ignored) with static batching
(a batch runs until its longest sequence ends) and with continuous batching (a finished slot is
refilled at the next step), reporting tokens/CPU-s and the padding ratio of each. A third compares
the engine with ``model.generate()`` on that rollout workload: long-tailed lengths, ``generate()``
in static batches (longest first) whose rows stop at their own lengths. Usage:

    .venv/bin/python bench/engine.py --quick
    .venv/bin/python bench/engine.py --models tiny-qwen2 small-qwen2 --batch 32 --max-new-tokens 128
    .venv/bin/python bench/engine.py --quick --one-range   # without the engine's length-aware attention split

The last line printed is one JSON object with every figure. For vLLM (its CPU build) against this
engine on the rollout workload, see bench/vllm_engine.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.models import build_policy  # noqa: E402
from runtime.rollout import Engine, SamplingParams  # noqa: E402
from runtime.spec import ModelSpec  # noqa: E402

ONE_RANGE = False  # --one-range: the engine's attention without row ranges or prefill blocks


def make_engine(model, tok, slots: int) -> Engine:
    engine = Engine(model, tok, "cpu", max_batch_size=slots, max_batch_tokens=1 << 30)
    if ONE_RANGE and engine.runner.name == "fast":
        engine.runner.split_penalty = 1 << 30  # never split decode rows into ranges
        engine.runner.attn_block = engine.runner.forward_tokens  # one attention block per prefill forward
    return engine


def hf_twin(model, tok):
    """The same weights in transformers' own class (the built-ins are the plain decoder, which has no
    ``generate()``): exported, then loaded back by transformers itself (``build_policy`` would give the
    plain decoder again for such a directory)."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from runtime.models import save_hf

    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        save_hf(model, tok, tmp)
        twin = AutoModelForCausalLM.from_pretrained(tmp, local_files_only=True, dtype=model.dtype)
    return twin.eval()


def make_prompts(tokenizer, batch: int, seed: int) -> list[list[int]]:
    """Prompts of mixed lengths (8-40 characters), as a rollout batch has."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(batch):
        n = int(torch.randint(8, 41, (1,), generator=g))
        chars = torch.randint(ord("a"), ord("z") + 1, (n,), generator=g).tolist()
        prompts.append(tokenizer.encode_prompt("".join(map(chr, chars)) + "="))
    return prompts


def time_pair(first, second, repeats: int) -> tuple[list[float], list[float]]:
    """Best-of-``repeats`` (wall seconds, process CPU seconds) of each function, runs interleaved.

    With one torch thread, process CPU time is the work done and is far less distorted than wall time
    by other jobs on a shared machine; both are reported.
    """
    first()  # warm-up
    second()
    wall, cpu = [float("inf")] * 2, [float("inf")] * 2
    for _ in range(repeats):
        for i, fn in enumerate((first, second)):
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[i] = min(wall[i], time.perf_counter() - w0)
            cpu[i] = min(cpu[i], time.process_time() - c0)
    return wall, cpu


def bench_model(name: str, batch: int, max_new: int, repeats: int) -> dict:
    from transformers import GenerationConfig

    model, tok = build_policy(ModelSpec(builtin=name), "cpu", seed=0)
    model.eval()
    twin = hf_twin(model, tok)
    prompts = make_prompts(tok, batch, seed=0)
    width = max(map(len, prompts))
    ids = torch.full((batch, width), tok.pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    gen_cfg = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new, min_new_tokens=max_new,
        eos_token_id=None, pad_token_id=tok.pad_id,
    )  # fmt: skip

    def hf() -> None:
        with torch.inference_mode():
            out = twin.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg)
        assert out.shape[1] == width + max_new, out.shape

    engine = make_engine(model, tok, batch)
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)

    def ours() -> None:
        out = engine.generate(prompts, params, gen)
        assert all(len(c.token_ids) == max_new for c in out)

    tokens = batch * max_new
    wall, cpu = time_pair(hf, ours, repeats)
    return {
        "model": name,
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        "batch": batch,
        "max_new_tokens": max_new,
        "runner": engine.runner.name,
        "hf_tokens_per_s": round(tokens / wall[0], 1),
        "engine_tokens_per_s": round(tokens / wall[1], 1),
        "speedup_wall": round(wall[0] / wall[1], 2),
        "hf_tokens_per_cpu_s": round(tokens / cpu[0], 1),
        "engine_tokens_per_cpu_s": round(tokens / cpu[1], 1),
        "speedup": round(cpu[0] / cpu[1], 2),
    }


def bench_continuous(name: str, slots: int, requests: int, max_new: int, repeats: int) -> dict:
    """Static vs continuous batching in one engine on long-tailed lengths (see module docstring)."""
    model, tok = build_policy(ModelSpec(builtin=name), "cpu", seed=0)
    work = long_tail_work(tok, requests, max_new)
    engine = make_engine(model, tok, slots)
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    stats = {}

    def run(refill: bool):
        def go() -> None:
            b = engine.batcher(params, gen, refill=refill)
            for i, (ids, length) in enumerate(work):
                b.submit(ids, i, max_new_tokens=length)
            while not b.idle:
                b.step()
            stats[refill] = b.stats

        return go

    wall, cpu = time_pair(run(False), run(True), repeats)
    tokens = sum(length for _, length in work)
    return {
        "model": name,
        "slots": slots,
        "requests": requests,
        "generated_tokens": tokens,
        "static_tokens_per_cpu_s": round(tokens / cpu[0], 1),
        "continuous_tokens_per_cpu_s": round(tokens / cpu[1], 1),
        "speedup": round(cpu[0] / cpu[1], 2),
        "static_padding_ratio": round(stats[False].padding_ratio, 4),
        "continuous_padding_ratio": round(stats[True].padding_ratio, 4),
    }


def long_tail_work(tok, requests: int, max_new: int) -> list[tuple[list[int], int]]:
    """(prompt, hidden response length) pairs with long-tailed lengths (a Pareto-like draw capped at
    ``max_new``), longest first: what the scheduler hands an instance."""
    import random

    rng = random.Random(0)
    work = [
        (make_prompts(tok, 1, seed=i)[0], min(max_new, max(1, int(4 / (1 - rng.random()) ** 1.3))))
        for i in range(requests)
    ]
    work.sort(key=lambda w: -w[1])
    return work


def bench_long_tail(name: str, slots: int, requests: int, max_new: int, repeats: int) -> dict:
    """The rollout workload: long-tailed response lengths, engine vs ``model.generate()``.

    ``generate()`` runs the requests in batches of ``slots`` (longest first, so each batch holds
    similar lengths: its best case); a row stops at its own length through a stopping criterion, but
    the batch runs until its longest row is done, as ``generate()`` does. The engine decodes the same
    requests with ``slots`` slots and refills a finished slot at the next step. Both count only the
    tokens the requests asked for (eos ignored by both), so the ratio is useful tokens per CPU-second.
    """
    from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

    model, tok = build_policy(ModelSpec(builtin=name), "cpu", seed=0)
    model.eval()
    twin = hf_twin(model, tok)
    work = long_tail_work(tok, requests, max_new)
    batches = []
    for start in range(0, len(work), slots):
        chunk = work[start : start + slots]
        width = max(len(p) for p, _ in chunk)
        ids = torch.full((len(chunk), width), tok.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, (p, _) in enumerate(chunk):
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        batches.append((ids, mask, torch.tensor([n for _, n in chunk])))

    class RowLength(StoppingCriteria):
        """Each row is done once it has generated its own length."""

        def __init__(self, width: int, lengths: torch.Tensor):
            self.width, self.lengths = width, lengths

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
            return (input_ids.shape[1] - self.width) >= self.lengths

    def hf() -> None:
        for ids, mask, lengths in batches:
            cfg = GenerationConfig(
                do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=int(lengths.max()),
                min_new_tokens=int(lengths.max()), eos_token_id=None, pad_token_id=tok.pad_id,
            )  # fmt: skip
            stop = StoppingCriteriaList([RowLength(ids.shape[1], lengths)])
            with torch.inference_mode():
                out = twin.generate(input_ids=ids, attention_mask=mask, generation_config=cfg, stopping_criteria=stop)
            assert out.shape[1] == ids.shape[1] + int(lengths.max()), out.shape

    engine = make_engine(model, tok, slots)
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)

    def ours() -> None:
        b = engine.batcher(params, gen)
        for i, (ids, length) in enumerate(work):
            b.submit(ids, i, max_new_tokens=length)
        made = 0
        while not b.idle:
            made += sum(len(c.token_ids) for _, c in b.step())
        assert made == tokens, (made, tokens)

    tokens = sum(n for _, n in work)
    wall, cpu = time_pair(hf, ours, repeats)
    return {
        "model": name,
        "slots": slots,
        "requests": requests,
        "generated_tokens": tokens,
        "longest": work[0][1],
        "hf_tokens_per_cpu_s": round(tokens / cpu[0], 1),
        "engine_tokens_per_cpu_s": round(tokens / cpu[1], 1),
        "speedup": round(cpu[0] / cpu[1], 2),
        "speedup_wall": round(wall[0] / wall[1], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny-qwen2 only, small batch: well under a minute")
    ap.add_argument("--models", nargs="+", default=["tiny-qwen2", "small-qwen2"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--one-range",
        action="store_true",
        help="engine attention without its length-aware split (decode rows in one range, one prefill attention "
        "block per forward pass), to measure what the split gives",
    )
    args = ap.parse_args()
    global ONE_RANGE
    ONE_RANGE = args.one_range
    if args.quick:
        args.models, args.batch, args.max_new_tokens, args.repeats = ["tiny-qwen2"], 16, 64, 2
    torch.set_num_threads(args.threads)
    results = []
    for name in args.models:
        r = bench_model(name, args.batch, args.max_new_tokens, args.repeats)
        results.append(r)
        print(
            f"{r['model']:<12} ({r['params_m']} M params, batch {r['batch']}, {r['max_new_tokens']} new tokens, "
            f"runner {r['runner']}): model.generate {r['hf_tokens_per_cpu_s']:.0f} tok/CPU-s, "
            f"engine {r['engine_tokens_per_cpu_s']:.0f} tok/CPU-s, speed-up {r['speedup']:.2f}x "
            f"(wall clock: {r['hf_tokens_per_s']:.0f} vs {r['engine_tokens_per_s']:.0f} tok/s, {r['speedup_wall']:.2f}x)"
        )
    requests = 48 if args.quick else 128
    cont = bench_continuous(args.models[0], args.batch, requests, args.max_new_tokens * 2, args.repeats)
    print(
        f"{cont['model']:<12} long-tailed lengths ({cont['requests']} requests, {cont['slots']} slots): static "
        f"batching {cont['static_tokens_per_cpu_s']:.0f} tok/CPU-s (padding {cont['static_padding_ratio']:.2f}), "
        f"continuous {cont['continuous_tokens_per_cpu_s']:.0f} tok/CPU-s (padding "
        f"{cont['continuous_padding_ratio']:.2f}), speed-up {cont['speedup']:.2f}x"
    )
    tails = []
    for name in args.models:
        t = bench_long_tail(name, args.batch, requests, args.max_new_tokens * 2, args.repeats)
        tails.append(t)
        print(
            f"{t['model']:<12} rollout workload ({t['requests']} long-tailed requests up to {t['longest']} tokens, "
            f"{t['slots']} slots): model.generate {t['hf_tokens_per_cpu_s']:.0f} tok/CPU-s, engine "
            f"{t['engine_tokens_per_cpu_s']:.0f} tok/CPU-s, speed-up {t['speedup']:.2f}x (wall {t['speedup_wall']:.2f}x)"
        )
    load = os.getloadavg()[0]
    print(
        f"threads={args.threads}, one_range={args.one_range}, load average {load:.2f} (the machine is shared; figures vary with load)"
    )
    print(
        json.dumps(
            {
                "bench": "engine",
                "threads": args.threads,
                "one_range": args.one_range,
                "load_avg_1m": round(load, 2),
                "results": results,
                "continuous_batching": cont,
                "long_tail_vs_generate": tails,
            }
        )
    )


if __name__ == "__main__":
    main()
