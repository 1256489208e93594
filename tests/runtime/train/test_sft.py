"""Supervised warm start: it must actually teach a tiny model the task, and save a loadable policy."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.devices import DeviceError
from runtime.models import CharTokenizer, build_policy
from runtime.rollout import Engine, SamplingParams
from runtime.spec import ModelSpec, load_spec
from runtime.tasks import TaskError, build_task
from runtime.train.sft import SFT_METRICS_FILE, accuracy, encode_example, run_sft, sft_batch

torch.set_num_threads(1)

SPEC = {
    "seed": 0,
    "task": {"name": "reverse", "min_len": 1, "max_len": 4, "train_size": 512, "eval_size": 32},
    "rollout": {"max_new_tokens": 8},
    "resources": {"threads_per_process": 1},
}


def test_encode_example_and_batch_mask_only_the_answer():
    tok = CharTokenizer()
    prompt = build_task(load_spec(SPEC).task).train_prompts()[0]
    ids, n_prompt = encode_example(tok, prompt)
    assert ids == [tok.bos_id, *tok.encode(prompt.text), *tok.encode(prompt.answer), tok.eos_id]
    assert n_prompt == len(prompt.text) + 1
    short = ([1, 5, 6, 2], 2)
    batch_ids, attn, mask = sft_batch([(ids, n_prompt), short], tok.pad_id, torch.device("cpu"))
    assert batch_ids[1].tolist()[:4] == [1, 5, 6, 2] and attn[1].sum().item() == 4
    assert mask[1].tolist()[:4] == [False, False, True, True] and not mask[1, 4:].any()
    assert mask[0].sum().item() == len(prompt.answer) + 1


def test_sft_raises_accuracy_and_saves_a_loadable_policy(tmp_path):
    spec = load_spec(SPEC)
    task = build_task(spec.task)
    fresh, tok = build_policy(spec.model, "cpu", seed=spec.seed)
    greedy = SamplingParams(8, temperature=0)
    before = accuracy(Engine(fresh, tok, "cpu"), task, task.eval_prompts(), greedy)

    out = run_sft(spec, steps=60, out_dir=tmp_path / "sft", log=None)

    trained, tok2 = build_policy(ModelSpec(path=str(out)), "cpu")
    after = accuracy(Engine(trained, tok2, "cpu"), task, task.eval_prompts(), greedy)
    metrics = json.loads((out / SFT_METRICS_FILE).read_text())
    assert before <= 0.05
    assert after >= before + 0.25
    assert metrics["eval/accuracy_greedy"] == pytest.approx(after)
    assert 0.0 < metrics["eval/accuracy_sampled_t1"] < 1.0  # some but not all samples succeed: GRPO's regime
    assert metrics["steps"] == 60


def test_sft_bad_inputs_fail_before_training(tmp_path):
    with pytest.raises(ValueError, match="steps must be >= 1"):
        run_sft(load_spec(SPEC), steps=0, out_dir=tmp_path / "a", log=None)
    with pytest.raises(TaskError, match="no such file"):
        run_sft(load_spec({"task": {"name": "jsonl", "path": str(tmp_path / "x.jsonl")}}), 5, tmp_path / "b", log=None)
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError):
            run_sft(load_spec({"resources": {"device": "cuda"}}), 5, tmp_path / "c", log=None)
    assert not any(tmp_path.iterdir())  # nothing written
