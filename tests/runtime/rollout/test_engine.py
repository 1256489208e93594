"""The built-in generation engine: sampling semantics, versions, and agreement with the trainer's scoring."""

from __future__ import annotations

import pytest
import torch

from runtime.models import build_policy, token_logprobs
from runtime.rollout import Engine, SamplingParams
from runtime.rollout.runners import FastRunner, HFRunner
from runtime.spec import ModelSpec

torch.set_num_threads(1)

PROMPTS = ["abc=", "hello world=", "x", "reverse:abcdef="]


@pytest.fixture(scope="module")
def policy():
    return build_policy(ModelSpec(builtin="tiny-qwen2"), "cpu", seed=3)


@pytest.fixture()
def engine(policy):
    model, tok = policy
    return Engine(model, tok, "cpu")


def prompt_ids(tok, texts=PROMPTS):
    return [tok.encode_prompt(t) for t in texts]


def as_tuples(completions):
    return [(c.prompt_index, c.token_ids, c.finish_reason) for c in completions]


def test_fast_runner_is_used_for_builtin_models(engine):
    assert isinstance(engine.runner, FastRunner)


def test_same_seed_same_completions_other_seed_differs(engine, policy):
    _, tok = policy
    params = SamplingParams(max_new_tokens=16, temperature=1.0, n=2)
    a = engine.generate(prompt_ids(tok), params, torch.Generator().manual_seed(7))
    b = engine.generate(prompt_ids(tok), params, torch.Generator().manual_seed(7))
    c = engine.generate(prompt_ids(tok), params, torch.Generator().manual_seed(8))
    assert as_tuples(a) == as_tuples(b)
    assert [x.logprobs for x in a] == [x.logprobs for x in b]
    assert as_tuples(a) != as_tuples(c)


def test_n_samples_per_prompt_in_prompt_order(engine, policy):
    _, tok = policy
    out = engine.generate(prompt_ids(tok)[:2], SamplingParams(max_new_tokens=12, n=3), torch.Generator().manual_seed(0))
    assert [c.prompt_index for c in out] == [0, 0, 0, 1, 1, 1]
    assert len({tuple(c.token_ids) for c in out[:3]}) > 1  # independent samples, not copies


