"""The plain decoder of the built-in models against transformers' Qwen2 / Llama: the same initial weights
for a seed, the same config.json, the same logits and gradients (padded rows, position ids, a KV cache,
the trainer's shared-prefix continuation, fp32 and bf16), and an export transformers loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from runtime.models import CharTokenizer, ValueModel, build_policy, positions_from_mask, save_hf
from runtime.models.configs import BUILTIN_CONFIGS, MAX_POSITIONS
from runtime.models.decoder import DecoderForCausalLM
from runtime.samples import Sample
from runtime.spec import ModelSpec
from runtime.train.batches import collate_padded, collate_shared_prefix
from tests.runtime.helpers import ROOT

transformers = pytest.importorskip("transformers")

torch.set_num_threads(1)
BUILTINS = list(BUILTIN_CONFIGS)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def hf_config(name: str):
    """The transformers config the built-ins were made from before the plain decoder (the old builtin_config)."""
    tok = CharTokenizer()
    params = dict(BUILTIN_CONFIGS[name])
    cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[params.pop("model_type")]
    return cls(
        vocab_size=tok.vocab_size,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_id,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        **params,
    )


def hf_model(name: str, dtype: str, seed: int):
    """What build_policy returned before: transformers' model drawn from ``seed`` inside fork_rng."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(
            hf_config(name), dtype=DTYPES[dtype], attn_implementation="sdpa"
        )


def pair(name: str, dtype: str = "float32", seed: int = 0):
    mine, _ = build_policy(ModelSpec(builtin=name, dtype=dtype), "cpu", seed=seed)
    return mine, hf_model(name, dtype, seed)


@pytest.mark.parametrize("name", BUILTINS)
@pytest.mark.parametrize(("dtype", "seed"), [("float32", 0), ("float32", 1), ("float32", 12345), ("bfloat16", 3)])
def test_initial_weights_are_transformers_bit_for_bit(name, dtype, seed):
    mine, hf = pair(name, dtype, seed)
    ours, theirs = mine.state_dict(), hf.state_dict()
    assert list(ours) == list(theirs)  # same names, same order
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    assert mine.lm_head.weight is mine.model.embed_tokens.weight  # tied, as transformers ties it
    buffers = dict(mine.named_buffers())
    assert torch.equal(buffers["model.rotary_emb.inv_freq"], dict(hf.named_buffers())["model.rotary_emb.inv_freq"])


@pytest.mark.parametrize("name", BUILTINS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_exported_directory_is_what_transformers_writes(name, dtype, tmp_path):
    mine, hf = pair(name, dtype)
    save_hf(mine, CharTokenizer(), tmp_path / "ours")
    hf.save_pretrained(str(tmp_path / "theirs"), safe_serialization=True)
    for file in ("config.json", "generation_config.json"):
        ours, theirs = (json.loads((tmp_path / d / file).read_text()) for d in ("ours", "theirs"))
        assert ours == theirs, file
    assert mine.config.replace(dtype=dtype).to_dict() == json.loads((tmp_path / "theirs" / "config.json").read_text())
    from safetensors.torch import load_file

    ours_w, theirs_w = (
        load_file(str(tmp_path / "ours" / "model.safetensors")),
        load_file(str(tmp_path / "theirs" / "model.safetensors")),
    )
    assert sorted(ours_w) == sorted(theirs_w) and "lm_head.weight" not in ours_w  # the tied head is left out
    assert all(torch.equal(ours_w[k], theirs_w[k]) for k in theirs_w)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), local_files_only=True)
    assert type(loaded).__name__ == type(hf).__name__ and loaded.dtype == DTYPES[dtype]
    ids = torch.tensor([CharTokenizer().encode_prompt("reverse:abc=cba")])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, mine(ids).logits)


