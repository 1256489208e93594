"""The trainer's micro-batch layouts side by side: the same samples, the same model, one train step each.

Layouts (``trainer.layout``):

- ``padded``: one right-padded row per sample, and the shared-prefix layout (a group's prompt run once,
  its responses continued from the prompt's KV cache in length tiers) where it saves 20% of the tokens:
  the trainer's layout before packing, and the step-time reference.
- ``packed``: whole sequences one after another in rows, attention block-diagonal (nothing shared).
- ``auto`` (the default): packed rows in which a group's samples share one copy of their prompt, each
  response attending its prompt and itself (one forward per micro-batch).
- ``padded-rows``: right-padded rows only, what the trainer ran before packing wherever the shared-prefix
  layout cannot act (fsdp, gradient checkpointing, a PPO critic): the layout packing replaces there.

Workloads (GRPO groups of 8, random rewards, the built-in char vocabulary):

- ``generation-heavy``: short prompts (8-16 tokens), long-tailed responses (a Pareto draw, 2 to 256
  tokens): most of the batch is response, and a padded row pads every short answer to the long ones.
- ``training-heavy``: long prompts (96-160 tokens), short responses (1-16 tokens): the prompt is most of
  every sequence, so running it once per group (shared prefix) is the lever.

Per model and workload, one trainer per layout from the same initial weights; rounds interleave the layouts
(A B C, B C A, ...) and time ``train_step`` on the same samples after a warm-up step; the figure is the
median step. Ratios are against ``padded``, and packed's against ``padded-rows``. computed / real tokens is the trainer's own metric
(``train/computed_tokens_ratio``: tokens the forwards computed, padding included, over the samples' prompt
and response tokens). The first step's policy loss must agree between layouts (checked: they compute the
same thing).

    .venv/bin/python bench/train_layout.py --quick
    .venv/bin/python bench/train_layout.py

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from harness import interleaved  # noqa: E402

from runtime.contract import COMPUTED_TOKENS_RATIO, LOSS_POLICY  # noqa: E402
from runtime.models import build_policy  # noqa: E402
from runtime.samples import Sample  # noqa: E402
from runtime.spec import load_spec  # noqa: E402
from runtime.train.trainer import Trainer  # noqa: E402

LAYOUTS = ("padded", "packed", "auto", "padded-rows")
GROUP = 8
WORKLOADS = {
    # (prompt length range, response length draw)
    "generation-heavy": ((8, 16), lambda rng: min(256, max(2, int(rng.paretovariate(1.2) * 6)))),
    "training-heavy": ((96, 160), lambda rng: rng.randint(1, 16)),
}


def make_samples(workload: str, prompts: int, seed: int = 0) -> list[Sample]:
    (lo, hi), response_len = WORKLOADS[workload]
    rng = random.Random(seed)
    out = []
    for p in range(prompts):
        prompt = [1] + [rng.randrange(4, 100) for _ in range(rng.randint(lo, hi) - 1)]
        for _ in range(GROUP):
            n = response_len(rng)
            out.append(
                Sample(
                    sample_id=len(out),
                    prompt_id=p,
                    group_id=p,
                    prompt_ids=prompt,
                    response_ids=[rng.randrange(4, 100) for _ in range(n)],
                    logprobs=[-2.0] * n,
                    versions=[0] * n,
                    finish_reason="stop",
                    reward=float(rng.random() < 0.5),
                    correct=False,
                )
            )
    return out


def make_trainer(model: str, layout: str, threads: int) -> Trainer:
    spec = load_spec(
        {
            "model": {"builtin": model},
            "algorithm": {"group_size": GROUP},
            "trainer": {"lr": 1e-5, "layout": layout.removesuffix("-rows"), "micro_batch_tokens": 4096},
            "resources": {"threads_per_process": threads},
        }
    )
    policy, tok = build_policy(spec.model, "cpu", seed=0)
    trainer = Trainer(spec, policy, tok, "cpu")
    if layout == "padded-rows":
        trainer.shared_prefix_allowed = False  # as with fsdp, gradient checkpointing or a critic
    return trainer


def measure(model: str, workload: str, prompts: int, rounds: int, threads: int) -> dict:
    samples = make_samples(workload, prompts)
    trainers = {layout: make_trainer(model, layout, threads) for layout in LAYOUTS}
    first = {layout: t.train_step(samples, 0) for layout, t in trainers.items()}  # warm-up, and the loss check
    for layout in LAYOUTS[1:]:
        a, b = first[layout][LOSS_POLICY], first["padded"][LOSS_POLICY]
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (model, workload, layout, a, b)

    def step_s(layout: str, r: int) -> float:
        started = time.perf_counter()
        trainers[layout].train_step(samples, r + 1)
        return time.perf_counter() - started

    times = interleaved(LAYOUTS, rounds, step_s)
    step = {layout: statistics.median(v) for layout, v in times.items()}
    real = sum(s.num_tokens for s in samples)
    return {
        "model": model,
        "workload": workload,
        "samples": len(samples),
        "real_tokens": real,
        "response_share": round(sum(len(s.response_ids) for s in samples) / real, 3),
        "step_s": {k: round(v, 4) for k, v in step.items()},
        "computed_over_real": {k: round(first[k][COMPUTED_TOKENS_RATIO], 3) for k in LAYOUTS},
        "step_vs_padded": {k: round(step[k] / step["padded"], 3) for k in LAYOUTS[1:]},
        "packed_vs_padded_rows": round(step["packed"] / step["padded-rows"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny-qwen2 only, fewer samples and rounds (< 1 min)")
    parser.add_argument("--models", nargs="+", default=["tiny-qwen2", "medium-qwen2"])
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (x 8 samples)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    models, prompts, rounds = (["tiny-qwen2"], 8, 3) if args.quick else (args.models, args.prompts, args.rounds)
    torch.set_num_threads(args.threads)
    results = []
    for model in models:
        for workload in WORKLOADS:
            res = measure(model, workload, prompts, rounds, args.threads)
            results.append(res)
            print(
                f"{model:<13} {workload:<17} {res['samples']} samples, {res['real_tokens']} tokens "
                f"({res['response_share']:.0%} response): step "
                + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in res["step_s"].items())
                + "; computed/real "
                + ", ".join(f"{k} {v:.3f}" for k, v in res["computed_over_real"].items())
                + "; vs padded "
                + ", ".join(f"{k} {v:.2f}x" for k, v in res["step_vs_padded"].items())
                + f"; packed vs padded-rows {res['packed_vs_padded_rows']:.2f}x"
            )
    print(json.dumps({"benchmark": "train_layout", "quick": args.quick, "rounds": rounds, "results": results}))


if __name__ == "__main__":
    main()