def test_max_new_tokens_gives_length_finish(engine, policy):
    _, tok = policy
    out = engine.generate(prompt_ids(tok), SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert [len(c.token_ids) for c in out] == [5, 5, 5, 5]
    assert {c.finish_reason for c in out} == {"length"}
    assert all(len(c.logprobs) == 5 and c.versions == [0] * 5 for c in out)


def test_stop_token_ends_the_completion_and_is_included(engine, policy):
    _, tok = policy
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    full = engine.generate(prompt_ids(tok)[:1], greedy)[0].token_ids
    stop = full[4]
    cut = full.index(stop)
    stopped = engine.generate(
        prompt_ids(tok)[:1], SamplingParams(12, temperature=0, stop_ids=(stop,), ignore_eos=True)
    )[0]
    assert stopped.token_ids == full[: cut + 1]
    assert stopped.finish_reason == "stop"
    # Every token a stop token: each completion is exactly one token long.
    every = tuple(range(tok.vocab_size))
    out = engine.generate(prompt_ids(tok), SamplingParams(8, stop_ids=every), torch.Generator().manual_seed(1))
    assert [(len(c.token_ids), c.finish_reason) for c in out] == [(1, "stop")] * 4


def test_eos_stops_unless_ignored(engine, policy):
    _, tok = policy
    params = SamplingParams(30, temperature=1.5, n=4)
    out = engine.generate(prompt_ids(tok), params, torch.Generator().manual_seed(2))
    assert any(c.finish_reason == "stop" for c in out)  # this seed samples eos somewhere
    for c in out:
        assert (c.finish_reason == "stop") == (c.token_ids[-1] == tok.eos_id)
        assert tok.eos_id not in c.token_ids[:-1]
    ignoring = SamplingParams(30, temperature=1.5, n=4, ignore_eos=True)
    ignored = engine.generate(prompt_ids(tok), ignoring, torch.Generator().manual_seed(2))
    assert {(c.finish_reason, len(c.token_ids)) for c in ignored} == {("length", 30)}


def test_top_k_one_equals_greedy(engine, policy):
    _, tok = policy
    greedy = engine.generate(prompt_ids(tok), SamplingParams(16, temperature=0))
    top1 = engine.generate(
        prompt_ids(tok), SamplingParams(16, temperature=1.0, top_k=1), torch.Generator().manual_seed(5)
    )
    assert as_tuples(top1) == as_tuples(greedy)
    for g, t in zip(greedy, top1, strict=True):
        assert g.logprobs == pytest.approx(t.logprobs, abs=1e-6)


def test_top_p_tiny_equals_greedy(engine, policy):
    _, tok = policy
    greedy = engine.generate(prompt_ids(tok), SamplingParams(10, temperature=0))
    nucleus = engine.generate(prompt_ids(tok), SamplingParams(10, top_p=1e-6), torch.Generator().manual_seed(5))
    assert as_tuples(nucleus) == as_tuples(greedy)


def one_by_one_steps(ids, params):
    """Steps of sequential generation, eos ignored: ``max_new_tokens`` steps per sequence, less one for
    each refill (the step that finishes a sequence also prefills the next)."""
    seqs = len(ids) * params.n
    return seqs * params.max_new_tokens - (seqs - 1)


def test_batching_and_padding_do_not_change_greedy_output(policy):
    model, tok = policy
    ids = prompt_ids(tok)
    params = SamplingParams(12, temperature=0, ignore_eos=True)
    together = Engine(model, tok, "cpu").generate(ids, params)
    one_by_one = Engine(model, tok, "cpu", max_batch_size=1).generate(ids, params)
    budget = Engine(model, tok, "cpu", max_batch_tokens=1)  # below one sequence: one at a time
    by_budget = budget.generate(ids, params)
    assert budget.last_stats.steps == one_by_one_steps(ids, params)
    assert as_tuples(together) == as_tuples(one_by_one) == as_tuples(by_budget)
    for a, b in zip(together, one_by_one, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_fast_and_generic_runner_agree(policy):
    model, tok = policy
    fast = Engine(model, tok, "cpu")
    generic = Engine(model, tok, "cpu")
    generic.runner = HFRunner(model)
    params = SamplingParams(12, temperature=0.9, n=2)
    a = fast.generate(prompt_ids(tok), params, torch.Generator().manual_seed(4))
    b = generic.generate(prompt_ids(tok), params, torch.Generator().manual_seed(4))
    assert as_tuples(a) == as_tuples(b)
    for x, y in zip(a, b, strict=True):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)


def _trainer_logprobs(model, prompts, completions, temperature):
    """Score prompt+response with token_logprobs on right-padded full sequences (as a trainer would)."""
    seqs = [prompts[c.prompt_index] + c.token_ids for c in completions]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
        mask[r, : len(s)] = 1
    with torch.no_grad():
        lp = token_logprobs(model, ids, mask, temperature=temperature)
    out = []
    for r, c in enumerate(completions):
        start = len(prompts[c.prompt_index]) - 1
        out.append(lp[r, start : start + len(c.token_ids)])
    return out


@pytest.mark.parametrize("builtin", ["tiny-qwen2", "tiny-llama"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9)])
def test_engine_logprobs_match_trainer_scoring(builtin, temperature, top_k, top_p):
    model, tok = build_policy(ModelSpec(builtin=builtin), "cpu", seed=11)
    prompts = prompt_ids(tok)
    params = SamplingParams(24, temperature=temperature, top_k=top_k, top_p=top_p, n=2)
    out = Engine(model, tok, "cpu").generate(prompts, params, torch.Generator().manual_seed(0))
    scored = _trainer_logprobs(model, prompts, out, temperature)
    worst = max((torch.tensor(c.logprobs) - s).abs().max().item() for c, s in zip(out, scored, strict=True))
    assert worst < 1e-4


def test_logprobs_match_trainer_scoring_with_split_attention(monkeypatch):
    """Prompts of very different lengths on a GQA model, attention split into row ranges at every step it
    can be and prefill attention in blocks: log-probabilities still match the trainer's to float rounding."""
    from runtime.rollout import runners

    model, tok = build_policy(ModelSpec(builtin="tiny-qwen2"), "cpu", seed=12)
    prompts = prompt_ids(tok, ["x", "reverse:" + "abcdefgh" * 9 + "=", "ab=", "copy:" + "xyz" * 20 + "="])
    ranges = []
    split = runners._split_rows
    monkeypatch.setattr(runners, "_split_rows", lambda cols, p: ranges.append(len(split(cols, p))) or split(cols, p))
    engine = Engine(model, tok, "cpu", max_batch_size=3)
    engine.runner.split_penalty = 0
    out = engine.generate(prompts, SamplingParams(20, temperature=1.0, n=2), torch.Generator().manual_seed(0))
    assert max(ranges) >= 2  # the split was exercised
    scored = _trainer_logprobs(model, prompts, out, 1.0)
    worst = max((torch.tensor(c.logprobs) - s).abs().max().item() for c, s in zip(out, scored, strict=True))
    assert worst < 1e-4


def test_hot_update_changes_version_and_outputs(policy):
    model, tok = policy
    engine = Engine(model, tok, "cpu")
    greedy = SamplingParams(12, temperature=0, ignore_eos=True)
    before = engine.generate(prompt_ids(tok), greedy)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        new = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) for k, v in saved.items()}
        engine.update_weights(new, version=5)
        assert engine.version == 5
        after = engine.generate(prompt_ids(tok), greedy)
        assert {v for c in after for v in c.versions} == {5}
        assert as_tuples(after) != as_tuples(before)
        assert torch.equal(model.state_dict()["lm_head.weight"], new["lm_head.weight"])
    finally:
        model.load_state_dict(saved)


