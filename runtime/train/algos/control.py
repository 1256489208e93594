"""The learning math of control tasks (Gymnasium environments): small pure functions, tensors in, tensors out.

Shapes use these letters: ``T`` steps of a trajectory segment, ``E`` environments stepped together
(one vector env), ``N`` transitions of a (mini-)batch, ``A`` actions (Q-values per observation).

Sources, and where we deviate:

- GAE: Schulman et al. 2016, *High-Dimensional Continuous Control Using Generalized Advantage
  Estimation* (arXiv:1506.02438), eq. 16, over ``[T, E]`` segments. Episode ends follow Pardo et al.
  2018, *Time Limits in Reinforcement Learning* (arXiv:1712.00378): a *terminated* episode's last
  transition has no future value; a *truncated* one (time limit) bootstraps from the value of its
  final observation. Either way the advantage recursion stops at the episode's end. The value after
  the segment's last step bootstraps from the next observation (truncated GAE at the segment end).
- Clipped surrogate: Schulman et al. 2017, *Proximal Policy Optimization Algorithms*
  (arXiv:1707.06347), eq. 7; the per-element math is :func:`runtime.train.algos.core.clipped_surrogate`,
  averaged here over a minibatch of transitions. Value clipping as in OpenAI baselines
  (:func:`runtime.train.algos.core.value_loss`), optional here.
- approx-KL: J. Schulman, *Approximating KL Divergence* (2020 note), the k3 estimator
  ``(r - 1) - log r`` of KL(old || new) under the old policy's samples, ``r = pi_new / pi_old``.
- DQN: Mnih et al. 2015, *Human-level control through deep reinforcement learning* (Nature 518):
  TD target from a target network, the error clipped to [-1, 1], which is the gradient of the Huber
  loss used here; ε-greedy exploration annealed linearly.
- Double DQN target: van Hasselt et al. 2016, *Deep Reinforcement Learning with Double Q-learning*
  (arXiv:1509.06461), eq. 4: the online network picks the next action, the target network values it.
- Polyak averaging of the target network: Lillicrap et al. 2016, *Continuous control with deep
  reinforcement learning* (arXiv:1509.02971), section 3: ``theta' <- tau theta + (1 - tau) theta'``;
  ``tau = 1`` is DQN's hard copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from runtime.train.algos.core import clipped_surrogate
from runtime.train.algos.core import value_loss as clipped_value_loss


def gae_segment(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over one segment (Schulman et al. 2016, eq. 16), ``[T, E]``.

    ``values[t]`` is V(s_t); ``next_values[t]`` is V of the state that followed step ``t``: the
    next step's observation, or for the step that ended an episode that episode's final observation
    (not the next episode's first), or for the segment's last step the observation after it.
    ``terminated`` / ``truncated`` (bool) mark the step that ended an episode:

    - ``delta_t = r_t + gamma * V(s_{t+1}) * (1 - terminated_t) - V(s_t)``: a terminated episode has
      no future; a truncated one bootstraps from its final observation;
    - ``A_t = delta_t + gamma * lam * (1 - done_t) * A_{t+1}``, ``done = terminated | truncated``,
      ``A_T = 0``: nothing of the next episode leaks back, and the segment's end is a cut.

    Returns ``(advantages, returns)``, both ``[T, E]``; ``returns = advantages + values`` are the
    critic's targets. A step both terminated and truncated counts as terminated.
    """
    shape = rewards.shape
    if rewards.dim() != 2 or not (values.shape == next_values.shape == terminated.shape == truncated.shape == shape):
        raise ValueError("rewards, values, next_values, terminated and truncated must all be [T, E]")
    alive = (~terminated).to(values.dtype)
    continues = (~(terminated | truncated)).to(values.dtype)
    deltas = rewards.to(values.dtype) + gamma * next_values * alive - values
    advantages = torch.zeros_like(values)
    running = torch.zeros(shape[1], dtype=values.dtype, device=values.device)
    for t in range(shape[0] - 1, -1, -1):
        running = deltas[t] + gamma * lam * continues[t] * running
        advantages[t] = running
    return advantages, advantages + values


