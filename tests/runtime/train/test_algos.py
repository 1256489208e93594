"""Numeric tests of the pure learning math in runtime.train.algos, and of the algorithm registry."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.spec import AlgorithmSpec
from runtime.train.algos import (
    Algorithm,
    AlgorithmError,
    PolicyBatch,
    adamw_update,
    aggregate_loss,
    clipped_surrogate,
    gae,
    get_algorithm,
    grpo_advantages,
    importance_weights,
    kl_k3,
    registered_algorithms,
    value_loss,
)
from runtime.train.algos.grpo import policy_loss

torch.set_num_threads(1)


# --------------------------------------------------------------------------- GRPO advantages


def _grpo_loop(rewards: list[float], groups: list[int], normalize_std: bool, eps: float = 1e-6) -> list[float]:
    out = []
    for r, g in zip(rewards, groups, strict=True):
        members = [x for x, h in zip(rewards, groups, strict=True) if h == g]
        mean = sum(members) / len(members)
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / len(members))
        out.append((r - mean) / (std + eps) if normalize_std else r - mean)
    return out


@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_advantages_vectorised_equals_loop(normalize_std):
    gen = torch.Generator().manual_seed(0)
    # Groups of different sizes, interleaved and in no particular order.
    groups = torch.tensor([3, 1, 3, 7, 1, 7, 7, 3, 1, 1, 42, 42])
    rewards = torch.rand(len(groups), generator=gen)
    got = grpo_advantages(rewards, groups, normalize_std=normalize_std)
    want = _grpo_loop(rewards.tolist(), groups.tolist(), normalize_std)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(want, abs=1e-6)


def test_grpo_advantages_hand_computed_and_zero_std_group():
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 1])
    # Group 0: mean 0.5, population std 0.5 -> +-0.5 / (0.5 + 1e-6). Group 1: all equal -> exactly 0.
    got = grpo_advantages(rewards, groups)
    assert got.tolist() == pytest.approx([0.5 / 0.500001, -0.5 / 0.500001, 0.0, 0.0, 0.0], abs=1e-7)
    assert got[2:].tolist() == [0.0, 0.0, 0.0]
    assert not torch.isnan(got).any()
    assert grpo_advantages(rewards, groups, normalize_std=False).tolist() == [0.5, -0.5, 0.0, 0.0, 0.0]


def test_grpo_advantages_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="same length"):
        grpo_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))


# --------------------------------------------------------------------------- GAE


def test_gae_hand_computed_with_padding():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])  # 5.0 sits in padding and must be ignored
    values = torch.tensor([[0.5, 0.6, 0.7], [0.1, 0.2, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # Row 0: d2 = 1 - 0.7 = 0.3; d1 = 0.9*0.7 - 0.6 = 0.03; d0 = 0.9*0.6 - 0.5 = 0.04; gamma*lam = 0.72.
    a2 = 0.3
    a1 = 0.03 + 0.72 * a2
    a0 = 0.04 + 0.72 * a1
    # Row 1: the value after the last real token is 0: d1 = 2 - 0.2 = 1.8; d0 = 0.9*0.2 - 0.1 = 0.08.
    b1 = 1.8
    b0 = 0.08 + 0.72 * b1
    assert adv.tolist() == [pytest.approx([a0, a1, a2], abs=1e-6), pytest.approx([b0, b1, 0.0], abs=1e-6)]
    assert ret.tolist() == [
        pytest.approx([a0 + 0.5, a1 + 0.6, a2 + 0.7], abs=1e-6),
        pytest.approx([b0 + 0.1, b1 + 0.2, 0.0], abs=1e-6),
    ]


def test_gae_with_gamma_lambda_one_is_return_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 3.0]])
    values = torch.tensor([[1.0, 2.0, 0.5, -1.0]])
    adv, ret = gae(rewards, values, torch.ones(1, 4), gamma=1.0, lam=1.0)
    assert adv.tolist() == [[2.0, 1.0, 2.5, 4.0]]
    assert ret.tolist() == [[3.0, 3.0, 3.0, 3.0]]


# --------------------------------------------------------------------------- clipping


def _surrogate_grad(ratio: float, advantage: float, **kw) -> tuple[float, float, float]:
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, metrics = clipped_surrogate(
        logp, torch.zeros(1, 1), torch.tensor([[advantage]]), torch.ones(1, 1), clip_low=0.2, clip_high=0.2, **kw
    )
    loss.sum().backward()
    return float(loss.detach()), float(logp.grad), float(metrics["clip_fraction"])


@pytest.mark.parametrize(("ratio", "advantage"), [(1.5, 1.0), (0.5, -1.0), (1.21, 2.0), (0.79, -0.5)])
def test_ratio_outside_clip_range_gives_zero_gradient(ratio, advantage):
    loss, grad, clipped = _surrogate_grad(ratio, advantage)
    assert grad == 0.0
    assert clipped == 1.0
    bound = 1.2 if advantage > 0 else 0.8
    assert loss == pytest.approx(-advantage * bound)


@pytest.mark.parametrize(("ratio", "advantage"), [(1.1, 1.0), (0.9, -1.0), (0.5, 1.0), (1.5, -1.0)])
def test_ratio_on_the_improving_side_keeps_gradient(ratio, advantage):
    # Inside the range, or outside it on the side where the unclipped term is the pessimistic one.
    loss, grad, clipped = _surrogate_grad(ratio, advantage)
    assert loss == pytest.approx(-advantage * ratio)
    assert grad == pytest.approx(-advantage * ratio)  # d(-A r)/d logp = -A r
    assert clipped == 0.0


def test_dual_clip_bounds_negative_advantage_loss():
    loss, grad, clipped = _surrogate_grad(5.0, -1.0, dual_clip=3.0)
    assert loss == pytest.approx(3.0)
    assert grad == 0.0
    assert clipped == 1.0
    # Below the bound nothing changes.
    assert _surrogate_grad(2.0, -1.0, dual_clip=3.0)[:2] == pytest.approx((2.0, 2.0))


def test_surrogate_weights_scale_loss_and_mask_zeroes_padding():
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    loss, _ = clipped_surrogate(
        logp,
        torch.zeros(1, 2),
        torch.tensor([[1.0, 1.0]]),
        torch.tensor([[1.0, 0.0]]),
        0.2,
        0.2,
        weights=torch.tensor([[0.5, 0.5]]),
    )
    assert loss.tolist() == [[-0.5, 0.0]]


def test_asymmetric_clip_upper_bound():
    logp = torch.tensor([[math.log(1.3)]], requires_grad=True)
    loss, _ = clipped_surrogate(logp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2, 0.28)
    loss.sum().backward()
    assert float(loss.detach()) == pytest.approx(-1.28)
    assert float(logp.grad) == 0.0


# --------------------------------------------------------------------------- loss aggregation

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])  # 100s are padding
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "want"),
    [("token-mean", 10 / 4), ("seq-mean-token-mean", (2.0 + 4.0) / 2), ("seq-mean-token-sum", (6.0 + 4.0) / 2)],
)
def test_loss_aggregation_hand_example(mode, want):
    assert float(aggregate_loss(LOSS, MASK, mode)) == pytest.approx(want)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_loss_aggregation_over_parts_with_global_counts_equals_whole(mode):
    whole = aggregate_loss(LOSS, MASK, mode)
    parts = sum(aggregate_loss(LOSS[i : i + 1], MASK[i : i + 1], mode, num_tokens=4, num_seqs=2) for i in range(2))
    assert float(parts) == pytest.approx(float(whole))


def test_loss_aggregation_ignores_empty_sequences_and_rejects_unknown_mode():
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert float(aggregate_loss(LOSS, mask, "seq-mean-token-mean")) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="algorithm.loss_agg"):
        aggregate_loss(LOSS, MASK, "sum")


# --------------------------------------------------------------------------- importance weights, KL


def test_importance_weights_are_truncated_at_cap_and_detached():
    behaviour = torch.zeros(1, 4)
    proximal = torch.tensor([[math.log(0.5), math.log(1.5), math.log(10.0), 0.0]], requires_grad=True)
    w = importance_weights(proximal, behaviour, cap=2.0)
    assert w.tolist() == [pytest.approx([0.5, 1.5, 2.0, 1.0])]
    assert not w.requires_grad
    with pytest.raises(ValueError, match="is_cap"):
        importance_weights(proximal, behaviour, cap=0.0)


def test_k3_is_non_negative_and_zero_when_equal():
    gen = torch.Generator().manual_seed(1)
    logp = -torch.rand(64, 8, generator=gen) * 5
    ref = -torch.rand(64, 8, generator=gen) * 5
    assert (kl_k3(logp, ref) >= 0).all()
    assert kl_k3(logp, logp).abs().max().item() == 0.0
    # d = log 2: exp(d) - d - 1 = 1 - log 2.
    assert float(kl_k3(torch.zeros(1), torch.tensor([math.log(2.0)]))) == pytest.approx(1 - math.log(2.0))


def test_value_loss_is_clipped_pessimistically():
    values = torch.tensor([[2.0, 0.0]])
    old = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0]])
    loss, metrics = value_loss(values, old, returns, torch.ones(1, 2), clip=0.5)
    # Token 0: unclipped (2-0)^2 = 4, clipped (0.5-0)^2 = 0.25 -> max 4 -> 2.0. Token 1: both 1 -> 0.5.
    assert loss.tolist() == [[2.0, 0.5]]
    assert metrics["value_clip_fraction"].tolist() == [[0.0, 0.0]]
    loss, metrics = value_loss(
        torch.tensor([[0.2]]), torch.tensor([[0.0]]), torch.tensor([[-1.0]]), torch.ones(1, 1), 0.1
    )
    # unclipped (1.2)^2 = 1.44, clipped (0.1 + 1)^2 = 1.21 -> unclipped wins.
    assert float(loss) == pytest.approx(0.72)


# --------------------------------------------------------------------------- GRPO policy loss


def _batch(**over) -> PolicyBatch:
    fields = dict(
        logprobs=torch.zeros(1, 2, requires_grad=True),
        old_logprobs=torch.zeros(1, 2),
        behaviour_logprobs=torch.zeros(1, 2),
        advantages=torch.tensor([[1.0, -1.0]]),
        mask=torch.ones(1, 2),
    )
    fields.update(over)
    return PolicyBatch(**fields)


def test_policy_loss_adds_kl_only_with_positive_coef():
    ref = torch.tensor([[math.log(2.0), 0.0]])
    no_kl, metrics = policy_loss(_batch(ref_logprobs=ref), AlgorithmSpec(kl_coef=0.0))
    assert no_kl.tolist() == [[-1.0, 1.0]]
    assert metrics["kl_ref"].tolist() == [pytest.approx([1 - math.log(2.0), 0.0])]
    with_kl, metrics = policy_loss(_batch(ref_logprobs=ref), AlgorithmSpec(kl_coef=0.5))
    assert with_kl.tolist() == [pytest.approx([-1.0 + 0.5 * (1 - math.log(2.0)), 1.0])]
    assert metrics["loss/kl"].tolist() == [pytest.approx([0.5 * (1 - math.log(2.0)), 0.0])]


def test_policy_loss_entropy_bonus():
    entropy = torch.tensor([[2.0, 3.0]])
    loss, metrics = policy_loss(_batch(entropy=entropy), AlgorithmSpec(entropy_coef=0.1))
    assert loss.tolist() == [pytest.approx([-1.0 - 0.2, 1.0 - 0.3])]
    assert metrics["entropy"].tolist() == [[2.0, 3.0]]


def test_truncated_mode_uses_dual_clip():
    logp = torch.tensor([[math.log(5.0), 0.0]], requires_grad=True)
    loss, _ = policy_loss(_batch(logprobs=logp), AlgorithmSpec(off_policy="truncated", is_cap=3.0))
    assert loss.tolist() == [pytest.approx([-1.2, 1.0])]  # token 0: A>0 clipped at 1.2; token 1 unchanged
    logp = torch.tensor([[0.0, math.log(5.0)]], requires_grad=True)
    loss, _ = policy_loss(_batch(logprobs=logp), AlgorithmSpec(off_policy="truncated", is_cap=3.0))
    assert loss.tolist() == [pytest.approx([-1.0, 3.0])]  # token 1: A<0, ratio 5 bounded at the cap 3
    loss, _ = policy_loss(_batch(logprobs=logp), AlgorithmSpec(off_policy="decoupled", is_cap=3.0))
    assert loss.tolist() == [pytest.approx([-1.0, 5.0])]  # no dual clip outside `truncated`


# --------------------------------------------------------------------------- registry and plug-ins


def _reinforce_loss(batch, config):
    return -batch.advantages * batch.logprobs * batch.mask, {}


def make_plugin():
    return _reinforce_loss, adamw_update


def make_plugin_algorithm():
    return Algorithm(name="reinforce", loss_fn=_reinforce_loss, update_fn=adamw_update)


def make_nothing():
    return 42


def test_builtins_are_registered():
    assert {"grpo", "ppo"} <= set(registered_algorithms())
    assert get_algorithm("grpo").advantages == "group"
    ppo = get_algorithm("ppo")
    assert (ppo.advantages, ppo.needs_critic) == ("gae", True)


def test_plugin_by_import_path_from_a_pair_or_an_algorithm():
    algo = get_algorithm(f"{__name__}:make_plugin")
    assert algo.loss_fn is _reinforce_loss
    assert algo.update_fn is adamw_update
    assert algo.advantages == "group"
    assert algo.name == f"{__name__}:make_plugin"
    assert get_algorithm(f"{__name__}:make_plugin_algorithm").name == "reinforce"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("nope", "unknown algorithm 'nope'"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        (f"{__name__}:missing", "has no callable 'missing'"),
        (f"{__name__}:make_nothing", "returned int"),
        (":f", "must look like"),
    ],
)
def test_bad_algorithm_names_are_clear_errors(name, message):
    with pytest.raises(AlgorithmError, match="algorithm.name") as info:
        get_algorithm(name)
    assert message in str(info.value)


def test_adamw_update_skips_a_non_finite_gradient():
    from runtime.train.algos import UpdateContext

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.tensor([[1.0, float("nan"), 0.0]])).sum().backward()
    result = adamw_update(UpdateContext(model, optimizer, scheduler, grad_clip=1.0, step=0))
    assert math.isnan(result["grad_norm"])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert scheduler.last_epoch == 1
    # A finite gradient is applied.
    model(torch.tensor([[1.0, 2.0, 0.0]])).sum().backward()
    assert adamw_update(UpdateContext(model, optimizer, scheduler, grad_clip=1.0, step=1))["grad_norm"] > 0
    assert not torch.equal(before[0], model.weight)
