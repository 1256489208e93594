"""Supervised warm start: teach the policy the task's (prompt, answer) pairs so RL starts from a
policy that sometimes succeeds.

``run_sft`` trains on the prompt as the model is prompted with it (``encode_prompt``: ``bos + prompt`` with
the character tokenizer; the task's text, chat template included, with a model directory's tokenizer), then
the answer and eos, with the loss on the answer and eos tokens only (token mean), AdamW with a short linear
warm-up and linear decay, then measures held-out accuracy greedily and by sampling at temperature 1 and saves
an HF model directory usable as ``model.path`` (with ``sft_metrics.json`` beside it). GRPO learns from groups
with mixed outcomes, so the useful amount of SFT leaves sampled accuracy well above zero and well below one;
``steps`` is the knob.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runtime.devices import manual_seed_all, resolve_device, set_threads
from runtime.models import build_policy, save_hf
from runtime.rollout.engine import Engine, SamplingParams
from runtime.samples import Prompt
from runtime.tasks import Task, build_task
from runtime.train.optimizer import AdamW

SFT_METRICS_FILE = "sft_metrics.json"


def encode_example(tokenizer: Any, prompt: Prompt) -> tuple[list[int], int]:
    """(token ids of prompt + answer + eos, number of prompt tokens)."""
    prompt_ids = tokenizer.encode_prompt(prompt.text)
    return prompt_ids + tokenizer.encode(prompt.answer) + [tokenizer.eos_id], len(prompt_ids)


def sft_batch(
    examples: list[tuple[list[int], int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, loss_mask) [B, T]; loss_mask marks answer tokens as targets."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    loss_mask = torch.zeros(len(examples), width, dtype=torch.bool)
    for r, (seq, n_prompt) in enumerate(examples):
        ids[r, : len(seq)] = torch.tensor(seq)
        attn[r, : len(seq)] = 1
        loss_mask[r, n_prompt : len(seq)] = True
    return ids.to(device), attn.to(device), loss_mask.to(device)


def sft_loss(model: Any, ids: torch.Tensor, attn: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy of the target tokens (position t predicts token t+1)."""
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
    targets = ids[:, 1:]
    mask = loss_mask[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return (nll * mask).sum() / mask.sum().clamp(min=1)


def accuracy(
    engine: Engine,
    task: Task,
    prompts: list[Prompt],
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> float:
    """Fraction of completions the task scores correct (n per prompt as in ``params``)."""
    tok = engine.tokenizer
    outs = engine.generate([tok.encode_prompt(p.text) for p in prompts], params, generator)
    correct = sum(task.score(prompts[c.prompt_index], tok.decode(c.token_ids))[1] for c in outs)
    return correct / max(1, len(outs))


def _lr_factor(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return max(0.1, 1.0 - (step - warmup) / max(1, steps - warmup))


def run_sft(
    spec: Any,
    steps: int,
    out_dir: str | Path,
    *,
    lr: float = 3e-3,
    batch_size: int = 32,
    log: Callable[[str], None] | None = print,
    log_every: int = 50,
) -> Path:
    """Fine-tune ``spec.model`` on ``spec.task``'s training pairs for ``steps`` steps; save to ``out_dir``.

    ``lr`` and ``batch_size`` are SFT's own (RL's ``trainer.lr`` is usually far smaller).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if batch_size < 1 or lr <= 0:
        raise ValueError("batch_size must be >= 1 and lr > 0")
    set_threads(spec.resources.threads_per_process)
    device = resolve_device(spec.resources.device)
    task = build_task(spec.task, spec.model.path)  # a bad dataset fails before the model is built
    manual_seed_all(spec.seed)
    model, tok = build_policy(spec.model, device, seed=spec.seed)
    examples = [encode_example(tok, p) for p in task.train_prompts()]

    model.train()
    # with model.lora only the adapters require gradients, and only they get optimizer state
    optim = AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=spec.trainer.weight_decay)
    warmup = max(1, min(50, steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: _lr_factor(s, steps, warmup))
    gen = torch.Generator().manual_seed(spec.seed)
    started = time.perf_counter()
    loss_value = float("nan")
    for step in range(steps):
        pick = torch.randint(len(examples), (batch_size,), generator=gen).tolist()
        ids, attn, mask = sft_batch([examples[i] for i in pick], tok.pad_id, device)
        loss = sft_loss(model, ids, attn, mask)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.trainer.grad_clip)
        optim.step()
        sched.step()
        loss_value = loss.item()
        if log and (step + 1) % log_every == 0:
            log(f"sft step {step + 1}/{steps} loss {loss_value:.4f}")
    model.eval()

    engine = Engine(model, tok, device, max_batch_size=spec.rollout.max_batch_size)
    evals = task.eval_prompts()
    max_new = spec.rollout.max_new_tokens
    stops = tuple(tok.stop_ids)  # a model directory may end replies at ids besides eos
    greedy = accuracy(engine, task, evals, SamplingParams(max_new, temperature=0, stop_ids=stops))
    sample_gen = torch.Generator(device=device).manual_seed(spec.seed)
    sampled_params = SamplingParams(max_new, temperature=1.0, n=4, stop_ids=stops)
    sampled = accuracy(engine, task, evals, sampled_params, sample_gen)
    metrics = {
        "steps": steps,
        "loss": loss_value,
        "eval/accuracy_greedy": greedy,
        "eval/accuracy_sampled_t1": sampled,
        "seconds": round(time.perf_counter() - started, 2),
    }
    out = save_hf(model, tok, out_dir)
    (out / SFT_METRICS_FILE).write_text(json.dumps(metrics, indent=2))
    if log:
        log(f"sft done: loss {loss_value:.4f}, eval accuracy greedy {greedy:.3f}, sampled(T=1) {sampled:.3f} -> {out}")
    return out
