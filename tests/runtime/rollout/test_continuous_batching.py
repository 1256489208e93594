"""Continuous batching: slot refill, equality with one-at-a-time generation, per-step weight versions,
and the padding accounting the engine reports."""

from __future__ import annotations

import pytest
import torch

from runtime.models import build_policy
from runtime.rollout import ContinuousBatcher, Engine, SamplingParams, runners
from runtime.rollout.runners import FastRunner, HFRunner, _pack, _split_rows
from runtime.spec import ModelSpec

torch.set_num_threads(1)

TEXTS = ["abc=", "hello world=", "x", "reverse:abcdef=", "copy:ab=", "q", "repeat 2:abc=", "47+85="]


@pytest.fixture(scope="module")
def policy():
    return build_policy(ModelSpec(builtin="tiny-qwen2"), "cpu", seed=3)


def ids_of(tok, texts=TEXTS):
    return [tok.encode_prompt(t) for t in texts]


def stop_set(engine, prompts, max_new):
    """Stop tokens that end greedy sequences at different lengths (from an unstopped greedy run)."""
    full = engine.generate(prompts, SamplingParams(max_new, temperature=0, ignore_eos=True))
    return (full[0].token_ids[3], full[1].token_ids[7])


@pytest.mark.parametrize("runner", ["fast", "hf"])
def test_continuous_batching_equals_one_at_a_time_under_greedy(policy, runner):
    model, tok = policy
    prompts = ids_of(tok)
    stops = stop_set(Engine(model, tok, "cpu"), prompts, 16)
    params = SamplingParams(16, temperature=0, stop_ids=stops, ignore_eos=True)

    alone = []
    for p in prompts:  # each prompt in its own generate call: nothing shared
        alone.extend(Engine(model, tok, "cpu").generate([p], params))
    engine = Engine(model, tok, "cpu", max_batch_size=3)
    if runner == "hf":
        engine.runner = HFRunner(model)
    together = engine.generate(prompts, params)

    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert [c.finish_reason for c in together] == [c.finish_reason for c in alone]
    lengths = [len(c.token_ids) for c in alone]
    assert len(set(lengths)) > 1 and "stop" in {c.finish_reason for c in alone}  # the case is not trivial
    for a, b in zip(together, alone, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    # Refill happened: 3 slots finished 8 sequences in fewer steps than static batches of 3 would take.
    static = sum(max(lengths[i : i + 3]) for i in range(0, 8, 3))
    assert engine.last_stats.completed == 8
    assert engine.last_stats.generated_tokens == sum(lengths)
    assert engine.last_stats.steps < static


def test_sampled_generation_is_reproducible_with_refill(policy):
    model, tok = policy
    engine = Engine(model, tok, "cpu", max_batch_size=2)
    params = SamplingParams(10, temperature=1.0, n=3)
    a = engine.generate(ids_of(tok), params, torch.Generator().manual_seed(5))
    b = engine.generate(ids_of(tok), params, torch.Generator().manual_seed(5))
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.prompt_index for c in a] == [i for i in range(8) for _ in range(3)]


def _padding_case(policy, refill):
    """Three distinct prompts of 3 tokens (a repeated one is prefilled once) with response limits 2, 5
    and 3 on two slots, eos ignored."""
    model, tok = policy
    engine = Engine(model, tok, "cpu", max_batch_size=2)
    batcher = engine.batcher(SamplingParams(5, temperature=0, ignore_eos=True), refill=refill)
    for tag, limit, last in (("a", 2, 6), ("b", 5, 7), ("c", 3, 8)):
        batcher.submit([1, 5, last], tag, max_new_tokens=limit)
    order = []
    while not batcher.idle:
        step = batcher.stats.steps + 1
        order.extend((step, tag, len(c.token_ids)) for tag, c in batcher.step())
    return engine, batcher, order


def test_refill_accounting_is_exact(policy):
    engine, batcher, order = _padding_case(policy, refill=True)
    # step 1: prefill a+b (6 real of 6); step 2: decode 2 rows, a ends, c prefilled into slot 0 (3 of 3);
    # steps 3-4: 2 rows each, c ends at 4; step 5: only b is left, moved from slot 1 to slot 0: 1 row.
    assert order == [(2, "a", 2), (4, "c", 3), (5, "b", 5)]
    assert batcher.stats.as_dict() == {
        "steps": 5,
        "real_tokens": 16,
        "allocated_tokens": 16,
        "generated_tokens": 10,
        "completed": 3,
        "padding_ratio": 0.0,
    }
    assert engine.stats.allocated_tokens == 16  # the engine sums what its batchers computed


