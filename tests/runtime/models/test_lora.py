"""LoRA adapters (runtime.models.lora): what trains, the base as reference, the merged export read back by
transformers and the adapter directory read back by peft itself, and the engine's fused path computing
what peft's layers compute."""

from __future__ import annotations

import pytest
import torch

from runtime.contract import ADAPTER_DIR
from runtime.models import ModelError, build_policy, save_hf
from runtime.models.lora import (
    adapter_state,
    adapters_disabled,
    apply_lora,
    is_adapter_key,
    is_lora,
    merged_state,
)
from runtime.rollout.engine import Engine
from runtime.rollout.sampling import SamplingParams
from runtime.spec import LoraSpec, RunSpec, SpecError, load_spec

IDS = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11], [1, 12, 13, 14, 2, 3, 4, 5]])


def _lora_policy(builtin="tiny-qwen2", seed=0, **lora):
    spec = RunSpec.model_validate({"model": {"builtin": builtin, "lora": {"r": 4, **lora}}})
    model, tok = build_policy(spec.model, "cpu", seed=seed)
    return model, tok, spec


def _trained(model, seed=1):
    """Adapters moved away from their zero-B start, as training would move them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter_key(name):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _logp(model, ids=IDS):
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.float(), -1)


def test_only_the_adapters_train_and_the_base_is_the_model_without_them():
    model, _, _ = _lora_policy()
    base, _ = build_policy(RunSpec().model, "cpu", seed=0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_key(n) for n in trainable)
    assert sum(p.numel() for n, p in model.named_parameters() if n in trainable) < 0.05 * sum(
        p.numel() for p in model.parameters()
    )
    # B starts at zero: the adapted model computes the base model's function
    torch.testing.assert_close(_logp(model), _logp(base), rtol=0, atol=0)
    _trained(model)
    assert (_logp(model) - _logp(base)).abs().max() > 1e-2
    with adapters_disabled(model):
        torch.testing.assert_close(_logp(model), _logp(base), rtol=0, atol=0)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable  # flags untouched
    assert (_logp(model) - _logp(base)).abs().max() > 1e-2  # adapters back on


def test_every_process_builds_the_same_adapters_from_the_seed():
    a, _, _ = _lora_policy(seed=5)
    b, _, _ = _lora_policy(seed=5)
    c, _, _ = _lora_policy(seed=6)
    sa, sb, sc = (adapter_state(m.state_dict()) for m in (a, b, c))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


def test_a_target_that_matches_nothing_is_an_error_naming_the_field():
    base, _ = build_policy(RunSpec().model, "cpu")
    with pytest.raises(ModelError, match=r"model.lora.target_modules: 'qproj' matches no linear layer.*q_proj"):
        apply_lora(base, LoraSpec(target_modules=["q_proj", "qproj"]))
    with pytest.raises(ModelError, match="lm_head"):  # the head is not adapted
        apply_lora(base, LoraSpec(target_modules=["lm_head"]))
    assert not is_lora(base)  # refused before anything was injected


@pytest.mark.parametrize(
    ("lora", "field"),
    [
        ({"r": 0}, "model.lora.r"),
        ({"alpha": 0}, "model.lora.alpha"),
        ({"dropout": 1.0}, "model.lora.dropout"),
        ({"target_modules": []}, "model.lora.target_modules"),
        ({"target_modules": ["qkv"]}, "model.lora.target_modules"),
    ],
)
def test_bad_lora_fields_are_refused_at_submit(lora, field):
    with pytest.raises(SpecError) as err:
        load_spec({"model": {"lora": lora}})
    assert field in {e["field"] for e in err.value.errors}


def test_lora_with_a_gym_workload_is_refused():
    with pytest.raises(SpecError) as err:
        load_spec({"workload": "gym", "env": {"id": "CartPole-v1"}, "model": {"lora": {"r": 4}}})
    assert any(e["field"] == "model.lora" and "workload llm" in e["message"] for e in err.value.errors)


def test_the_merged_state_is_the_adapted_model_without_adapters():
    model = _trained(_lora_policy()[0])
    plain, _ = build_policy(RunSpec().model, "cpu", seed=0)
    plain.load_state_dict(merged_state(model))
    torch.testing.assert_close(_logp(plain), _logp(model), rtol=0, atol=1e-5)
    with adapters_disabled(model):  # merging wrote nothing into the base
        base, _ = build_policy(RunSpec().model, "cpu", seed=0)
        torch.testing.assert_close(_logp(model), _logp(base), rtol=0, atol=0)


@pytest.mark.parametrize("implementation", ["plain", "transformers"])
def test_the_export_is_read_by_transformers_merged_and_by_peft_as_an_adapter(tmp_path, implementation):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    over = {"model": {"builtin": "tiny-qwen2", "implementation": implementation}}
    base_spec = RunSpec.model_validate(over)
    base, tok = build_policy(base_spec.model, "cpu", seed=0)
    save_hf(base, tok, tmp_path / "base")
    spec = RunSpec.model_validate(
        {"model": {**over["model"], "lora": {"r": 4, "target_modules": ["q_proj", "down_proj"]}}}
    )
    model = _trained(build_policy(spec.model, "cpu", seed=0)[0])
    save_hf(model, tok, tmp_path / "export", base_model=str(tmp_path / "base"))
    want = _logp(model)

    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), local_files_only=True).eval()
    torch.testing.assert_close(_logp(merged), want, rtol=0, atol=1e-5)
    assert not any("lora" in k for k in merged.state_dict())

    onto = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), local_files_only=True)
    adapted = PeftModel.from_pretrained(onto, str(tmp_path / "export" / ADAPTER_DIR)).eval()
    torch.testing.assert_close(_logp(adapted), want, rtol=0, atol=1e-5)
    assert sorted(adapted.peft_config["default"].target_modules) == ["down_proj", "q_proj"]


@pytest.mark.parametrize("owns_model", [True, False])
def test_the_engine_generates_with_the_adapters_as_the_trainer_scores_them(owns_model):
    trainer_model, tok, spec = _lora_policy(target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
    _trained(trainer_model)
    if owns_model:  # a rollout process's engine: its own base, the adapters sent by name
        engine_model, _ = build_policy(spec.model, "cpu", seed=0)
        engine = Engine(engine_model, tok, "cpu", owns_model=True)
        engine.update_weights({k: v.clone() for k, v in adapter_state(trainer_model.state_dict()).items()}, 1)
    else:  # colocated: the engine reads the trainer's module
        engine = Engine(trainer_model, tok, "cpu")
    assert type(engine.runner).__name__ == "FastRunner"
    prompts = [[1, 5, 6, 7], [1, 9, 10]]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True)
    for prompt, done in zip(prompts, engine.generate(prompts, params, torch.Generator().manual_seed(0)), strict=True):
        full = torch.tensor([prompt + list(done.token_ids)])
        logp = _logp(trainer_model, full)[0]
        want = [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(done.token_ids)]
        assert max(abs(a - b) for a, b in zip(want, done.logprobs, strict=True)) < 1e-5
    with adapters_disabled(trainer_model):  # and the adapters did change what it computes
        logp = _logp(trainer_model, full)[0]
        base = [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(done.token_ids)]
    assert max(abs(a - b) for a, b in zip(base, done.logprobs, strict=True)) > 1e-3


def test_a_lora_rank_vllm_cannot_serve_is_refused_at_submit():
    with pytest.raises(SpecError) as err:
        load_spec({"model": {"path": "/models/qwen", "lora": {"r": 1024}}, "rollout": {"engine": "vllm"}})
    assert any(e["field"] == "model.lora.r" and "vLLM" in e["message"] for e in err.value.errors)