def _rows(lengths: list[int], width: int, left: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        cols = slice(width - n, width) if left else slice(0, n)
        ids[r, cols] = torch.randint(4, 100, (n,), generator=gen)
        mask[r, cols] = 1
    return ids, mask


def _close(a: torch.Tensor, b: torch.Tensor, dtype: str) -> None:
    if dtype == "float32":
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    else:
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=2e-2)


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padded_batches_give_transformers_logits(name, dtype):
    mine, hf = pair(name, dtype, seed=5)
    with torch.no_grad():
        for left in (False, True):
            ids, mask = _rows([9, 4, 1, 7], 9, left)
            pos = positions_from_mask(mask)
            for kwargs in ({}, {"attention_mask": mask}, {"attention_mask": mask, "position_ids": pos}):
                ours = mine(input_ids=ids, use_cache=False, **kwargs).logits
                theirs = hf(input_ids=ids, use_cache=False, **kwargs).logits
                real = mask.bool() if kwargs else torch.ones_like(mask, dtype=torch.bool)
                assert ours.dtype == theirs.dtype
                assert torch.equal(ours[real], theirs[real]), (left, list(kwargs))
        keep = torch.tensor([2, 5])
        ours = mine(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=keep).logits
        theirs = hf(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=keep).logits
        assert ours.shape == (4, 2, 100) and torch.equal(ours, theirs)
        assert torch.equal(mine(input_ids=ids, logits_to_keep=1).logits, hf(input_ids=ids, logits_to_keep=1).logits)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_kv_cache_continues_as_transformers_does(dtype):
    mine, hf = pair("tiny-qwen2", dtype, seed=6)
    ids, mask = _rows([6, 3, 5], 6, left=True)  # left-padded prefill, then one token at a time
    pos = positions_from_mask(mask)
    with torch.no_grad():
        outs = [m(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True) for m in (mine, hf)]
        assert torch.equal(outs[0].logits[mask.bool()], outs[1].logits[mask.bool()])
        caches = [outs[0].cache, outs[1].cache]
        assert caches[0].get_seq_length() == 6
        for step in range(3):
            tok = torch.randint(4, 100, (3, 1), generator=torch.Generator().manual_seed(step))
            mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
            pos = pos[:, -1:] + 1
            logits = []
            for m, cache in zip((mine, hf), caches, strict=True):
                logits.append(
                    m(input_ids=tok, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True).logits
                )
            assert torch.equal(logits[0], logits[1]), step
        assert caches[0].get_seq_length() == 9
        for ours, theirs in zip(caches[0].layers, caches[1].layers, strict=True):
            assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def _group_samples() -> list[Sample]:
    gen = torch.Generator().manual_seed(0)
    out: list[Sample] = []
    for group, (prompt_len, responses) in enumerate(((5, (4, 1, 6)), (3, (2, 5)))):
        prompt = torch.randint(4, 100, (prompt_len,), generator=gen).tolist()
        for n in responses:
            response = torch.randint(4, 100, (n,), generator=gen).tolist()
            out.append(Sample(len(out), group, group, prompt, response, [0.0] * n, [0] * n, "stop"))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_shared_prefix_continuation_and_its_gradients_match_transformers(dtype):
    mine, hf = pair("tiny-llama", dtype, seed=7)
    samples = _group_samples()
    units = [[0, 1, 2], [3, 4]]
    shared = collate_shared_prefix(samples, units, 0, torch.device("cpu"))
    assert shared.tiers  # a continuation from the prompts' cache runs
    results = []
    for model in (mine, hf):
        model.zero_grad()
        logits, targets = shared.logits_and_targets(model)
        logits.float().log_softmax(-1).gather(-1, targets[:, None]).sum().backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        results.append((logits.detach(), grads))
    (ours, our_grads), (theirs, their_grads) = results
    _close(ours, theirs, dtype)
    assert our_grads.keys() == their_grads.keys()
    for key in their_grads:
        _close(our_grads[key], their_grads[key], dtype)
    # and the shared layout scores what the padded one does, on the plain decoder too
    padded = collate_padded(samples, [i for u in units for i in u], 0, torch.device("cpu"))
    with torch.no_grad():
        flat, _ = padded.logits_and_targets(mine)
        by_row = dict(zip(padded.indices, padded.split(torch.arange(len(flat))), strict=True))
        order = torch.cat([by_row[i] for i in shared.indices])
        shared_logits, _ = shared.logits_and_targets(mine)
    _close(shared_logits, flat[order], dtype if dtype == "bfloat16" else "float32")


def test_gradients_match_transformers_with_and_without_checkpointing():
    mine, hf = pair("tiny-qwen2", "float32", seed=8)
    ids, mask = _rows([8, 5, 2], 8, left=False)
    pos = positions_from_mask(mask)

    def grads(model):
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        (logits.log_softmax(-1)[..., 7] * mask).sum().backward()
        return {k: p.grad.clone() for k, p in model.named_parameters()}

    plain, theirs = grads(mine), grads(hf)
    mine.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    mine.train()
    assert mine.is_gradient_checkpointing
    checkpointed = grads(mine)
    for key in theirs:
        torch.testing.assert_close(plain[key], theirs[key], rtol=0, atol=1e-6)
        assert torch.equal(checkpointed[key], plain[key]), key


def test_the_critic_backbone_gives_transformers_hidden_states():
    mine, hf = pair("small-qwen2", "float32", seed=9)
    ids, mask = _rows([6, 3], 6, left=False)
    pos = positions_from_mask(mask)
    with torch.no_grad():
        ours = mine.base_model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
        theirs = hf.base_model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
        assert torch.equal(ours.last_hidden_state[mask.bool()], theirs.last_hidden_state[mask.bool()])
    critic = ValueModel.from_policy(mine)
    assert critic.backbone is not mine.base_model and critic(ids, mask).shape == (2, 6)


def test_a_meta_skeleton_draws_nothing_and_binds_a_state():
    model, _ = build_policy(ModelSpec(), "cpu", seed=4)
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    with torch.device("meta"):
        shell = DecoderForCausalLM(model.config)
    assert torch.equal(torch.rand(1), expected)  # no random draws on meta
    assert all(p.is_meta for p in shell.parameters())
    shell.load_state_dict(model.state_dict(), assign=True)
    shell.tie_weights()
    shell.model.rotary_emb = type(shell.model.rotary_emb)(shell.config)  # its buffer, as PublishedPolicy does
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(shell(ids).logits, model(ids).logits)


def test_importing_the_models_imports_no_transformers():
    code = "import sys, runtime.models, runtime.workloads.llm; print(sorted(m for m in sys.modules if 'transformers' in m))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