def test_compaction_keeps_the_moved_sequence_intact(policy):
    model, tok = policy
    params = SamplingParams(12, temperature=0, ignore_eos=True)
    prompts = ids_of(tok)[:3]
    alone = [Engine(model, tok, "cpu").generate([p], params)[0].token_ids for p in prompts]
    engine = Engine(model, tok, "cpu", max_batch_size=3)
    batcher = engine.batcher(params)
    for i, (p, limit) in enumerate(zip(prompts, (2, 3, 12), strict=True)):  # slot 2 outlives slots 0 and 1
        batcher.submit(p, i, max_new_tokens=limit)
    done, where = {}, []
    while not batcher.idle:
        done.update(batcher.step())
        where.extend(r for r, live in enumerate(batcher.slots) if live is not None and live.tag == 2)
    assert where[0] == 2 and where[-1] == 0  # moved from slot 2 to slot 0 once 0 and 1 had finished
    assert done[2].token_ids == alone[2]  # and it continued with the same tokens
    assert [done[i].token_ids for i in (0, 1)] == [alone[0][:2], alone[1][:3]]
    # No padding at all: the prompts were prefilled packed, and no decode step computed an empty row.
    # Positions computed: the prompts, then every generated token but each sequence's last (never fed back).
    assert batcher.stats.allocated_tokens == batcher.stats.real_tokens == sum(map(len, prompts)) + 17 - 3


def test_prefill_splits_forwards_and_attention_blocks_and_agrees(policy):
    """Prompts are packed into forward passes of at most ``forward_tokens`` tokens, with attention in blocks
    of whole prompts of about ``attn_block`` tokens; any split gives what one prompt at a time gives."""
    model, tok = policy
    lengths = [150, 30, 151, 40, 25, 152, 12, 60]
    prompts = [[1] + [5 + (i * 7 + j) % 80 for j in range(n - 1)] for i, n in enumerate(lengths)]
    params = SamplingParams(4, temperature=0, ignore_eos=True)
    alone = [Engine(model, tok, "cpu").generate([p], params)[0] for p in prompts]
    # tiny-qwen2 (hidden 128) by default: forwards of 2048 tokens, attention blocks of 64
    for forward_tokens, attn_block in ((2048, 64), (384, 64), (2048, 2048), (384, 256)):
        engine = Engine(model, tok, "cpu")
        assert (engine.runner.forward_tokens, engine.runner.attn_block) == (2048, 64)
        engine.runner.forward_tokens, engine.runner.attn_block = forward_tokens, attn_block
        calls: list[list[int]] = []

        def record(ps, slots, calls=calls, packed=engine.runner._prefill_packed):
            calls.append(sorted(map(len, ps)))
            return packed(ps, slots)

        engine.runner._prefill_packed = record
        together = engine.generate(prompts, params)  # generate prefills shortest prompts first
        if forward_tokens == 2048:
            assert calls == [sorted(lengths)]
        else:
            assert calls == [[12, 25, 30, 40, 60, 150], [151, 152]]
        assert engine.last_stats.allocated_tokens == engine.last_stats.real_tokens  # no padding anywhere
        assert [c.token_ids for c in together] == [c.token_ids for c in alone]
        for a, b in zip(together, alone, strict=True):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_pack_groups_consecutive_items_under_the_limit():
    assert _pack([3, 4, 2, 10, 1], 7) == [[0, 1], [2], [3], [4]]  # 10 > 7 is a group of its own
    assert _pack([2, 2, 2], 6) == [[0, 1, 2]]
    assert _pack([5], 1) == [[0]]


def test_split_rows_cuts_where_it_saves_more_than_the_penalty():
    assert _split_rows([9, 9, 9, 9], 0) == [(0, 4)]  # equal lengths: a cut saves nothing
    # 5 rows x 101 columns = 505; rows 0-1 over 101 and rows 2-4 over 4 columns = 214
    assert _split_rows([100, 100, 3, 3, 3], 10) == [(0, 2), (2, 5)]
    assert _split_rows([100, 100, 3, 3, 3], 290) == [(0, 2), (2, 5)]  # saves 291: just more than 290
    assert _split_rows([100, 100, 3, 3, 3], 291) == [(0, 5)]  # not worth another attention call
    assert _split_rows([3, 100, 3], 10) == [(0, 1), (1, 2), (2, 3)]  # a long row in the middle
    assert _split_rows([7], 0) == [(0, 1)]


