"""LoRA on the real vLLM (0.30, CPU build): each weight version's adapters reach vLLM as a ``LoRARequest`` and it
generates with them as the trainer scores them; a request keeps the adapter it started with across an update;
old adapters are dropped; sync and async runs train the adapters with vLLM rollout, their checkpoints hold the
adapters, and the adapter directory they export is what vLLM serves."""

from __future__ import annotations

import pytest
import torch

from runtime.metrics import read_jsonl
from runtime.models import build_policy
from runtime.models.lora import adapter_state, adapters_disabled, is_adapter_key
from runtime.models.tokenizer import load_tokenizer
from runtime.rollout.sampling import SamplingParams
from runtime.rollout.vllm_adapter import VLLMEngine
from runtime.spec import load_spec
from tests.vllm.helpers import vllm_spec
from tests.vllm.test_engine import gap, prompts
from tests.vllm.test_runs import assert_weights_landed, run

torch.set_num_threads(1)
LORA = {"r": 8, "alpha": 16.0}
SAMPLE = SamplingParams(max_new_tokens=8, temperature=1.0, n=2, ignore_eos=True)


def _adapters(model, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter_key(name):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return {k: v.clone() for k, v in adapter_state(model.state_dict()).items()}


@pytest.fixture(scope="module")
def lora_engine(base_model):
    spec = load_spec({"model": {"path": str(base_model), "lora": LORA}, "rollout": {"engine": "vllm"}})
    trainer, _ = build_policy(spec.model, "cpu", seed=0)
    engine = VLLMEngine(
        str(base_model),
        load_tokenizer(base_model),
        "cpu",
        dtype="float32",
        kv_cache_bytes=128 << 20,
        max_batch_size=16,
        lora=spec.model.lora,
    )
    return engine, trainer.eval()


def test_vllm_generates_with_each_versions_adapters_and_drops_the_old(lora_engine):
    engine, trainer = lora_engine
    tokenizer = engine.tokenizer
    ids = prompts(tokenizer)
    base = engine.generate(ids, SAMPLE, torch.Generator().manual_seed(0))  # version 0: the base model
    with adapters_disabled(trainer):
        assert gap(trainer, ids, base) < 1e-4
    sent = _adapters(trainer, seed=1)
    engine.update_weights(sent, 1)
    assert engine.last_update["bytes"] == sum(t.numel() * t.element_size() for t in sent.values())
    adapted = engine.generate(ids, SAMPLE, torch.Generator().manual_seed(0))
    assert gap(trainer, ids, adapted) < 1e-4
    with adapters_disabled(trainer):
        assert gap(trainer, ids, adapted) > 1e-2  # vLLM did apply them
    engine.update_weights(_adapters(trainer, seed=2), 2)
    assert gap(trainer, ids, engine.generate(ids, SAMPLE, torch.Generator().manual_seed(0))) < 1e-4
    assert set(engine.adapters.requests) == {2}  # version 1's adapter is gone, from vLLM and from disk
    assert engine.llm.llm_engine.list_loras() == {3}


def test_a_request_keeps_its_adapter_and_version_across_an_update(lora_engine):
    engine, trainer = lora_engine
    ids = prompts(engine.tokenizer, 2)
    engine.update_weights(_adapters(trainer, seed=3), 3)
    v3 = {k: v.clone() for k, v in adapter_state(trainer.state_dict()).items()}
    batcher = engine.batcher(SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True))
    for j, prompt in enumerate(ids):
        batcher.submit(prompt, j)
    done = list(batcher.step())
    engine.update_weights(_adapters(trainer, seed=4), 4)  # while both requests run
    assert 3 in engine.adapters.requests  # still in use
    while not batcher.idle:
        done += batcher.step()
    assert sorted(tag for tag, _ in done) == [0, 1]
    assert all(set(c.versions) == {3} for _, c in done)
    with torch.no_grad():
        trainer.load_state_dict(v3, strict=False)
    completions = [c for _, c in sorted(done, key=lambda d: d[0])]
    for j, c in enumerate(completions):
        c.prompt_index = j
    assert gap(trainer, ids, completions) < 1e-4
    engine.update_weights(_adapters(trainer, seed=5), 5)
    assert set(engine.adapters.requests) == {5}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_lora_run_trains_the_adapters_with_vllm_rollout(tmp_path, sft_model, mode):
    data = vllm_spec(
        tmp_path,
        mode,
        sft_model,
        trainer={"lr": 1e-2},
        algorithm={"kl_coef": 0.02},
        pipeline={"mode": mode, "steps": 4, "max_policy_lag": 1},
        checkpoint={"interval": 4},
    )
    data["model"]["lora"] = LORA
    steps, _ = run(tmp_path, data)
    assert [r["weights/version"] for r in steps] == [1, 2, 3, 4]
    assert_weights_landed(steps)
    checkpoint = tmp_path / mode / "checkpoints" / "step-00000004"
    assert (checkpoint / "policy" / "adapter" / "adapter_model.safetensors").is_file()
    records, _ = read_jsonl(tmp_path / mode / "metrics.jsonl")
    assert any(r.get("kl_ref", 0) > 0 for r in records)
