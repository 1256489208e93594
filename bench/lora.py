"""LoRA against full fine-tuning at the same size (``model.lora``, r=16): ``lora`` on the default targets
(q_proj and v_proj, peft's default for Llama / Qwen2), ``lora-all`` on all seven projections.

Three parts, each side by side in one run:

1. **Trainer state and weight sync** (in this process, the same synthetic GRPO step for both): the bytes
   of parameters that train, their gradients and the optimizer's state, read from the real tensors at the
   optimizer step (``runtime.train.parallel.training_state_bytes``); the bytes the trainer publishes per
   step (``Trainer.publish_state``) and the time an engine of its own takes to load them
   (``Engine.update_weights``, median of rounds in rotating order, ``harness.interleaved``); the train step's median time.
2. **Peak memory, measured**: each configuration trains the same steps in a fresh process of its own, which
   resets its peak resident set after its imports (Linux ``clear_refs``) and reports the peak over building
   the model and training (``VmHWM``) less the resident set before: what the model and training added.
3. **Learning under the same budget**: from one SFT warm start, a sync GRPO run of the same steps and
   samples per configuration (each at its own learning rate: LoRA's usual 10x), then held-out greedy
   accuracy, with its binomial standard error, and samples/s over the whole run (start-up and evaluations
   included).

    .venv/bin/python bench/lora.py --quick      # tiny-qwen2, a few steps (< 1 min)
    .venv/bin/python bench/lora.py              # medium-qwen2 (12.6 M parameters)

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from harness import interleaved  # noqa: E402

from runtime.models import build_policy  # noqa: E402
from runtime.rollout.engine import Engine  # noqa: E402
from runtime.samples import Sample  # noqa: E402
from runtime.spec import load_spec  # noqa: E402
from runtime.train.parallel import training_state_bytes  # noqa: E402
from runtime.train.trainer import Trainer  # noqa: E402

CONFIGS = ("full", "lora", "lora-all")
LORA_CONFIGS = {
    "lora": {"r": 16, "alpha": 32.0},  # the default targets
    "lora-all": {
        "r": 16,
        "alpha": 32.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    },
}


def _spec(model: str, config: str, lr: float, **sections):
    data = {
        "seed": 0,
        "model": {"builtin": model, **({"lora": LORA_CONFIGS[config]} if config in LORA_CONFIGS else {})},
        "algorithm": {"name": "grpo", "group_size": 8, "kl_coef": 0.02},
        "trainer": {"lr": lr},
        "resources": {"threads_per_process": 2},
        "metrics": {"progress_bar": False},
        **sections,
    }
    return load_spec(data)


def _samples(prompts: int, group: int, seed: int = 0) -> list[Sample]:
    """A GRPO step's worth of synthetic samples: 8-24 prompt tokens, 4-48 response tokens, mixed rewards."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for p in range(prompts):
        prompt = [1, *torch.randint(4, 60, (int(torch.randint(8, 24, (1,), generator=gen)),), generator=gen).tolist()]
        for g in range(group):
            n = int(torch.randint(4, 48, (1,), generator=gen))
            out.append(
                Sample(
                    sample_id=p * group + g,
                    prompt_id=p,
                    group_id=p,
                    prompt_ids=prompt,
                    response_ids=torch.randint(4, 60, (n,), generator=gen).tolist(),
                    logprobs=[-2.0] * n,
                    versions=[0] * n,
                    finish_reason="stop",
                    reward=float(g % 3 == 0),
                    correct=g % 3 == 0,
                )
            )
    return out


def _trainer(model: str, config: str) -> tuple[Trainer, dict]:
    spec = _spec(model, config, lr=1e-4)
    policy, tok = build_policy(spec.model, "cpu", seed=0)
    trainer = Trainer(spec, policy, tok, "cpu")
    seen: dict = {}
    trainer.optimizer.register_step_pre_hook(lambda opt, *_: seen.update(training_state_bytes(policy, opt)))
    return trainer, seen


def state_and_sync(model: str, rounds: int, prompts: int) -> dict:
    samples = _samples(prompts, 8)
    out: dict = {}
    parts = {}
    for config in CONFIGS:
        trainer, seen = _trainer(model, config)
        trainer.train_step(samples, step=0)  # warm-up, and the optimizer's state now exists
        trainer.train_step(samples, step=1)  # the pre-hook read the state at this step's update
        engine_model, tok = build_policy(trainer.spec.model, "cpu", seed=0)
        engine = Engine(engine_model.eval(), tok, "cpu", owns_model=True)
        parts[config] = (trainer, seen, engine)
        total = sum(p.numel() for p in trainer.policy.parameters())
        trained = sum(p.numel() for p in trainer.policy.parameters() if p.requires_grad)
        out[config] = {"parameters": total, "trained_parameters": trained, **{f"{k}_bytes": v for k, v in seen.items()}}

    def measure(config: str, r: int) -> tuple[float, float]:
        trainer, _, engine = parts[config]
        started = time.perf_counter()
        trainer.train_step(samples, step=2 + r)
        step_s = time.perf_counter() - started
        published = {k: v.detach().clone() for k, v in trainer.publish_state().items()}  # as a sync sends it
        started = time.perf_counter()
        engine.update_weights(published, version=2 + r)
        engine.runner.load_weights()
        out[config]["sync_bytes"] = sum(t.numel() * t.element_size() for t in published.values())
        return step_s, time.perf_counter() - started

    for config, figures in interleaved(CONFIGS, rounds, measure).items():
        out[config]["step_s"] = statistics.median(step for step, _ in figures)
        out[config]["sync_s"] = statistics.median(sync for _, sync in figures)
    full = out["full"]
    out["ratios"] = {
        config: {
            "optimizer_state": lora["optimizer_bytes"] / full["optimizer_bytes"],
            "trained_state": (lora["params_bytes"] + lora["grads_bytes"] + lora["optimizer_bytes"])
            / (full["params_bytes"] + full["grads_bytes"] + full["optimizer_bytes"]),
            "sync_bytes": lora["sync_bytes"] / full["sync_bytes"],
            "sync_time": lora["sync_s"] / full["sync_s"],
            "step_time": lora["step_s"] / full["step_s"],
        }
        for config, lora in ((c, out[c]) for c in LORA_CONFIGS)
    }
    return out


