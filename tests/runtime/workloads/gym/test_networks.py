"""Networks and observation normalisation: shapes, seeded initialisation, sampling from the caller's generator."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.workloads.gym.envs import SpaceInfo
from runtime.workloads.gym.networks import (
    EpsilonGreedyPolicy,
    GaussianActor,
    build_actor,
    build_critic,
    build_q_network,
)
from runtime.workloads.gym.obs_norm import ObservationNormalizer

DISCRETE = SpaceInfo(obs_dim=3, action_kind="discrete", action_dim=4)
BOX = SpaceInfo(obs_dim=3, action_kind="box", action_dim=2, action_low=(-1.0, -1.0), action_high=(1.0, 1.0))


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_the_normaliser_tracks_the_mean_and_variance_of_everything_it_saw():
    norm = ObservationNormalizer(2)
    batches = [torch.randn(n, 2, generator=gen(n), dtype=torch.float64) * 3 + 5 for n in (7, 1, 30)]
    for b in batches:
        norm.update(b)
    data = torch.cat(batches)
    # The prior (count 1e-4 at mean 0, variance 1) weighs almost nothing.
    assert norm.mean.tolist() == pytest.approx(data.mean(0).tolist(), rel=1e-4)
    assert norm.var.tolist() == pytest.approx(data.var(0, unbiased=False).tolist(), rel=1e-4)
    assert float(norm.count) == pytest.approx(38 + 1e-4)
    out = norm(torch.tensor([[5.0, 5.0], [1e6, -1e6]]))
    assert out.dtype == torch.float32
    assert out[1].tolist() == [10.0, -10.0]  # clipped


def test_the_normaliser_state_is_part_of_the_network_state():
    actor = build_actor(DISCRETE, [8], gen(), normalize_obs=True)
    assert {"obs_norm.mean", "obs_norm.var", "obs_norm.count"} <= set(actor.state_dict())
    assert "obs_norm.mean" not in build_actor(DISCRETE, [8], gen()).state_dict()


def test_building_is_seeded_by_the_generator_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = build_actor(DISCRETE, [16, 16], gen(1)).state_dict()
    b = build_actor(DISCRETE, [16, 16], gen(1)).state_dict()
    c = build_actor(DISCRETE, [16, 16], gen(2)).state_dict()
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["body.0.weight"], c["body.0.weight"])
    assert torch.equal(a["body.0.bias"], torch.zeros(16))


def test_orthogonal_init_with_a_small_policy_head():
    actor = build_actor(DISCRETE, [16], gen())
    head = actor.body[-1].weight  # [4, 16]: orthogonal rows scaled by 0.01
    assert torch.allclose(head @ head.T, 0.0001 * torch.eye(4), atol=1e-8)
    hidden = actor.body[0].weight  # [16, 3]: orthogonal columns scaled by sqrt(2)
    assert torch.allclose(hidden.T @ hidden, 2 * torch.eye(3), atol=1e-5)


def test_shapes_of_actor_critic_and_q():
    obs = torch.randn(5, 3, generator=gen())
    actions, logp = build_actor(DISCRETE, [8], gen()).act(obs, gen())
    assert actions.shape == (5,) and actions.dtype == torch.int64 and logp.shape == (5,)
    box_actions, box_logp = build_actor(BOX, [8], gen()).act(obs, gen())
    assert box_actions.shape == (5, 2) and box_logp.shape == (5,)
    assert build_critic(DISCRETE, [8], gen())(obs).shape == (5,)
    assert build_q_network(DISCRETE, [8], gen())(obs).shape == (5, 4)
    with pytest.raises(ValueError, match="Discrete"):
        build_q_network(BOX, [8], gen())


def test_sampling_uses_only_the_callers_generator():
    actor = build_actor(DISCRETE, [8], gen())
    obs = torch.randn(64, 3, generator=gen(5))
    torch.manual_seed(0)
    a1, _ = actor.act(obs, gen(9))
    torch.manual_seed(1)
    a2, _ = actor.act(obs, gen(9))
    assert torch.equal(a1, a2)


def test_the_gaussian_log_prob_is_the_diagonal_normal_density():
    actor = build_actor(BOX, [8], gen())
    assert isinstance(actor, GaussianActor)
    with torch.no_grad():
        actor.log_std.copy_(torch.tensor([0.5, -1.0]))
    obs = torch.randn(3, 3, generator=gen())
    actions, logp = actor.act(obs, gen(1))
    mean = actor.greedy(obs)
    std = torch.tensor([math.exp(0.5), math.exp(-1.0)])
    want = (-((actions - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)).sum(-1)
    assert logp.tolist() == pytest.approx(want.tolist(), abs=1e-5)
    assert actor.distribution(obs).entropy().tolist() == pytest.approx(
        [(0.5 - 1.0) + math.log(2 * math.pi * math.e)] * 3
    )


def test_epsilon_greedy_acts_greedily_at_zero_uniformly_at_one_and_draws_the_same_randomness():
    q = build_q_network(DISCRETE, [8], gen())
    obs = torch.randn(400, 3, generator=gen(2))
    greedy = EpsilonGreedyPolicy(q, 4, epsilon=0.0)
    g0 = gen(3)
    actions, logp = greedy.act(obs, g0)
    assert torch.equal(actions, q(obs).argmax(-1)) and torch.equal(logp, torch.zeros(400))
    uniform = EpsilonGreedyPolicy(q, 4, epsilon=1.0)
    g1 = gen(3)
    actions, logp = uniform.act(obs, g1)
    assert set(actions.tolist()) == {0, 1, 2, 3}
    assert logp.exp().tolist() == pytest.approx([0.25] * 400)
    assert torch.equal(g0.get_state(), g1.get_state())  # the stream advanced alike
    assert set(uniform.state_dict()) == {f"q.{k}" for k in q.state_dict()} | {"epsilon"}
