"""The local BPE model directory (runtime.models.local_hf) and the HF tokenizer's stop ids and decoding: what is
trained and saved, that transformers and build_policy load it with the same ids, and bad arguments."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtime.__main__ import main
from runtime.contract import EXIT_BAD_INPUT
from runtime.models import CharTokenizer, HFTokenizer, build_policy, load_tokenizer
from runtime.models.local_hf import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    MIN_VOCAB_SIZE,
    PAD_TOKEN,
    SUMMARY_FILE,
    TURN_START,
    build_local_model_dir,
    train_bpe_tokenizer,
)
from runtime.spec import ModelSpec

torch.set_num_threads(1)

CORPUS = [f"What is {a} + {b}?\n{a} + {b} = {a + b}\n#### {a + b}" for a in range(12) for b in range(12)]
# digits, newlines, spaces, punctuation, and characters the corpus never had (bytes the BPE starts from)
TEXT = "What is 10 + 11?\n\n#### 21 — héllo ünïcode 😀\t!"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_local_model_dir(tmp_path_factory.mktemp("m") / "model", corpus=CORPUS, vocab_size=300, seed=5)


def test_the_tokenizer_has_the_specials_a_merged_vocabulary_and_round_trips_any_text():
    hf = train_bpe_tokenizer(CORPUS, 300)
    assert [hf.convert_tokens_to_ids(t) for t in (PAD_TOKEN, TURN_START, EOS_TOKEN)] == [0, 1, 2]
    assert (hf.pad_token, hf.eos_token, hf.bos_token) == (PAD_TOKEN, EOS_TOKEN, None)
    assert MIN_VOCAB_SIZE < len(hf) <= 300  # merges were learned beyond the 256 bytes + 3 specials
    assert len(hf.encode("What is", add_special_tokens=False)) < len("What is")
    assert hf.decode(hf.encode(TEXT, add_special_tokens=False)) == TEXT
    # a special token written in text is that one id, not its characters
    assert hf.encode(f"{TURN_START}user", add_special_tokens=False)[0] == 1


def test_the_chat_template_renders_qwen_turns_with_the_generation_prompt():
    hf = train_bpe_tokenizer(CORPUS, 300)
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "What is 1 + 2?"}]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = hf.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=False)
    assert no_prompt == "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n"
    assert train_bpe_tokenizer(CORPUS, 300, chat_template=None).chat_template is None


def test_transformers_and_build_policy_load_the_directory_with_the_trained_ids(model_dir):
    trained = train_bpe_tokenizer(CORPUS, 300)  # the same corpus gives the same tokenizer
    auto = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    ids = trained.encode(TEXT, add_special_tokens=False)
    assert auto.encode(TEXT, add_special_tokens=False) == ids  # transformers' rebuilt Qwen2Tokenizer agrees
    assert auto.chat_template == CHAT_TEMPLATE

    model, tok = build_policy(ModelSpec(path=str(model_dir)), "cpu")
    assert isinstance(tok, HFTokenizer)
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.stop_ids) == (0, 2, None, (2,))
    assert tok.encode_prompt(TEXT) == ids == tok.encode(TEXT)  # Qwen adds no bos
    assert tok.decode(ids) == TEXT
    cfg = model.config
    assert (cfg.model_type, cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id) == ("qwen2", 2, 0, None)
    assert cfg.vocab_size % 64 == 0 and cfg.vocab_size >= tok.vocab_size  # padded rows, as released models have
    summary = json.loads((model_dir / SUMMARY_FILE).read_text())
    assert summary["parameters"] == sum(p.numel() for p in model.parameters())
    assert 50_000 < summary["parameters"] < 500_000
    assert summary["tokenizer_tokens"] == tok.vocab_size and summary["model_vocab_rows"] == cfg.vocab_size


def test_the_weights_are_seeded_and_leave_the_global_rng_alone(tmp_path, model_dir):
    torch.manual_seed(0)
    expected_next = torch.rand(1)
    torch.manual_seed(0)
    again = build_local_model_dir(tmp_path / "again", corpus=CORPUS, vocab_size=300, seed=5)
    assert torch.equal(torch.rand(1), expected_next)
    other = build_local_model_dir(tmp_path / "other", corpus=CORPUS, vocab_size=300, seed=6)
    a, b, c = (AutoModelForCausalLM.from_pretrained(str(d)).state_dict() for d in (model_dir, again, other))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])
    assert (again / "tokenizer.json").read_text() == (model_dir / "tokenizer.json").read_text()


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"vocab_size": 200}, "vocab_size: must be an integer >= 259"),
        ({"corpus": ["", ""]}, "corpus: no text to train the tokenizer on"),
        ({"corpus": ["What is", 3]}, "corpus: every item must be a string"),
        ({"architecture": "llama"}, "architecture: only qwen2 is supported, got 'llama'"),
        ({"num_heads": 3}, "num_heads: hidden_size 64 must split into 3 heads of even size"),
        ({"num_kv_heads": 3}, "num_kv_heads: must divide num_heads 4, got 3"),
        ({"num_layers": 0}, "num_layers: must be a positive integer, got 0"),
        ({"vocab_multiple": 0}, "vocab_multiple: must be a positive integer, got 0"),
    ],
)
def test_bad_arguments_name_the_argument_and_write_nothing(tmp_path, kwargs, problem):
    with pytest.raises(ValueError) as err:
        build_local_model_dir(tmp_path / "m", **{"corpus": CORPUS, "vocab_size": 300, **kwargs})
    assert str(err.value).startswith(problem)
    assert not (tmp_path / "m").exists()


def test_a_directory_with_files_is_not_overwritten(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="^directory: .* exists and is not an empty directory"):
        build_local_model_dir(tmp_path, corpus=CORPUS, vocab_size=300)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_make_model_builds_from_a_task_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["make-model", str(out), "--from-task", "copy", "task.train_size=64", "--vocab-size", "270"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["model_dir"] == str(out) and printed["chat_template"] is True
    assert load_tokenizer(out).decode(load_tokenizer(out).encode("copy:abc=abc")) == "copy:abc=abc"

    assert main(["make-model", str(tmp_path / "b"), "--from-task", "copy", "--layers", "0"]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err == "error: --layers: must be a positive integer, got 0\n"
    assert main(["make-model", str(tmp_path / "c"), "--from-task", "copy", "model.builtin=x"]) == EXIT_BAD_INPUT
    assert (
        capsys.readouterr().err == "error: make-model: only task.* overrides choose the corpus, got model.builtin=x\n"
    )
    assert main(["make-model", str(out), "--from-task", "copy"]) == EXIT_BAD_INPUT
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_hf_decode_drops_ids_past_the_tokenizer_and_stop_ids_come_from_the_generation_config(tmp_path, model_dir):
    tok = load_tokenizer(model_dir)
    ids = tok.encode("#### 21")
    assert tok.decode([*ids, tok.vocab_size, tok.vocab_size + 7, 2]) == "#### 21"

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0, 2, 10_000]}))
    assert load_tokenizer(tmp_path).stop_ids == (2, 0)  # eos first, no repeats, none past the vocabulary
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "<|im_end|>"}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id must be an id or a list of ids"):
        load_tokenizer(tmp_path)
    assert CharTokenizer().stop_ids == (CharTokenizer().eos_id,)