def test_row_split_decode_attention_agrees_with_one_range(policy, monkeypatch):
    """Rows of very different lengths, GQA (tiny-qwen2: 4 query heads on 2 kv heads), refilled slots:
    attending each range of rows over its own columns gives the same tokens and, to float rounding, the
    same log-probabilities as attending all rows over the longest one."""
    model, tok = policy
    prompts = [[1] + [5 + (i * 11 + j) % 80 for j in range(n - 1)] for i, n in enumerate([90, 3, 5, 70, 2, 4, 60, 3])]
    limits = [20, 3, 12, 5, 16, 2, 9, 14]
    splits = []
    real_split = runners._split_rows
    monkeypatch.setattr(runners, "_split_rows", lambda cols, p: splits.append(real_split(cols, p)) or splits[-1])

    def run(penalty):
        engine = Engine(model, tok, "cpu", max_batch_size=3)
        engine.runner.split_penalty = penalty
        batcher = engine.batcher(SamplingParams(20, temperature=0, ignore_eos=True))
        for i, (p, n) in enumerate(zip(prompts, limits, strict=True)):
            batcher.submit(p, i, max_new_tokens=n)
        done = {}
        while not batcher.idle:
            done.update(batcher.step())
        return [done[i] for i in range(len(prompts))]

    whole = run(penalty=1 << 30)
    assert {len(s) for s in splits} == {1}
    splits.clear()
    split = run(penalty=0)
    assert max(len(s) for s in splits) == 3 and sum(len(s) > 1 for s in splits) > 10  # the case is not trivial
    assert [c.token_ids for c in split] == [c.token_ids for c in whole]
    assert [len(c.token_ids) for c in split] == limits
    for a, b in zip(split, whole, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_row_split_decode_logits_match_on_llama():
    """The same state decoded with and without the row split (tiny-llama, GQA): equal to float rounding."""
    model, _ = build_policy(ModelSpec(builtin="tiny-llama"), "cpu", seed=2)
    runner = FastRunner(model)
    runner.allocate(4, 64, torch.device("cpu"))
    prompts = [[1, 7, 8, 9] * 10, [1, 5], [1, 6, 7], [1, 9] * 12]
    with torch.inference_mode():
        runner.prefill(prompts, [0, 1, 2, 3], 0)
        tokens, cols = torch.tensor([11, 12, 13, 14]), torch.tensor([40, 2, 3, 24])
        runner.split_penalty = 1 << 30
        whole = runner.decode(tokens, cols)
        runner.split_penalty = 2
        assert runners._split_rows(cols.tolist(), 2) == [(0, 1), (1, 3), (3, 4)]
        split = runner.decode(tokens, cols)  # rewrites the same cache entries
    assert torch.allclose(split, whole, atol=1e-5, rtol=0)


def test_static_batching_pads_finished_rows(policy):
    _, batcher, order = _padding_case(policy, refill=False)
    # a finishes at step 2 but its row is computed until b ends at step 5; c waits for the batch.
    assert order == [(2, "a", 2), (5, "b", 5), (7, "c", 3)]
    assert (batcher.stats.real_tokens, batcher.stats.allocated_tokens, batcher.stats.steps) == (16, 19, 7)


def test_token_budget_limits_live_sequences(policy):
    model, tok = policy
    # Each request reserves 3 + 4 = 7 tokens; a budget of 14 admits two of the three at once.
    engine = Engine(model, tok, "cpu", max_batch_size=8, max_batch_tokens=14)
    batcher = engine.batcher(SamplingParams(4, temperature=0, ignore_eos=True))
    for tag in range(3):
        batcher.submit([1, 5, 6], tag)
    batcher.step()
    assert (batcher.num_live, batcher.num_waiting) == (2, 1)


def test_weight_update_mid_generation_is_taken_at_the_next_step(policy):
    model, tok = policy
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    new = {k: v + 0.5 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) for k, v in saved.items()}
    params = SamplingParams(10, temperature=0, ignore_eos=True)
    prompts = ids_of(tok)[:2]
    try:
        reference = Engine(model, tok, "cpu").generate(prompts, params)
        engine = Engine(model, tok, "cpu")
        batcher = engine.batcher(params)
        for i, p in enumerate(prompts):
            batcher.submit(p, i)
        for _ in range(4):
            assert batcher.step() == []
        engine.update_weights(new, version=1)  # between steps: applied at once, used from step 5 on
        done = dict(pair for _ in range(6) for pair in batcher.step())
    finally:
        model.load_state_dict(saved)
    assert batcher.idle and set(done) == {0, 1}
    for i in (0, 1):
        assert done[i].versions == [0] * 4 + [1] * 6
        assert done[i].token_ids[:4] == reference[i].token_ids[:4]  # old weights up to the update
    assert [done[i].token_ids for i in (0, 1)] != [reference[i].token_ids for i in (0, 1)]


