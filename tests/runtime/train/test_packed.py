"""The packed layout: whole sequences one after another in a row, positions restarting, attention
block-diagonal; and rows of units where a group's samples share one copy of their prompt, each response
seeing its prompt and itself. Both compute what the right-padded layout does (log-probs, gradients, a
critic's values, a whole train step with GRPO and PPO, with gradient checkpointing) on uneven lengths, in
the plain decoder and in transformers, and the planner leaves next to no padding on a long-tailed batch."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from runtime.contract import (
    COMPUTED_TOKENS_RATIO,
    GRAD_NORM,
    LOSS_POLICY,
    LOSS_VALUE,
    PACKED_SHARE,
    SHARED_PREFIX_SHARE,
)
from runtime.models import ValueModel
from runtime.models.configs import builtin_config
from runtime.models.kv_cache import packed_causal_mask, shared_prompt_mask
from runtime.models.logprobs import logprobs_from_logits
from runtime.samples import Sample
from runtime.spec import load_spec
from runtime.train.batches import (
    PackedBatch,
    attention_width,
    collate_packed,
    collate_padded,
    packed_tokens,
    plan_micro_batches,
    plan_packed,
    plan_packed_units,
)
from runtime.train.trainer import Trainer, TrainerError, takes_prepared_mask
from tests.runtime.train.test_batches import _grouped
from tests.runtime.train.test_trainer import _policy, _spec

torch.set_num_threads(1)
CPU = torch.device("cpu")


def _uneven(lengths: list[tuple[int, int]], seed: int = 0) -> list[Sample]:
    """One sample per (prompt length, response length), each with a prompt of its own."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k, (p, n) in enumerate(lengths):
        out.append(
            Sample(
                sample_id=k,
                prompt_id=k,
                group_id=k // 2,
                prompt_ids=[1, *torch.randint(4, 100, (p - 1,), generator=gen).tolist()],
                response_ids=torch.randint(4, 100, (n,), generator=gen).tolist(),
                logprobs=[-1.5] * n,
                versions=[0] * n,
                finish_reason="stop",
                reward=float(k % 3 == 0),
                correct=k % 3 == 0,
            )
        )
    return out


UNEVEN = [(5, 1), (9, 17), (3, 2), (12, 4), (4, 30), (7, 7), (2, 1), (6, 11), (8, 3), (5, 22)]


def _units(rows: list[list[int]]) -> list[list[list[int]]]:
    """Rows of sample indices as rows of one-sample units (sequence packing)."""
    return [[[i] for i in row] for row in rows]


def _logprobs_and_grads(model, mb, order):
    """The micro-batch's log-probs (samples in ``order``), and the gradients of a sum of them weighted by
    sample and token (so that micro-batches' gradients add up to one batch's)."""
    model.zero_grad()
    picked, targets = mb.logits_and_targets(model)
    per = dict(zip(mb.indices, mb.split(logprobs_from_logits(picked, targets)), strict=True))
    loss = sum((per[i] * (0.1 + 0.05 * i + 0.01 * torch.arange(len(per[i])))).sum() for i in order)
    loss.backward()
    return torch.cat([per[i] for i in order]).detach(), [p.grad.clone() for p in model.parameters()]


def _transformers_twin(model):
    config = builtin_config("tiny-qwen2", 100, 0, 1, 2).to_dict()
    hf = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**{k: v for k, v in config.items() if k not in ("architectures", "dtype")})
    )
    hf.load_state_dict(model.state_dict(), strict=False)
    hf.config._attn_implementation = "sdpa"
    return hf.train()


def test_the_packed_mask_is_block_diagonal_causal_and_absent_for_one_sequence_per_row():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = packed_causal_mask(positions)[0, 0]
    seq = [0, 0, 0, 1, 1, 2]
    want = torch.tensor([[j <= i and seq[i] == seq[j] for j in range(6)] for i in range(6)])
    assert torch.equal(mask, want)
    assert packed_causal_mask(torch.arange(6)[None].expand(3, -1)) is None


