"""Numeric tests of the control math in runtime.train.algos.control, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.train.algos.control import (
    double_dqn_targets,
    epsilon_greedy_logprobs,
    gae_segment,
    linear_schedule,
    polyak_update_,
    ppo_policy_loss,
    ppo_value_loss,
    standardize,
    td_loss,
)

# --------------------------------------------------------------------------- GAE


def test_gae_bootstraps_a_truncated_episode_from_its_final_observation_and_not_a_terminated_one():
    # Two copies, three steps, gamma = lam = 0.5, reward 1 everywhere. Both episodes end at t = 1:
    # copy 0 by truncation, copy 1 by termination; t = 2 starts a new episode.
    # V(s_t) = 1, 2, 4; V(final obs of the ended episode) = 8; V(obs after the segment) = 6.
    rewards = torch.ones(3, 2)
    values = torch.tensor([[1.0, 1.0], [2.0, 2.0], [4.0, 4.0]])
    next_values = torch.tensor([[2.0, 2.0], [8.0, 8.0], [6.0, 6.0]])
    terminated = torch.tensor([[False, False], [False, True], [False, False]])
    truncated = torch.tensor([[False, False], [True, False], [False, False]])

    adv, ret = gae_segment(rewards, values, next_values, terminated, truncated, gamma=0.5, lam=0.5)

    # t=2: delta = 1 + 0.5*6 - 4 = 0 for both.
    # copy 0, t=1 (truncated): delta = 1 + 0.5*8 - 2 = 3; the next episode's A does not flow back: A = 3.
    # copy 1, t=1 (terminated): delta = 1 + 0 - 2 = -1: A = -1.
    # t=0: delta = 1 + 0.5*2 - 1 = 1; A = 1 + 0.25 * A_1 -> 1.75 and 0.75.
    assert adv.tolist() == [[1.75, 0.75], [3.0, -1.0], [0.0, 0.0]]
    assert ret.tolist() == [[2.75, 1.75], [5.0, 1.0], [4.0, 4.0]]


def test_gae_a_step_both_terminated_and_truncated_counts_as_terminated():
    rewards, values, next_values = torch.ones(1, 1), torch.zeros(1, 1), torch.full((1, 1), 10.0)
    yes = torch.ones(1, 1, dtype=torch.bool)
    adv, _ = gae_segment(rewards, values, next_values, yes, yes, gamma=0.9, lam=0.9)
    assert adv.tolist() == [[1.0]]


def test_gae_without_episode_ends_with_lambda_one_is_the_discounted_return_bootstrapped_at_the_segment_end():
    gamma = 0.9
    rewards = torch.tensor([[1.0], [2.0], [3.0]], dtype=torch.float64)
    values = torch.tensor([[0.5], [-1.0], [2.0]], dtype=torch.float64)
    next_values = torch.tensor([[-1.0], [2.0], [7.0]], dtype=torch.float64)
    never = torch.zeros(3, 1, dtype=torch.bool)
    adv, _ = gae_segment(rewards, values, next_values, never, never, gamma=gamma, lam=1.0)
    for t in range(3):
        discounted = sum(gamma ** (k - t) * rewards[k, 0].item() for k in range(t, 3))
        want = discounted + gamma ** (3 - t) * 7.0 - values[t, 0].item()
        assert adv[t, 0].item() == pytest.approx(want, abs=1e-12)


def test_gae_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        z = torch.zeros(3, 2)
        gae_segment(z, z, torch.zeros(3, 1), z.bool(), z.bool(), 0.9, 0.9)


# --------------------------------------------------------------------------- PPO


def test_ppo_policy_loss_clips_the_ratio_and_reports_clip_fraction_and_approx_kl():
    ratios = torch.tensor([1.5, 0.5, 1.0])
    old = torch.zeros(3)
    new = torch.log(ratios)
    advantages = torch.tensor([1.0, 1.0, -1.0])

    loss, metrics = ppo_policy_loss(new, old, advantages, clip=0.2)

    # ratio 1.5, A = 1: min(1.5, 1.2) = 1.2 (clipped); ratio 0.5, A = 1: min(0.5, 0.8) = 0.5; ratio 1, A = -1: -1.
    assert loss.item() == pytest.approx(-(1.2 + 0.5 - 1.0) / 3, abs=1e-6)
    assert metrics["clip_fraction"].item() == pytest.approx(1 / 3, abs=1e-6)
    k3 = [(r - 1) - math.log(r) for r in (1.5, 0.5, 1.0)]
    assert metrics["approx_kl"].item() == pytest.approx(sum(k3) / 3, abs=1e-6)


def test_ppo_policy_loss_gradient_vanishes_where_clipped():
    new = torch.log(torch.tensor([1.5, 1.1])).requires_grad_()
    loss, _ = ppo_policy_loss(new, torch.zeros(2), torch.tensor([1.0, 1.0]), clip=0.2)
    loss.backward()
    assert new.grad is not None
    assert new.grad[0].item() == 0.0  # clipped: no pull
    assert new.grad[1].item() == pytest.approx(-1.1 / 2, abs=1e-6)  # d(-r/2)/dlogr = -r/2


def test_ppo_value_loss_plain_and_clipped():
    values = torch.tensor([3.0, 0.0])
    old = torch.tensor([1.0, 0.0])
    returns = torch.tensor([1.0, 2.0])
    # Plain: 0.5 * mean(4, 4) = 2.
    assert ppo_value_loss(values, old, returns, clip=None).item() == pytest.approx(2.0)
    # Clip 0.5: V_clip = 1.5 -> (0.5)^2 vs (2)^2: max 4; second: V_clip = 0 -> 4 vs 4. 0.5 * mean(4, 4) = 2.
    assert ppo_value_loss(values, old, returns, clip=0.5).item() == pytest.approx(2.0)
    # Where clipping makes it worse it counts: V = 0.5, old = 0, R = 2, clip 0.2: V_clip = 0.2 -> max(2.25, 3.24).
    got = ppo_value_loss(torch.tensor([0.5]), torch.tensor([0.0]), torch.tensor([2.0]), clip=0.2)
    assert got.item() == pytest.approx(0.5 * 3.24, abs=1e-6)


def test_standardize_gives_zero_mean_unit_std():
    x = standardize(torch.tensor([1.0, 2.0, 3.0, 6.0]))
    assert x.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert x.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-6)


# --------------------------------------------------------------------------- DQN


def test_double_dqn_target_values_the_online_argmax_with_the_target_network():
    rewards = torch.tensor([1.0, 1.0, 2.0])
    terminated = torch.tensor([False, False, True])
    # Online picks action 0, 1, 1; the target network would have picked differently in rows 0 and 1.
    online = torch.tensor([[5.0, 1.0], [0.0, 3.0], [0.0, 9.0]])
    target = torch.tensor([[2.0, 10.0], [7.0, 4.0], [100.0, 100.0]])
    y = double_dqn_targets(rewards, terminated, online, target, gamma=0.5)
    assert y.tolist() == [1.0 + 0.5 * 2.0, 1.0 + 0.5 * 4.0, 2.0]  # terminated: the reward alone


def test_td_loss_is_huber_and_reports_mean_abs_error_and_q():
    q = torch.tensor([1.5, 4.0], requires_grad=True)
    targets = torch.tensor([1.0, 1.0])
    loss, metrics = td_loss(q, targets)
    # |0.5| -> 0.5 * 0.25 = 0.125; |3| -> 3 - 0.5 = 2.5; mean 1.3125.
    assert loss.item() == pytest.approx(1.3125)
    assert metrics["td_error"].item() == pytest.approx(1.75)
    assert metrics["q_mean"].item() == pytest.approx(2.75)
    loss.backward()
    assert q.grad is not None and q.grad.tolist() == pytest.approx([0.25, 0.5])  # error clipped at 1, / N


def test_linear_schedule():
    assert [linear_schedule(1.0, 0.1, 10, t) for t in (0, 5, 10, 20)] == pytest.approx([1.0, 0.55, 0.1, 0.1])
    assert linear_schedule(1.0, 0.1, 0, 0) == 0.1


def test_epsilon_greedy_logprobs():
    got = epsilon_greedy_logprobs(torch.tensor([0, 3, 2]), torch.tensor([0, 1, 2]), epsilon=0.2, num_actions=4)
    assert got.exp().tolist() == pytest.approx([0.85, 0.05, 0.85])


def test_polyak_update_moves_the_target_by_exactly_tau():
    target = [torch.zeros(3), torch.full((2, 2), 4.0)]
    online = [torch.ones(3), torch.zeros(2, 2)]
    polyak_update_(target, online, tau=0.25)
    assert target[0].tolist() == [0.25, 0.25, 0.25]  # dyadic values: exact in float32
    assert target[1].tolist() == [[3.0, 3.0], [3.0, 3.0]]
    polyak_update_(target, online, tau=0.25)
    assert target[0].tolist() == [0.4375] * 3
    assert online[0].tolist() == [1.0, 1.0, 1.0]  # the online side is untouched


def test_polyak_with_tau_one_copies_and_bad_tau_is_refused():
    target, online = [torch.zeros(2)], [torch.tensor([0.1, -7.3])]
    polyak_update_(target, online, tau=1.0)
    assert torch.equal(target[0], online[0])
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="tau"):
            polyak_update_(target, online, tau=bad)
