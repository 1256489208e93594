"""The trainer's two layouts: the shared-prefix one (a group's prompt run once, its responses continued from
the expanded KV cache) computes what the padded one does, and the planner picks it only where it saves."""

from __future__ import annotations

import pytest
import torch

from runtime.contract import COMPUTED_TOKENS_RATIO, GRAD_NORM, LOSS_POLICY, SHARED_PREFIX_SHARE
from runtime.models import ValueModel
from runtime.models.logprobs import logprobs_from_logits
from runtime.samples import Sample
from runtime.train.batches import (
    TIER_OVERHEAD_TOKENS,
    collate_padded,
    collate_shared_prefix,
    continuation_tiers,
    plan_micro_batches,
    plan_shared_prefix,
    prompt_units,
    shared_prefix_cost,
)
from runtime.train.trainer import Trainer
from tests.runtime.train.test_trainer import _policy, _samples, _spec

torch.set_num_threads(1)
CPU = torch.device("cpu")


def _grouped(prompt_len: int, responses: list[list[int]], prompts: int = 3) -> list[Sample]:
    """``prompts`` groups sharing a prompt of ``prompt_len`` tokens, one sample per response length."""
    gen = torch.Generator().manual_seed(prompt_len)
    out = []
    for p in range(prompts):
        prompt = [1, *torch.randint(4, 100, (prompt_len - 1,), generator=gen).tolist()]
        for g, n in enumerate(responses[p % len(responses)]):
            response = torch.randint(4, 100, (n,), generator=gen).tolist()
            out.append(
                Sample(
                    sample_id=len(out),
                    prompt_id=p,
                    group_id=p,
                    prompt_ids=prompt,
                    response_ids=response,
                    logprobs=[-1.0] * n,
                    versions=[0] * n,
                    finish_reason="stop",
                    reward=float(g % 2),
                    correct=bool(g % 2),
                )
            )
    return out


def _logprobs_and_grads(model, mb, order: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Per-token log-probs in ``order`` of samples, and the gradients of a weighted sum of them."""
    model.zero_grad()
    picked, targets = mb.logits_and_targets(model, model)
    per = dict(zip(mb.indices, mb.split(logprobs_from_logits(picked, targets)), strict=True))
    flat = torch.cat([per[i] for i in order])
    (flat * torch.linspace(0.1, 1.0, len(flat))).sum().backward()
    return flat.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "prompt_len,responses",
    [
        (12, [[1, 2, 3, 8, 1, 1, 2, 13]]),  # mostly short answers, one long: several continuation tiers
        (3, [[5, 5, 5, 5], [1, 1, 1, 1]]),  # a group of one-token answers needs the prompt's logits only
        (9, [[1, 1, 1]]),  # no continuation forward at all
    ],
)
def test_the_shared_prefix_layout_gives_the_padded_layouts_logprobs_and_gradients(prompt_len, responses):
    samples = _grouped(prompt_len, responses)
    model = _policy()[0]
    model.train()
    order = list(range(len(samples)))
    units = prompt_units(samples, order)
    assert len(units) == 3 and all(len(u) == len(samples) // 3 for u in units)
    padded, padded_grads = _logprobs_and_grads(model, collate_padded(samples, order, 0, CPU), order)
    shared, shared_grads = _logprobs_and_grads(model, collate_shared_prefix(samples, units, 0, CPU), order)
    assert len(shared) == sum(len(s.response_ids) for s in samples)
    torch.testing.assert_close(shared, padded, rtol=0, atol=1e-5)
    for a, b in zip(shared_grads, padded_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_continuation_tiers_split_only_where_the_padding_saved_pays_for_a_forward():
    assert continuation_tiers([]) == []
    assert continuation_tiers([7, 7, 7]) == [(0, 3)]
    # One long answer and many short ones: the short ones stop padding to its length.
    assert continuation_tiers([40] + [2] * 50) == [(0, 1), (1, 51)]
    # Saving less than a forward's fixed cost: one tier.
    assert 2 * 3 <= TIER_OVERHEAD_TOKENS and continuation_tiers([10, 8, 8, 8]) == [(0, 4)]
    tiers = continuation_tiers(sorted([1, 3, 60, 2, 90, 4] * 20, reverse=True))
    assert tiers[0][0] == 0 and tiers[-1][1] == 120
    assert all(a[1] == b[0] for a, b in zip(tiers, tiers[1:], strict=False))  # contiguous, every row once


def test_the_planner_shares_prompts_where_it_saves_tokens_and_pads_elsewhere():
    long_prompts = _grouped(30, [[2, 3, 4, 2, 3, 4, 2, 3]])
    plan = plan_micro_batches(long_prompts, list(range(len(long_prompts))), 4096, allow_shared_prefix=True)
    assert plan.shared_prefix and plan.processed_tokens < 0.5 * sum(s.num_tokens for s in long_prompts)
    assert not plan_micro_batches(long_prompts, list(range(24)), 4096, allow_shared_prefix=False).shared_prefix
    # One sample per prompt: nothing to share, the padded layout runs.
    singles = _samples(8, 1)
    assert not plan_micro_batches(singles, list(range(8)), 4096, allow_shared_prefix=True).shared_prefix


def test_a_group_larger_than_the_budget_is_cut_into_units_that_fit():
    samples = _grouped(10, [[6] * 16], prompts=2)
    budget = 48
    batches = plan_shared_prefix(samples, list(range(len(samples))), budget)
    seen = sorted(i for b in batches for u in b for i in u)
    assert seen == list(range(len(samples)))  # every sample exactly once
    for b in batches:
        assert shared_prefix_cost(samples, b) <= budget
        for unit in b:
            assert len({tuple(samples[i].prompt_ids) for i in unit}) == 1  # a unit shares one prompt
    assert len(batches) > 2


def test_a_train_step_in_the_shared_prefix_layout_matches_the_padded_one():
    samples = _grouped(14, [[1, 2, 5, 3, 1, 12, 2, 1]], prompts=4)
    results = {}
    for shared in (True, False):
        policy, tok = _policy()
        trainer = Trainer(_spec("trainer.lr=0.001", "trainer.layout=padded"), policy, tok, "cpu")
        assert trainer.shared_prefix_allowed  # `auto` shares the prompts in packed rows instead (test_packed)
        trainer.shared_prefix_allowed = shared
        results[shared] = trainer.train_step(samples, 0)
    on, off = results[True], results[False]
    for key in (LOSS_POLICY, GRAD_NORM):
        assert on[key] == pytest.approx(off[key], rel=1e-4, abs=1e-6), key
    assert on[SHARED_PREFIX_SHARE] == 1.0 and off[SHARED_PREFIX_SHARE] == 0.0
    assert on[COMPUTED_TOKENS_RATIO] < 0.6 < 1.0 < off[COMPUTED_TOKENS_RATIO]  # padding makes it above 1


def test_the_shared_prefix_layout_is_not_used_where_it_cannot_act():
    # Gradient checkpointing drops the prompt cache's graph (checked in test_parallel); a critic reads the
    # padded layout; fsdp would need every rank to agree on the layout (checked in test_parallel's fsdp runs).
    policy, tok = _policy()
    ppo = Trainer(_spec("algorithm.name=ppo"), policy, tok, "cpu", critic=ValueModel.from_policy(policy))
    assert not ppo.shared_prefix_allowed