def standardize(values: Tensor, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / (std + eps)`` over all of ``values`` (population std): PPO's advantage normalisation."""
    return (values - values.mean()) / (values.std(unbiased=False) + eps)


def ppo_policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, clip: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped-surrogate loss of a minibatch (Schulman et al. 2017, eq. 7), negated for descent.

    All inputs ``[N]``; ``logprobs`` carry gradient, the others are detached. Returns the mean loss
    and detached scalar metrics: ``clip_fraction`` (share of transitions where the clip changed the
    objective) and ``approx_kl`` (k3 estimate of KL(old || new), Schulman 2020).
    """
    if not (logprobs.shape == old_logprobs.shape == advantages.shape) or logprobs.dim() != 1:
        raise ValueError("logprobs, old_logprobs and advantages must all be [N]")
    ones = torch.ones_like(logprobs)
    loss, per = clipped_surrogate(logprobs, old_logprobs, advantages, ones, clip, clip)
    log_ratio = (logprobs - old_logprobs).detach()
    approx_kl = (torch.exp(log_ratio) - 1.0) - log_ratio
    return loss.mean(), {"clip_fraction": per["clip_fraction"].mean(), "approx_kl": approx_kl.mean()}


def ppo_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float | None) -> Tensor:
    """Critic loss of a minibatch, ``[N]`` inputs, mean of ``0.5 * (V - R)^2``.

    With ``clip``, PPO's value clipping: ``0.5 * max((V - R)^2, (V_clip - R)^2)`` where
    ``V_clip = V_old + clamp(V - V_old, -clip, clip)`` (OpenAI baselines; ``core.value_loss``).
    """
    if not (values.shape == old_values.shape == returns.shape) or values.dim() != 1:
        raise ValueError("values, old_values and returns must all be [N]")
    if clip is None:
        return (0.5 * (values - returns) ** 2).mean()
    loss, _ = clipped_value_loss(values, old_values, returns, torch.ones_like(values), clip)
    return loss.mean()


def double_dqn_targets(
    rewards: Tensor,
    terminated: Tensor,
    next_q_online: Tensor,
    next_q_target: Tensor,
    gamma: float,
) -> Tensor:
    """Double-DQN TD targets (van Hasselt et al. 2016, eq. 4), ``[N]``, no gradient.

    ``y = r + gamma * (1 - terminated) * Q_target(s', argmax_a Q_online(s', a))``. ``rewards`` and
    ``terminated`` (bool) are ``[N]``; ``next_q_online`` / ``next_q_target`` are ``[N, A]`` for the
    state after the transition (a truncated episode's final observation, so it bootstraps).
    """
    if next_q_online.shape != next_q_target.shape or next_q_online.dim() != 2:
        raise ValueError("next_q_online and next_q_target must both be [N, A]")
    if not (rewards.shape == terminated.shape == next_q_online.shape[:1]):
        raise ValueError("rewards and terminated must be [N], N the rows of the Q-values")
    with torch.no_grad():
        best = next_q_online.argmax(dim=1, keepdim=True)
        next_value = next_q_target.gather(1, best).squeeze(1)
        return rewards.to(next_value.dtype) + gamma * (~terminated).to(next_value.dtype) * next_value


def td_loss(q_taken: Tensor, targets: Tensor, delta: float = 1.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Huber loss of the TD errors (Mnih et al. 2015's clipped error), ``[N]`` inputs, mean.

    Returns ``(loss, {"td_error": mean |Q - y|, "q_mean": mean Q of the actions taken})``, both detached.
    """
    if q_taken.shape != targets.shape or q_taken.dim() != 1:
        raise ValueError("q_taken and targets must both be [N]")
    loss = torch.nn.functional.huber_loss(q_taken, targets.detach(), delta=delta)
    return loss, {"td_error": (q_taken - targets).abs().mean().detach(), "q_mean": q_taken.mean().detach()}


def linear_schedule(start: float, end: float, duration: int, t: int) -> float:
    """``start`` moving linearly to ``end`` over ``duration`` steps, then ``end`` (Mnih et al. 2015's ε)."""
    if duration <= 0 or t >= duration:
        return end
    return start + (end - start) * max(t, 0) / duration


def epsilon_greedy_logprobs(actions: Tensor, greedy_actions: Tensor, epsilon: float, num_actions: int) -> Tensor:
    """Log-probability of ``actions`` ``[N]`` under ε-greedy around ``greedy_actions`` ``[N]``.

    The greedy action has probability ``1 - ε + ε / A``, every other ``ε / A``.
    """
    explore = epsilon / num_actions
    probs = torch.where(actions == greedy_actions, 1.0 - epsilon + explore, explore)
    return torch.log(probs.to(torch.float32))


@torch.no_grad()
def polyak_update_(target: Iterable[Tensor], online: Iterable[Tensor], tau: float) -> None:
    """In place: ``target <- tau * online + (1 - tau) * target`` for each pair (Lillicrap et al. 2016).

    ``tau = 1`` copies (DQN's hard sync). Pass parameters, not buffers: statistics such as an
    observation normaliser's are copied, not averaged.
    """
    if not 0.0 < tau <= 1.0 or math.isnan(tau):
        raise ValueError(f"tau must be in (0, 1], got {tau}")
    targets, onlines = list(target), list(online)
    if len(targets) != len(onlines):
        raise ValueError(f"{len(targets)} target tensors for {len(onlines)} online ones")
    if tau == 1.0:
        for t, o in zip(targets, onlines, strict=True):
            t.copy_(o)
    elif targets:  # one call per list, not per tensor: a small network's sync is mostly call overhead
        torch._foreach_mul_(targets, 1.0 - tau)
        torch._foreach_add_(targets, onlines, alpha=tau)
