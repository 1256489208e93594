"""A ``model.path`` checkpoint the plain decoder computes exactly as transformers does (a built-in's export,
an SFT checkpoint such as the demo's, a Qwen2 directory transformers wrote) loads without transformers' model
classes; every other checkpoint still loads through transformers, so nothing is computed differently."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.models import ModelError, build_policy, save_hf
from runtime.models.decoder import DecoderForCausalLM
from runtime.models.hf_files import plain_config
from runtime.spec import ModelSpec
from tests.runtime.test_builtin_imports import imported_by_a_run, transformers_model_modules


def _export(tmp_path, builtin: str = "tiny-qwen2", seed: int = 3):
    model, tok = build_policy(ModelSpec(builtin=builtin), "cpu", seed=seed)
    return model, save_hf(model, tok, tmp_path / builtin)


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 90, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding, as the trainer's rows
    return ids, mask


@pytest.mark.parametrize("builtin", ["tiny-qwen2", "tiny-llama"])
def test_an_exported_builtin_loads_as_the_plain_decoder_with_transformers_logits(tmp_path, builtin):
    import transformers

    original, directory = _export(tmp_path, builtin)
    loaded, _ = build_policy(ModelSpec(builtin=None, path=str(directory), tokenizer="char"), "cpu")
    assert isinstance(loaded, DecoderForCausalLM)
    assert loaded.state_dict().keys() == original.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in original.state_dict().items())
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied, as transformers ties it
    assert all(p.requires_grad for p in loaded.parameters())
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True, dtype=torch.float32)
    ids, mask = _rows()
    with torch.no_grad():
        ours = loaded(input_ids=ids, attention_mask=mask).logits
        theirs = hf(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(ours, theirs)


def test_the_checkpoint_is_cast_to_the_spec_dtype(tmp_path):
    _, directory = _export(tmp_path)
    loaded, _ = build_policy(ModelSpec(builtin=None, path=str(directory), tokenizer="char", dtype="bfloat16"), "cpu")
    assert isinstance(loaded, DecoderForCausalLM)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert loaded.model.rotary_emb.inv_freq.dtype == torch.float32  # computed, never saved: as a built-in's


def test_a_qwen2_directory_transformers_wrote_loads_plainly_with_its_logits(tmp_path):
    import transformers

    from runtime.models.configs import builtin_config

    tok_ids = builtin_config("small-qwen2", 100, 0, 1, 2).to_dict()
    config = transformers.Qwen2Config(**{k: v for k, v in tok_ids.items() if k not in ("architectures", "dtype")})
    torch.manual_seed(5)
    hf = transformers.Qwen2ForCausalLM(config).eval()
    hf.save_pretrained(str(tmp_path / "qwen2"), safe_serialization=True)
    assert plain_config(tmp_path / "qwen2") is not None
    loaded, _ = build_policy(ModelSpec(builtin=None, path=str(tmp_path / "qwen2"), tokenizer="char"), "cpu")
    assert isinstance(loaded, DecoderForCausalLM)
    ids, mask = _rows()
    with torch.no_grad():
        assert torch.equal(
            loaded(input_ids=ids, attention_mask=mask).logits, hf(input_ids=ids, attention_mask=mask).logits
        )


CHANGES = {
    "rope scaling": lambda c: c.update(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
    "a sliding window": lambda c: c.update(use_sliding_window=True, sliding_window=4),
    "a key it does not know": lambda c: c.update(qk_layernorm=True),
    "another architecture": lambda c: c.update(architectures=["Qwen2ForSequenceClassification"]),
    "a default left to transformers": lambda c: c.pop("tie_word_embeddings"),
    "another activation": lambda c: c.update(hidden_act="gelu"),
}


@pytest.mark.parametrize("what", sorted(CHANGES))
def test_a_checkpoint_it_would_compute_otherwise_goes_to_transformers(tmp_path, what):
    _, directory = _export(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    CHANGES[what](config)
    (directory / "config.json").write_text(json.dumps(config))
    assert plain_config(directory) is None


def test_sharded_weights_load_plainly_as_the_single_file_does(tmp_path):
    original, directory = _export(tmp_path)
    state = load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(directory / shard), metadata={"format": "pt"})
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert plain_config(directory) is not None  # how it was saved does not decide the implementation
    loaded, _ = build_policy(ModelSpec(builtin=None, path=str(directory), tokenizer="char"), "cpu")
    assert isinstance(loaded, DecoderForCausalLM)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in original.state_dict().items())
    (directory / "model-00002-of-00002.safetensors").unlink()  # an index naming a missing shard: not plain
    assert plain_config(directory) is None


def test_weights_that_do_not_fit_the_config_are_a_model_path_error(tmp_path):
    _, directory = _export(tmp_path)
    state = load_file(str(directory / "model.safetensors"))
    state["model.norm.weight"] = torch.ones(7)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"^model.path: cannot load .*model.norm.weight is \(7,\)"):
        build_policy(ModelSpec(builtin=None, path=str(directory), tokenizer="char"), "cpu")
    del state["model.norm.weight"]
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"missing \['model.norm.weight'\]"):
        build_policy(ModelSpec(builtin=None, path=str(directory), tokenizer="char"), "cpu")


def test_a_run_from_an_exported_builtin_imports_no_transformers_model_class(tmp_path):
    _, directory = _export(tmp_path)
    overrides = ("model.builtin=null", f"model.path={directory}", "model.tokenizer=char")
    imported = imported_by_a_run(tmp_path / "run", *overrides)
    assert transformers_model_modules(imported) == []