@pytest.mark.parametrize("budget", [40, 64, 4096])
def test_the_packed_layout_gives_the_padded_layouts_logprobs_and_gradients(budget):
    samples = _uneven(UNEVEN)
    order = list(range(len(samples)))
    model = _policy()[0].train()
    padded, padded_grads = _logprobs_and_grads(model, collate_padded(samples, order, 0, CPU), order)
    rows = plan_packed([s.num_tokens for s in samples], budget)
    assert sorted(i for b in rows for row in b for i in row) == order
    packed, packed_grads = [], [torch.zeros_like(p) for p in model.parameters()]
    for b in rows:
        mb = collate_packed(samples, _units(b), 0, CPU)
        assert mb.input_ids.shape[0] == len(b)
        values, grads = _logprobs_and_grads(model, mb, [i for row in b for i in row])
        packed.append(dict(zip([i for row in b for i in row], mb.split(values), strict=True)))
        packed_grads = [a + g for a, g in zip(packed_grads, grads, strict=True)]
    merged = {i: v for part in packed for i, v in part.items()}
    flat = torch.cat([merged[i] for i in order])
    torch.testing.assert_close(flat, padded, rtol=0, atol=1e-5)
    for a, b in zip(packed_grads, padded_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_long_tailed_batch_packs_to_within_five_percent_of_its_real_tokens():
    rng = random.Random(0)
    lengths = [min(int(rng.paretovariate(1.3) * 12), 512) for _ in range(512)]
    budget = 4096
    batches = plan_packed(lengths, budget)
    assert sorted(i for b in batches for row in b for i in row) == list(range(len(lengths)))
    for b in batches:
        width = max(sum(lengths[i] for i in row) for row in b)
        assert len(b) * width <= max(budget, max(lengths[i] for row in b for i in row))
    computed = packed_tokens(lengths, batches)
    assert computed / sum(lengths) <= 1.05
    padded = sum(len(b) * max(lengths[i] for i in b) for b in _padded_batches(lengths, budget))
    assert padded / sum(lengths) > 1.05  # what the padded layout computes on the same batch


def _padded_batches(lengths, budget):
    from runtime.train.batches import make_micro_batches

    return make_micro_batches(lengths, budget)


@pytest.mark.parametrize("algorithm,checkpointing", [("grpo", False), ("ppo", False), ("grpo", True)])
def test_a_train_step_packed_matches_the_padded_layouts(algorithm, checkpointing):
    samples = _uneven(UNEVEN + [(6, 2), (6, 9)], seed=7)
    results = {}
    for layout in ("packed", "padded"):
        policy, tok = _policy()
        spec = _spec(
            "trainer.lr=0.001",
            f"algorithm.name={algorithm}",
            "algorithm.group_size=2",
            "trainer.micro_batch_tokens=64",
            f"trainer.layout={layout}",
            f"trainer.gradient_checkpointing={checkpointing}",
        )
        critic = ValueModel.from_policy(policy) if algorithm == "ppo" else None
        trainer = Trainer(spec, policy, tok, "cpu", critic=critic)
        results[layout] = [trainer.train_step(samples, step) for step in range(2)]
    for a, b in zip(results["packed"], results["padded"], strict=True):
        for key in (LOSS_POLICY, GRAD_NORM) + ((LOSS_VALUE,) if algorithm == "ppo" else ()):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        assert a[PACKED_SHARE] == 1.0 and b[PACKED_SHARE] == 0.0
        assert a[COMPUTED_TOKENS_RATIO] < b[COMPUTED_TOKENS_RATIO]


def test_the_planner_packs_unless_asked_for_padded_rows():
    samples = _uneven(UNEVEN)
    idx = list(range(len(samples)))
    assert plan_micro_batches(samples, idx, 4096, allow_shared_prefix=True).layout == "packed"
    assert plan_micro_batches(samples, idx, 4096, allow_shared_prefix=True, packed=False).layout == "padded"


class _NoMaskingModel(torch.nn.Module):
    """A causal LM whose attention reads no packed rows (transformers' default for a model class)."""

    _supports_attention_backend = False

    def __init__(self):
        super().__init__()
        self.config = transformers.PretrainedConfig()
        self.weight = torch.nn.Parameter(torch.zeros(1))


def test_packing_a_model_that_cannot_mask_it_is_an_error_naming_the_field():
    _, tok = _policy()
    with pytest.raises(TrainerError, match=r"trainer\.layout: .*set trainer\.layout: padded"):
        Trainer(_spec(), _NoMaskingModel(), tok, "cpu")
    Trainer(_spec("trainer.layout=padded"), _NoMaskingModel(), tok, "cpu")  # the padded layout needs no mask
    with pytest.raises(ValueError, match="trainer.layout"):
        load_spec({"trainer": {"layout": "ragged"}})


# --------------------------------------------------------------------------- a group's prompt shared in a row

# Groups of uneven responses (one of them empty, several of one token) behind prompts of 5 to 14 tokens.
GROUPS = [[1, 9, 3, 17, 2, 1, 6, 0], [4, 1, 22, 5], [2, 2, 11, 1, 7, 3]]


def _groups(seed: int = 0) -> list:
    return [s for p, prompt_len in enumerate((5, 14, 9)) for s in _grouped(prompt_len + seed, [GROUPS[p]], prompts=1)]


def _renumbered(samples: list) -> list:
    for k, s in enumerate(samples):
        s.sample_id = k
    return samples


def test_the_shared_prompt_mask_lets_each_response_see_its_prompt_and_itself():
    # one row: unit 0 = prompt (2 columns) + responses of 2 and 1 columns, unit 1 = prompt (1) + response (1)
    segments = torch.tensor([[0, 0, 0, 0, 0, 1, 1]])
    branches = torch.tensor([[0, 0, 1, 1, 2, 0, 1]])
    mask = shared_prompt_mask(segments, branches)[0, 0]
    visible = {0: {0}, 1: {0, 1}, 2: {0, 1, 2}, 3: {0, 1, 2, 3}, 4: {0, 1, 4}, 5: {5}, 6: {5, 6}}
    want = torch.tensor([[j in visible[i] for j in range(7)] for i in range(7)])
    assert torch.equal(mask, want)


@pytest.mark.parametrize("budget", [24, 40, 4096])
def test_rows_sharing_a_prompt_give_the_padded_layouts_logprobs_and_gradients(budget):
    samples = _renumbered(_groups())
    order = list(range(len(samples)))
    model = _policy()[0].train()
    padded, padded_grads = _logprobs_and_grads(model, collate_padded(samples, order, 0, CPU), order)
    batches = plan_packed_units(samples, order, budget, share_prompts=True)
    assert sorted(i for b in batches for row in b for unit in row for i in unit) == order
    assert any(len(unit) > 1 for b in batches for row in b for unit in row)  # prompts are shared
    merged, grads = {}, [torch.zeros_like(p) for p in model.parameters()]
    for b in batches:
        mb = collate_packed(samples, b, 0, CPU)
        mine = [i for row in b for unit in row for i in unit]
        values, g = _logprobs_and_grads(model, mb, mine)
        merged.update(zip(mine, mb.split(values), strict=True))
        grads = [a + x for a, x in zip(grads, g, strict=True)]
    torch.testing.assert_close(torch.cat([merged[i] for i in order]), padded, rtol=0, atol=1e-5)
    for a, b in zip(grads, padded_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_attention_that_takes_no_prepared_mask_never_shares_a_prompt_in_a_row():
    model = _policy()[0]
    for attention in ("flash_attention_2", "eager"):
        hf = _transformers_twin(model)
        hf.config._attn_implementation = attention
        assert not takes_prepared_mask(hf), attention
    assert takes_prepared_mask(model) and takes_prepared_mask(_transformers_twin(model))  # plain, and SDPA
    hf = _transformers_twin(model)
    hf.config.layer_types = ["sliding_attention"] * len(hf.config.layer_types)
    assert not takes_prepared_mask(hf)  # a prepared mask would replace the window


def _one_packed_batch(kind: str, seed: int) -> tuple[list, PackedBatch]:
    """Samples and one packed micro-batch holding them all: ``sequences`` (several per row) or ``shared``
    (groups behind one copy of their prompt, the rows' mask explicit)."""
    if kind == "sequences":
        samples = _uneven(UNEVEN, seed=seed)
        mb = collate_packed(samples, _units(plan_packed([s.num_tokens for s in samples], 4096)[0]), 0, CPU)
        assert (mb.position_ids == 0).sum() > mb.input_ids.shape[0] and not mb.shares_prompts
    else:
        samples = _renumbered(_groups(seed=seed))
        mb = collate_packed(samples, plan_packed_units(samples, list(range(len(samples))), 4096, True)[0], 0, CPU)
        assert mb.shares_prompts
    return samples, mb


@pytest.mark.parametrize("kind,seed", [("sequences", 3), ("shared", 2)])
def test_transformers_reads_packed_rows_as_the_plain_decoder_does(kind, seed):
    samples, mb = _one_packed_batch(kind, seed)
    order = list(range(len(samples)))
    model = _policy()[0].train()
    hf = _transformers_twin(model)
    plain, _ = _logprobs_and_grads(model, mb, order)
    theirs, _ = _logprobs_and_grads(hf, mb, order)
    padded, _ = _logprobs_and_grads(hf, collate_padded(samples, order, 0, CPU), order)
    torch.testing.assert_close(theirs, plain, rtol=0, atol=1e-5)
    torch.testing.assert_close(theirs, padded, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind,seed", [("sequences", 5), ("shared", 4)])
def test_a_critic_reads_packed_rows_as_padded_ones(kind, seed):
    samples, packed_mb = _one_packed_batch(kind, seed)
    order = list(range(len(samples)))
    critic = ValueModel.from_policy(_policy()[0])
    torch.nn.init.normal_(critic.head.weight)  # a zero head would make every layout agree
    padded, packed = {}, {}
    for mb, out in ((collate_padded(samples, order, 0, CPU), padded), (packed_mb, packed)):
        out.update(zip(mb.indices, mb.split(mb.predicting(critic(**mb.forward_inputs()))), strict=True))
    for i in order:
        torch.testing.assert_close(packed[i], padded[i], rtol=0, atol=1e-5)


def _fill(samples: list, row: list[list[int]]) -> int:
    """Tokens a packed row of units feeds: each unit's prompt once, each sample's response but its last token."""
    return sum(len(samples[u[0]].prompt_ids) + sum(len(samples[i].response_ids) - 1 for i in u) for u in row)


def test_the_planner_shares_prompts_where_that_costs_less_and_keeps_within_the_budget():
    samples = _renumbered(_grouped(40, [[3, 1, 4, 2, 5, 1, 2, 6]], prompts=6))  # prompts dominate
    idx = list(range(len(samples)))
    for budget in (64, 256, 4096):
        batches = plan_packed_units(samples, idx, budget, share_prompts=True)
        assert sorted(i for b in batches for row in b for unit in row for i in unit) == idx
        for b in batches:
            fills = [_fill(samples, row) for row in b]
            assert len(b) * max(fills) <= max(budget, max(fills))
    shared = plan_micro_batches(samples, idx, 4096, allow_shared_prefix=False, share_prompts=True)
    alone = plan_micro_batches(samples, idx, 4096, allow_shared_prefix=False)
    assert shared.prompt_sharing_batches() == len(shared) and alone.prompt_sharing_batches() == 0
    assert shared.processed_tokens < 0.4 * alone.processed_tokens  # 40-token prompts once per group, not 8 times
    # The cost counts attention: with long responses, a model whose attention is dear gets narrower rows
    # (more prompt copies), one whose attention is cheap the fewest tokens.
    samples = _renumbered(_grouped(4, [[30, 30, 30, 30]], prompts=2))
    idx = list(range(len(samples)))
    wide = plan_packed_units(samples, idx, 4096, share_prompts=True, width_scale=1e9)
    narrow = plan_packed_units(samples, idx, 4096, share_prompts=True, width_scale=8.0)
    widest = lambda plan: max(_fill(samples, row) for b in plan for row in b)  # noqa: E731
    assert widest(narrow) < widest(wide)


def test_attention_width_weighs_a_rows_attention_against_its_linear_layers():
    config = builtin_config("medium-qwen2", 100, 0, 1, 2)
    h, q, kv, inter = 384, 6 * 64, 2 * 64, config.intermediate_size
    assert attention_width(config) == (2 * h * q + 2 * h * kv + 3 * h * inter) / (2 * q)
    assert attention_width(object()) == 2048.0  # no shapes: the default


@pytest.mark.parametrize("algorithm,checkpointing", [("grpo", False), ("ppo", False), ("grpo", True)])
def test_a_train_step_sharing_prompts_in_rows_matches_the_padded_layouts(algorithm, checkpointing):
    samples = _renumbered(_groups(seed=6))
    results = {}
    for layout in ("auto", "packed", "padded"):
        policy, tok = _policy()
        spec = _spec(
            "trainer.lr=0.001",
            f"algorithm.name={algorithm}",
            "algorithm.group_size=2",
            "trainer.micro_batch_tokens=48",
            f"trainer.layout={layout}",
            f"trainer.gradient_checkpointing={checkpointing}",
        )
        critic = ValueModel.from_policy(policy) if algorithm == "ppo" else None
        trainer = Trainer(spec, policy, tok, "cpu", critic=critic)
        assert trainer.shares_prompts_in_rows == (layout == "auto")
        if layout == "padded":
            trainer.shared_prefix_allowed = False  # the reference: one right-padded row per sample
        results[layout] = [trainer.train_step(samples, step) for step in range(2)]
    for step, (a, b) in enumerate(zip(results["auto"], results["padded"], strict=True)):
        for key in (LOSS_POLICY, GRAD_NORM) + ((LOSS_VALUE,) if algorithm == "ppo" else ()):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (step, key)
        assert a[PACKED_SHARE] == 1.0 and a[SHARED_PREFIX_SHARE] > 0
    shared, packed = results["auto"][0], results["packed"][0]
    assert packed[SHARED_PREFIX_SHARE] == 0.0
    assert shared[COMPUTED_TOKENS_RATIO] < packed[COMPUTED_TOKENS_RATIO]
