"""A real tokenizer path end to end, offline: a BPE tokenizer with a chat template trained here in a small Qwen2
directory (`make-model`), SFT on a dataset file with the template (`sft`), a short GRPO run from the SFT output
(`run`) that writes a checkpoint, and the checkpoint's HF policy reloaded by transformers, generating."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtime.__main__ import main
from runtime.checkpoint import load_checkpoint
from runtime.metrics import read_jsonl
from runtime.models import load_tokenizer
from runtime.models.local_hf import TURN_START
from runtime.pipeline.driver import RunContext
from runtime.pipeline.inline import InlineMode
from runtime.spec import load_spec
from runtime.tasks import build_task
from runtime.train.sft import SFT_METRICS_FILE, encode_example

torch.set_num_threads(1)

ROWS = [
    {"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
    for a in range(6)
    for b in range(6)
]
SYSTEM = "Add the numbers."
TEMPLATED = "<|im_start|>system\n" + SYSTEM + "<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


def spec_data(tmp: Path, data: Path, model: Path, out: str) -> dict:
    return {
        "name": out,
        "output_dir": str(tmp / out),
        "seed": 1,
        "model": {"path": str(model)},
        "task": {"name": "dataset", "path": str(data), "system_prompt": SYSTEM, "chat_template": True, "eval_size": 6},
        "algorithm": {"name": "grpo", "group_size": 4, "entropy_coef": 0.01},
        "trainer": {"lr": 1e-3},
        "rollout": {"max_new_tokens": 16, "max_batch_size": 16},
        "pipeline": {"steps": 2, "prompts_per_step": 4, "eval_interval": 2},
        "checkpoint": {"interval": 2},
        "resources": {"threads_per_process": 1},
        "metrics": {"progress_bar": False},
    }


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """make-model -> sft -> run, each through the command line; what each wrote."""
    tmp = tmp_path_factory.mktemp("bpe")
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    base, sft = tmp / "base", tmp / "sft"
    assert main(["make-model", str(base), "--from-task", "dataset", f"task.path={data}", "--vocab-size", "400"]) == 0
    spec_file = tmp / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec_data(tmp, data, base, "run")))
    assert main(["sft", str(spec_file), "--steps", "60", "--out", str(sft)]) == 0
    assert main(["run", str(spec_file), f"model.path={sft}"]) == 0
    return {"tmp": tmp, "data": data, "base": base, "sft": sft, "run": tmp / "run", "spec_file": spec_file}


def test_sft_trains_on_the_chat_templated_prompt_and_reports_accuracy(pipeline):
    spec = load_spec(pipeline["spec_file"])
    tok = load_tokenizer(pipeline["base"])
    task = build_task(spec.task, spec.model.path)
    prompt = task.train_prompts()[0]
    ids, n_prompt = encode_example(tok, prompt)  # what run_sft trains on, prompt by prompt
    question = next(r["question"] for r in ROWS if TEMPLATED.format(q=r["question"]) == prompt.text)
    assert tok.hf.decode(ids[:n_prompt]) == TEMPLATED.format(q=question)
    assert ids[0] == tok.hf.convert_tokens_to_ids(TURN_START) and ids[-1] == tok.eos_id
    metrics = json.loads((pipeline["sft"] / SFT_METRICS_FILE).read_text())
    assert metrics["steps"] == 60 and metrics["loss"] < 2.0
    assert 0.0 <= metrics["eval/accuracy_greedy"] <= 1.0 and 0.0 <= metrics["eval/accuracy_sampled_t1"] <= 1.0


def test_the_grpo_run_generates_from_templated_prompts_and_reports_reward_and_accuracy(pipeline):
    tmp = pipeline["tmp"]
    steps, _ = read_jsonl(pipeline["run"] / "metrics.jsonl")
    trained = [s for s in steps if "reward/mean" in s]
    assert [s["step"] for s in trained] == [1, 2]
    assert all(0.0 <= s["reward/mean"] <= 1.0 and 0.0 <= s["accuracy"] <= 1.0 for s in trained)
    assert any("eval/accuracy" in s for s in steps)

    # The samples a step trains on, made by the run's own generator from the same spec.
    spec = load_spec(spec_data(tmp, pipeline["data"], pipeline["sft"], "probe"))
    ctx = RunContext(spec, None)
    try:
        samples, _ = InlineMode(ctx).generate(spec.items_per_step, 0)
    finally:
        ctx.close_trainer()
        ctx.reporters.close()
    hf = load_tokenizer(pipeline["sft"]).hf
    templated = {TEMPLATED.format(q=r["question"]) for r in ROWS}
    assert len(samples) == spec.items_per_step * spec.algorithm.group_size
    assert all(hf.decode(s.prompt_ids) in templated for s in samples)


def test_the_checkpoints_policy_reloads_in_transformers_with_the_trained_weights_and_tokenizer(pipeline):
    ckpt = pipeline["run"] / "checkpoints" / "step-00000002"
    policy_dir = ckpt / "policy"
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(policy_dir), local_files_only=True)

    saved = load_checkpoint(ckpt, ["trainer"])["trainer"]["policy"]
    reloaded = model.state_dict()
    assert set(saved) <= set(reloaded)
    assert all(torch.equal(saved[k], reloaded[k]) for k in saved)
    start = AutoModelForCausalLM.from_pretrained(str(pipeline["sft"]), local_files_only=True).state_dict()
    assert any(not torch.equal(start[k], reloaded[k]) for k in saved)  # GRPO changed the weights

    base = AutoTokenizer.from_pretrained(str(pipeline["base"]), local_files_only=True)
    text = "What is 12 + 30?\n#### 42 ✓"
    assert tokenizer.encode(text) == base.encode(text)  # the tokenizer came through SFT, the run and save_hf
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.chat_template == base.chat_template

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2 + 3?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert tokenizer.decode(prompt["input_ids"][0]) == TEMPLATED.format(q="What is 2 + 3?")
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    reply = out[0, prompt["input_ids"].shape[1] :].tolist()
    assert 1 <= len(reply) <= 12
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == 2
    assert isinstance(tokenizer.decode(reply, skip_special_tokens=True), str)
