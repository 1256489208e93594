"""Models: built-in configs, HF save/load, tokenizers, scoring, and the PPO critic."""

from __future__ import annotations

import pytest
import torch

from runtime.models import (
    CharTokenizer,
    HFTokenizer,
    ModelError,
    ValueModel,
    build_policy,
    load_tokenizer,
    save_hf,
    token_logprobs,
)
from runtime.spec import ModelSpec

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model, tok = build_policy(ModelSpec(builtin="tiny-qwen2"), "cpu", seed=2)
    out = save_hf(model, tok, tmp_path_factory.mktemp("policy"))
    return model, tok, out


def sample_ids(tok):
    return torch.tensor([tok.encode_prompt("reverse:abc=cba")])


@pytest.mark.parametrize(
    "name,model_type,layers,hidden",
    [("tiny-qwen2", "qwen2", 2, 128), ("tiny-llama", "llama", 2, 128), ("small-qwen2", "qwen2", 4, 256)],
)
def test_builtin_architectures(name, model_type, layers, hidden):
    model, tok = build_policy(ModelSpec(builtin=name), "cpu")
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == (model_type, layers, hidden)
    assert cfg.vocab_size == tok.vocab_size == 100
    assert (cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id) == (tok.eos_id, tok.pad_id, tok.bos_id)
    assert isinstance(tok, CharTokenizer)


def test_builtin_init_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(0)
    expected_next = torch.rand(1)
    torch.manual_seed(0)
    a, _ = build_policy(ModelSpec(), "cpu", seed=1)
    assert torch.equal(torch.rand(1), expected_next)
    b, _ = build_policy(ModelSpec(), "cpu", seed=1)
    c, _ = build_policy(ModelSpec(), "cpu", seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.mlp.up_proj.weight"], sc["model.layers.0.mlp.up_proj.weight"])


def test_dtype_is_applied():
    model, _ = build_policy(ModelSpec(dtype="bfloat16"), "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_char_tokenizer_roundtrip(tmp_path):
    tok = CharTokenizer()
    text = "reverse:Hello, World 123!\n~"
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.encode_prompt("ab") == [tok.bos_id, *tok.encode("ab")]
    assert tok.decode([tok.bos_id, *tok.encode("ab"), tok.eos_id, tok.pad_id]) == "ab"
    assert tok.encode("é") == [tok.unk_id]
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 100)
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert isinstance(again, CharTokenizer) and again.encode(text) == ids


@pytest.mark.parametrize("builtin", ["tiny-qwen2", "tiny-llama"])
def test_char_tokenizer_exports_an_equivalent_hf_tokenizer(tmp_path, builtin):
    from transformers import AutoTokenizer

    model, tok = build_policy(ModelSpec(builtin=builtin), "cpu")
    save_hf(model, tok, tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    text = "x  y\n\nz! repeat 3:ab=ababab"
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    assert hf.decode(tok.encode(text)) == text
    assert (hf.eos_token_id, hf.pad_token_id, hf.bos_token_id, len(hf)) == (2, 0, 1, 100)


def test_save_hf_roundtrip_with_transformers_and_build_policy(saved):
    from transformers import AutoModelForCausalLM

    model, tok, out = saved
    names = {p.name for p in out.iterdir()}
    assert {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "char_tokenizer.json",
    } <= names
    ids = sample_ids(tok)
    with torch.no_grad():
        want = model(ids).logits
        hf = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
        assert torch.equal(hf(ids).logits, want)
        loaded, loaded_tok = build_policy(ModelSpec(path=str(out)), "cpu")
        assert torch.equal(loaded(ids).logits, want)
    assert isinstance(loaded_tok, CharTokenizer)


def test_directory_without_char_tokenizer_uses_its_hf_tokenizer(saved, tmp_path):
    import shutil

    _, tok, out = saved
    copy = tmp_path / "hfonly"
    shutil.copytree(out, copy)
    (copy / "char_tokenizer.json").unlink()
    _, hf_tok = build_policy(ModelSpec(path=str(copy)), "cpu")
    assert isinstance(hf_tok, HFTokenizer)
    assert hf_tok.encode("abc=") == tok.encode("abc=")
    assert (hf_tok.eos_id, hf_tok.pad_id, hf_tok.bos_id) == (tok.eos_id, tok.pad_id, tok.bos_id)
    assert hf_tok.decode(tok.encode("a b")) == "a b"


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match="model.path: no such model directory"):
        build_policy(ModelSpec(path=str(tmp_path / "nope")), "cpu")
    with pytest.raises(ModelError, match="has no config.json"):
        build_policy(ModelSpec(path=str(tmp_path)), "cpu")


def test_token_logprobs_matches_manual_and_ignores_padding_side(saved):
    model, tok, _ = saved
    seqs = [tok.encode_prompt("copy:ab=ab"), tok.encode_prompt("copy:abcd=abcd")]
    width = max(map(len, seqs))
    right = torch.zeros(2, width, dtype=torch.long)
    right_mask = torch.zeros_like(right)
    left = torch.zeros_like(right)
    left_mask = torch.zeros_like(right)
    for r, s in enumerate(seqs):
        right[r, : len(s)], right_mask[r, : len(s)] = torch.tensor(s), 1
        left[r, width - len(s) :], left_mask[r, width - len(s) :] = torch.tensor(s), 1
    with torch.no_grad():
        lp_right = token_logprobs(model, right, right_mask)
        lp_left = token_logprobs(model, left, left_mask)
        lp_hot = token_logprobs(model, right, right_mask, temperature=0.5)
        single = torch.tensor([seqs[0]])
        manual = model(single).logits[0, :-1].log_softmax(-1).gather(-1, single[0, 1:, None]).squeeze(-1)
    assert lp_right.shape == (2, width - 1)
    n0 = len(seqs[0]) - 1
    assert torch.allclose(lp_right[0, :n0], manual, atol=1e-5)
    assert torch.allclose(lp_left[0, width - 1 - n0 :], lp_right[0, :n0], atol=1e-5)
    assert not torch.allclose(lp_hot[0, :n0], lp_right[0, :n0], atol=1e-3)


def test_value_model_is_an_independent_critic(saved):
    model, tok, _ = saved
    before = {k: v.clone() for k, v in model.state_dict().items()}
    critic = ValueModel.from_policy(model)
    ids = torch.tensor([tok.encode_prompt("abc"), tok.encode_prompt("xyz")])
    values = critic(ids)
    assert values.shape == (2, ids.shape[1]) and values.dtype == torch.float32
    assert torch.equal(values, torch.zeros_like(values))  # zero-initialised head
    opt = torch.optim.SGD(critic.parameters(), lr=0.1)
    for _ in range(3):
        loss = (critic(ids, torch.ones_like(ids)) - 1.0).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert critic(ids).mean().item() > 0.1  # it learns
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # policy untouched