def test_stream_pulls_requests_lazily_and_reports_each_completion(policy):
    model, tok = policy
    engine = Engine(model, tok, "cpu", max_batch_size=2)
    pulled: list[int] = []
    completed: list[tuple[int, int]] = []

    def requests():
        for i, p in enumerate(ids_of(tok)[:5]):
            pulled.append(i)
            yield i, p

    def on_complete(tag, completion):
        completed.append((tag, len(pulled)))
        assert completion.prompt_index == tag

    stats = engine.stream(requests(), SamplingParams(6, temperature=0, ignore_eos=True), on_complete)
    assert sorted(t for t, _ in completed) == [0, 1, 2, 3, 4]
    assert completed[0][1] == 2  # only two requests were taken before the first one finished
    assert stats.completed == 5 and stats.generated_tokens == 30


def test_one_batcher_in_flight_per_engine(policy):
    model, tok = policy
    engine = Engine(model, tok, "cpu")
    first, second = engine.batcher(SamplingParams(4)), engine.batcher(SamplingParams(4))
    first.submit([1, 5])
    first.step()
    second.submit([1, 6], "x")
    with pytest.raises(RuntimeError, match="still has sequences in flight"):
        second.step()
    assert second.num_waiting == 1 and second.num_live == 0  # nothing lost: the request still waits
    while not first.idle:
        first.step()
    while not second.idle:
        second.step()
    assert second.stats.completed == 1


def test_bad_requests_are_rejected_at_submit(policy):
    model, tok = policy
    batcher = ContinuousBatcher(Engine(model, tok, "cpu"), SamplingParams(4))
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        batcher.submit([])
    with pytest.raises(ValueError, match="max_new_tokens must be in"):
        batcher.submit([1, 5], max_new_tokens=5)
    assert batcher.idle and batcher.num_waiting == 0


@pytest.mark.parametrize("runner", ["fast", "hf"])
def test_a_groups_prompt_is_prefilled_once_and_its_copies_decode_as_if_alone(policy, runner):
    model, tok = policy
    params = SamplingParams(12, temperature=0, ignore_eos=True)
    group, other = ids_of(tok)[3], ids_of(tok)[6]
    alone = {tuple(p): Engine(model, tok, "cpu").generate([p], params)[0] for p in (group, other)}
    engine = Engine(model, tok, "cpu", max_batch_size=8)
    if runner == "hf":
        engine.runner = HFRunner(model)
    batcher = engine.batcher(params)
    batcher.submit_group([(group, ("g", j)) for j in range(4)])
    batcher.submit_group([(other, ("o", j)) for j in range(2)])
    done = {}
    while not batcher.idle:
        done.update(batcher.step())
    assert len(done) == 6
    for (kind, _), completion in done.items():
        expected = alone[tuple(group if kind == "g" else other)]
        assert completion.token_ids == expected.token_ids
        assert completion.logprobs == pytest.approx(expected.logprobs, abs=1e-4)
    # One prefill per distinct prompt: the prompt tokens computed are 1x each, not 4x and 2x.
    prefill_tokens = len(group) + len(other)
    decode_tokens = 6 * (12 - 1)
    assert batcher.stats.real_tokens == prefill_tokens + decode_tokens


def test_sampled_copies_of_one_prompt_still_differ(policy):
    model, tok = policy
    engine = Engine(model, tok, "cpu", max_batch_size=8)
    out = engine.generate([ids_of(tok)[3]], SamplingParams(10, temperature=1.0, n=8), torch.Generator().manual_seed(1))
    assert len({tuple(c.token_ids) for c in out}) > 1