def test_bad_weight_update_is_rejected_and_changes_nothing(policy):
    model, tok = policy
    engine = Engine(model, tok, "cpu", version=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="unknown parameter names"):
        engine.update_weights({"no.such.weight": torch.zeros(1)}, version=4)
    name = "model.norm.weight"
    with pytest.raises(ValueError, match="has shape"):
        engine.update_weights({name: torch.zeros(3)}, version=4)
    assert engine.version == 3
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_update_during_generate_is_taken_at_the_next_step(policy):
    model, tok = policy
    engine = Engine(model, tok, "cpu", max_batch_size=1)
    original_decode = engine.runner.decode
    calls = []

    def decode_and_publish(*args):
        calls.append(engine.version)
        if len(calls) == 2:  # a publish arriving mid-step (co-located: no copy, version only)
            engine.update_weights(None, version=9)
            assert engine.version == 0  # staged, not applied inside the step
        return original_decode(*args)

    engine.runner.decode = decode_and_publish
    out = engine.generate(prompt_ids(tok)[:2], SamplingParams(6, temperature=0, ignore_eos=True))
    # Sequence 0: token 1 from the prefill step, tokens 2-3 from the decodes that ran under version 0
    # (the update arrived inside the second), tokens 4-6 under version 9; sequence 1 entirely under 9.
    assert calls == [0, 0, 9, 9, 9, 9, 9, 9, 9, 9]
    assert [c.versions for c in out] == [[0, 0, 0, 9, 9, 9], [9] * 6]
    assert engine.version == 9


def test_bad_prompts_and_params_are_clear_errors(engine):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[5], []], SamplingParams(4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[10_000]], SamplingParams(4))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(4, top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(0)
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(4, n=0)


def test_sampling_params_from_the_rollout_spec():
    from runtime.rollout import sampling_params
    from runtime.spec import RolloutSpec

    spec = RolloutSpec(max_new_tokens=7, temperature=0.5, top_k=3, max_batch_size=2)
    assert sampling_params(spec, n=3) == SamplingParams(7, temperature=0.5, top_k=3, n=3)


def test_other_architectures_use_the_generic_runner_and_agree(tmp_path):
    """A local HF directory of a non-Llama model (GPT-2 here) loads and generates through the generic path."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from runtime.models import CharTokenizer, save_hf

    tok = CharTokenizer()
    cfg = GPT2Config(
        vocab_size=tok.vocab_size, n_positions=128, n_embd=64, n_layer=2, n_head=4, eos_token_id=tok.eos_id
    )
    torch.manual_seed(0)
    save_hf(GPT2LMHeadModel(cfg), tok, tmp_path)
    model, loaded_tok = build_policy(ModelSpec(path=str(tmp_path)), "cpu")
    engine = Engine(model, loaded_tok, "cpu")
    assert isinstance(engine.runner, HFRunner)
    prompts = prompt_ids(loaded_tok)
    out = engine.generate(prompts, SamplingParams(16, n=2), torch.Generator().manual_seed(0))
    assert [c.prompt_index for c in out] == [0, 0, 1, 1, 2, 2, 3, 3]
    scored = _trainer_logprobs(model, prompts, out, 1.0)
    worst = max((torch.tensor(c.logprobs) - s).abs().max().item() for c, s in zip(out, scored, strict=True))
    assert worst < 1e-4


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_an_engine_owning_its_model_keeps_one_copy_of_the_fused_weights_and_still_takes_updates(policy):
    _, tok = policy
    params = SamplingParams(10, temperature=0, ignore_eos=True)
    owned_model, _ = build_policy(ModelSpec(builtin="tiny-qwen2"), "cpu", seed=3)
    owned = Engine(owned_model, tok, "cpu", owns_model=True)
    shared = Engine(policy[0], tok, "cpu")  # the trainer's module: never aliased
    assert as_tuples(owned.generate(prompt_ids(tok), params)) == as_tuples(shared.generate(prompt_ids(tok), params))

    for layer, fused in zip(owned_model.base_model.layers, owned.runner.layers, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        assert {_storage(m.weight) for m in (attn.q_proj, attn.k_proj, attn.v_proj)} == {_storage(fused.qkv_w)}
        assert {_storage(m.weight) for m in (mlp.gate_proj, mlp.up_proj)} == {_storage(fused.gate_up_w)}
    trainer_layer, trainer_fused = policy[0].base_model.layers[0], shared.runner.layers[0]
    assert _storage(trainer_layer.self_attn.q_proj.weight) != _storage(trainer_fused.qkv_w)

    # A new version copied into the (aliased) parameters reaches the fused weights without re-fusing.
    new_model, _ = build_policy(ModelSpec(builtin="tiny-qwen2"), "cpu", seed=11)
    owned.update_weights({k: v.detach().clone() for k, v in new_model.state_dict().items()}, version=1)
    got = owned.generate(prompt_ids(tok), params)
    want = Engine(new_model, tok, "cpu").generate(prompt_ids(tok), params)
    assert as_tuples(got) == as_tuples(want)
    for a, b in zip(got, want, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
