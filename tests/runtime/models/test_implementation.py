"""``model.implementation``: one implementation per run, chosen by what the model computes and the device
(never by how its directory was saved), recorded in the resolved spec; transformers' attention is a knob of
the transformers implementation only."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
import yaml

from runtime.models import ModelError, build_policy, save_hf
from runtime.models.decoder import DecoderForCausalLM
from runtime.models.implementation import choose_implementation
from runtime.spec import ModelSpec, SpecError, load_spec


def _export(tmp_path, builtin: str = "tiny-qwen2"):
    model, tok = build_policy(ModelSpec(builtin=builtin), "cpu", seed=3)
    return model, save_hf(model, tok, tmp_path / builtin)


def _path_spec(directory, **fields) -> ModelSpec:
    return ModelSpec(builtin=None, path=str(directory), tokenizer="char", **fields)


def test_builtins_run_plain_unless_transformers_is_asked_for_and_then_compute_the_same():
    plain, _ = build_policy(ModelSpec(builtin="tiny-qwen2"), "cpu", seed=4)
    assert isinstance(plain, DecoderForCausalLM)
    theirs, _ = build_policy(ModelSpec(builtin="tiny-qwen2", implementation="transformers"), "cpu", seed=4)
    assert isinstance(theirs, transformers.Qwen2ForCausalLM)
    assert all(torch.equal(theirs.state_dict()[k], v) for k, v in plain.state_dict().items())  # same seed, same draws
    ids = torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=0, atol=1e-6)
    assert choose_implementation(ModelSpec(builtin="tiny-qwen2"), "cuda") == "plain"  # on accelerators too


def test_a_sliding_window_size_beside_use_sliding_window_false_does_not_change_the_choice(tmp_path):
    # Qwen2.5 as published sets sliding_window with use_sliding_window false; transformers re-saves it as null.
    _, directory = _export(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    assert config["sliding_window"] is None
    assert choose_implementation(_path_spec(directory), "cpu") == "plain"
    config.update(sliding_window=32768, use_sliding_window=False, max_window_layers=21)
    (directory / "config.json").write_text(json.dumps(config))
    assert choose_implementation(_path_spec(directory), "cpu") == "plain"
    loaded, _ = build_policy(_path_spec(directory), "cpu")
    assert isinstance(loaded, DecoderForCausalLM)
    config.update(use_sliding_window=True)  # a window that acts: only transformers computes it
    (directory / "config.json").write_text(json.dumps(config))
    assert choose_implementation(_path_spec(directory), "cpu") == "transformers"


def test_auto_takes_transformers_on_accelerators_or_with_an_attention_asked_for(tmp_path):
    _, directory = _export(tmp_path)
    assert choose_implementation(_path_spec(directory), "cuda") == "transformers"
    assert choose_implementation(_path_spec(directory), "npu") == "transformers"
    assert choose_implementation(_path_spec(directory, attn_implementation="eager"), "cpu") == "transformers"
    loaded, _ = build_policy(_path_spec(directory, implementation="transformers", attn_implementation="eager"), "cpu")
    assert isinstance(loaded, transformers.Qwen2ForCausalLM) and loaded.config._attn_implementation == "eager"


def test_plain_asked_for_a_model_it_does_not_compute_is_an_error_naming_the_field(tmp_path):
    _, directory = _export(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=4)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelError, match=r"^model.implementation: the plain decoder does not compute .*sliding_window=4"
    ):
        build_policy(_path_spec(directory, implementation="plain"), "cpu")


def test_flash_attention_without_its_package_is_an_error_naming_the_field(tmp_path):
    _, directory = _export(tmp_path)
    spec = _path_spec(directory, implementation="transformers", attn_implementation="flash_attention_2")
    try:
        import flash_attn  # noqa: F401

        pytest.skip("flash_attn is installed here")
    except ImportError:
        pass
    with pytest.raises(ModelError, match=r"^model.attn_implementation: flash_attention_2 needs the flash_attn"):
        build_policy(spec, "cpu")


@pytest.mark.parametrize(
    "model",
    [
        {"builtin": "tiny-qwen2", "attn_implementation": "sdpa"},
        {"builtin": "tiny-qwen2", "implementation": "plain", "attn_implementation": "eager"},
    ],
)
def test_an_attention_where_the_plain_decoder_runs_is_refused_at_submit(model):
    with pytest.raises(SpecError) as err:
        load_spec({"model": model})
    assert [e["field"] for e in err.value.errors] == ["model.attn_implementation"]


def test_the_resolved_spec_records_the_implementation_that_ran(tmp_path):
    from runtime.pipeline import run

    _, directory = _export(tmp_path)
    spec = load_spec(
        {
            "name": "impl",
            "output_dir": str(tmp_path / "out"),
            "model": {"builtin": None, "path": str(directory), "tokenizer": "char"},
            "algorithm": {"group_size": 2},
            "rollout": {"max_new_tokens": 4},
            "pipeline": {"mode": "sync", "steps": 1, "eval_interval": 0, "prompts_per_step": 2},
            "metrics": {"progress_bar": False},
        }
    )
    assert spec.model.implementation == "auto"
    run(spec)
    resolved = yaml.safe_load((tmp_path / "out" / "resolved_spec.yaml").read_text())
    assert resolved["model"]["implementation"] == "plain"