def _high_water_mark() -> int:
    """This process's peak resident set since the last reset (Linux: VmHWM), in bytes."""
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024


def child_peak(model: str, config: str, steps: int, prompts: int) -> None:
    """In a fresh process: reset the peak resident set after the imports, build the model and trainer, train
    ``steps`` steps; print the resident set before and the peak since (bytes)."""
    torch.set_num_threads(2)
    samples = _samples(prompts, 8)
    Path("/proc/self/clear_refs").write_text("5")  # the peak restarts from the current resident set
    before = _high_water_mark()
    trainer, _ = _trainer(model, config)
    for step in range(steps):
        trainer.train_step(samples, step=step)
    print(json.dumps({"before": before, "peak": _high_water_mark()}))


def peak_memory(model: str, steps: int, prompts: int) -> dict:
    out = {}
    for config in CONFIGS:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            config,
            "--model",
            model,
            "--steps",
            str(steps),
            "--prompts",
            str(prompts),
        ]
        got = json.loads(
            subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        )
        out[config] = {**got, "added": got["peak"] - got["before"]}
    out["ratio_added"] = {config: out[config]["added"] / out["full"]["added"] for config in LORA_CONFIGS}
    return out


def learning(model: str, sft_steps: int, steps: int, eval_size: int, lrs: dict[str, float]) -> dict:
    from runtime.pipeline import run
    from runtime.train.sft import run_sft

    task = {"name": "reverse", "min_len": 1, "max_len": 6, "train_size": 8192, "eval_size": eval_size}
    out: dict = {"sft_steps": sft_steps, "steps": steps, "eval_size": eval_size, "lr": lrs}
    with tempfile.TemporaryDirectory() as tmp:
        warm = Path(tmp) / "sft"
        sft_spec = _spec(model, "full", lr=1e-3, task=task)
        run_sft(sft_spec, steps=sft_steps, out_dir=warm, lr=1e-3, log=None)
        for config in CONFIGS:
            spec = _spec(
                model,
                config,
                lrs[config],
                task=task,
                rollout={"max_new_tokens": 12},
                pipeline={"mode": "sync", "steps": steps, "prompts_per_step": 8, "eval_interval": steps},
                checkpoint={"interval": 0},
                output_dir=str(Path(tmp) / config),
            )
            spec = spec.model_copy(update={"model": spec.model.model_copy(update={"path": str(warm)})})
            started = time.perf_counter()
            result = run(spec)
            wall = time.perf_counter() - started
            evals = result["eval"]
            first, last = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
            out[config] = {
                "eval_start": first,
                "eval_end": last,
                "eval_se": math.sqrt(max(last * (1 - last), 1e-9) / eval_size),
                # the whole run's, start-up and evaluations included (the last step's own figure is noisy)
                "samples_per_s": steps * 8 * 8 / wall,
                "wall_s": wall,
            }
    out["samples_per_s_ratio"] = {
        config: out[config]["samples_per_s"] / out["full"]["samples_per_s"] for config in LORA_CONFIGS
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny-qwen2, a few steps (< 1 min)")
    parser.add_argument("--lr-full", type=float, default=5e-5, help="GRPO learning rate, full fine-tuning")
    parser.add_argument("--lr-lora", type=float, default=5e-4, help="GRPO learning rate, LoRA (usually 10x)")
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--prompts", type=int, default=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_peak(args.model, args.child, args.steps, args.prompts)
        return
    torch.set_num_threads(2)
    model = "tiny-qwen2" if args.quick else "medium-qwen2"
    prompts = 2 if args.quick else 4
    results = {
        "model": model,
        "state_and_sync": state_and_sync(model, rounds=3 if args.quick else 5, prompts=prompts),
        "peak_memory": peak_memory(model, steps=2 if args.quick else 3, prompts=prompts),
        "learning": learning(
            model,
            sft_steps=30 if args.quick else 150,
            steps=6 if args.quick else 40,
            eval_size=32 if args.quick else 256,
            lrs={"full": args.lr_full, "lora": args.lr_lora, "lora-all": args.lr_lora},
        ),
    }
    for part, figures in results.items():
        if isinstance(figures, dict):
            print(
                part,
                json.dumps({k: v for k, v in figures.items() if k in ("ratios", "ratio_added", "samples_per_s_ratio")}),
            )
    print(json.dumps({"benchmark": "lora", "quick": args.quick, **results}))


if __name__ == "__main__":
    main()
