"""The vLLM adapter on the real vLLM (0.30, CPU build): generation, weight updates, log-prob agreement with the
trainer, seeds, stop ids, aborts and prefix caching. One engine serves the module (vLLM takes 15-40 s to start
here); a test that changes its weights puts the base weights back before it ends."""

from __future__ import annotations

import pytest
import torch

from runtime.models.loading import load_checkpoint
from runtime.models.logprobs import token_logprobs
from runtime.models.tokenizer import load_tokenizer
from runtime.rollout.sampling import SamplingParams
from runtime.rollout.vllm_adapter import VLLMEngine

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def setup(base_model):
    tokenizer = load_tokenizer(base_model)
    engine = VLLMEngine(str(base_model), tokenizer, "cpu", dtype="float32", kv_cache_bytes=128 << 20, max_batch_size=16)
    trainer = load_checkpoint(base_model, torch.float32).eval()
    base = {k: v.clone() for k, v in trainer.state_dict().items()}
    yield engine, tokenizer, trainer, base
    engine.update_weights(None, 0)


@pytest.fixture
def engine(setup):
    engine, _, trainer, base = setup
    yield engine
    with torch.no_grad():
        trainer.load_state_dict(base)
    engine.update_weights(base, engine.version + 1)  # the next test starts from the base weights


def prompts(tokenizer, n: int = 4) -> list[list[int]]:
    return [tokenizer.encode_prompt(f"reverse:{'abcdefghij'[i : i + 3]}=") for i in range(n)]


def gap(model, prompt_ids: list[list[int]], completions) -> float:
    """Largest |engine log p - trainer log p| over every sampled token (the trainer scoring each sequence)."""
    worst = 0.0
    with torch.no_grad():
        for c in completions:
            prompt = prompt_ids[c.prompt_index]
            ids = torch.tensor([prompt + c.token_ids])
            trainer = token_logprobs(model, ids, torch.ones_like(ids))[0, len(prompt) - 1 :]
            worst = max(worst, (trainer - torch.tensor(c.logprobs)).abs().max().item())
    return worst


SAMPLE = SamplingParams(max_new_tokens=10, temperature=1.0, n=4, ignore_eos=True)


def test_generate_streams_every_sequence_with_the_trainers_log_probabilities(setup, engine):
    _, tokenizer, trainer, _ = setup
    ids = prompts(tokenizer)
    out = engine.generate(ids, SAMPLE, torch.Generator().manual_seed(0))
    assert [c.prompt_index for c in out] == [i for i in range(4) for _ in range(4)]
    assert all(len(c.token_ids) == 10 == len(c.logprobs) == len(c.versions) for c in out)
    assert all(c.finish_reason == "length" for c in out) and {v for c in out for v in c.versions} == {engine.version}
    assert gap(trainer, ids, out) < 1e-3  # fp32 on both sides


def test_a_weight_update_lands_the_engine_computes_with_the_new_weights(setup, engine):
    _, tokenizer, trainer, base = setup
    ids = prompts(tokenizer)
    old = load_checkpoint(engine_path(engine), torch.float32).eval()
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    state = trainer.state_dict()
    version = engine.version + 1
    engine.update_weights(state, version)
    out = engine.generate(ids, SAMPLE, torch.Generator().manual_seed(1))
    assert {v for c in out for v in c.versions} == {version}
    assert gap(trainer, ids, out) < 1e-4  # the new weights, exactly (fp32)
    assert gap(old, ids, out) > 1e-2  # and not the old ones: the test can tell
    # everything handed over, in the engine's dtype (float32 here), tensor by tensor
    assert engine.last_update["bytes"] == sum(t.numel() * 4 for t in state.values()) and engine.dtype == torch.float32


def engine_path(engine: VLLMEngine) -> str:
    return engine.llm.llm_engine.model_config.model


def test_the_same_seeds_give_the_same_samples_and_other_seeds_others(setup, engine):
    ids = prompts(setup[1])
    first = engine.generate(ids, SAMPLE, torch.Generator().manual_seed(7))
    again = engine.generate(ids, SAMPLE, torch.Generator().manual_seed(7))
    other = engine.generate(ids, SAMPLE, torch.Generator().manual_seed(8))
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]


def test_a_sequence_stops_at_the_first_stop_id_and_keeps_it(setup, engine):
    ids = prompts(setup[1], 1)
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0, n=1, ignore_eos=True)
    free = engine.generate(ids, greedy)[0].token_ids
    stop = free[3]
    at = free.index(stop)
    params = SamplingParams(max_new_tokens=10, temperature=0.0, n=1, stop_ids=(stop,), ignore_eos=True)
    stopped = engine.generate(ids, params)[0]
    assert stopped.token_ids == free[: at + 1] and stopped.finish_reason == "stop"


def test_cancelled_requests_are_aborted_in_vllm_and_the_rest_finish(setup, engine):
    ids = prompts(setup[1])
    b = engine.batcher(SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True), torch.Generator())
    for i, p in enumerate(ids):
        b.submit(p, i)
    done = b.step()
    assert b.num_live == 4 and not done
    assert b.cancel(lambda tag: tag % 2 == 0) == 2
    while not b.idle:
        done += b.step()
    assert sorted(tag for tag, _ in done) == [1, 3] and all(len(c.token_ids) == 12 for _, c in done)
    assert not engine.llm.llm_engine.has_unfinished_requests()  # vLLM holds nothing of the aborted ones
    assert len(engine.generate(ids[:1], SAMPLE)) == 4  # and serves the next call


def test_a_sequence_in_flight_across_an_update_tags_its_later_tokens_with_the_new_version(setup, engine):
    _, tokenizer, trainer, _ = setup
    b = engine.batcher(SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True), torch.Generator())
    b.submit(prompts(tokenizer, 1)[0], "x")
    for _ in range(4):
        b.step()
    before = engine.version
    engine.update_weights(trainer.state_dict(), before + 1)
    done = []
    while not b.idle:
        done += b.step()
    versions = done[0][1].versions
    assert versions == sorted(versions) and set(versions) == {before, before + 1}
    assert versions.count(before) == 4


def test_a_groups_shared_prompt_is_prefilled_once_and_never_reused_across_versions(setup, engine):
    long_prompt = list(range(3, 303))  # 300 tokens: two full 128-token KV blocks on CPU
    params = SamplingParams(max_new_tokens=2, temperature=1.0, n=4, ignore_eos=True)
    counted = engine.prompt_tokens, engine.cached_prompt_tokens
    engine.generate([long_prompt], params, torch.Generator().manual_seed(0))
    prompt, cached = engine.prompt_tokens - counted[0], engine.cached_prompt_tokens - counted[1]
    assert (prompt, cached) == (1200, 3 * 256)  # the group's three later samples reuse the first one's blocks
    engine.update_weights(None, engine.version + 1)  # a new version: the first request recomputes its prompt
    counted = engine.prompt_tokens, engine.cached_prompt_tokens
    engine.generate([long_prompt], params, torch.Generator().manual_seed(0))
    assert engine.cached_prompt_tokens - counted[1] == 3 * 256
