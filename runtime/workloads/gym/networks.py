"""Small torch MLPs for control: actors (the policies samplers run), a critic, a Q-network.

Observations come in flat, ``[N, D]`` float32 and raw; a network built with ``normalize_obs``
normalises them itself (:class:`~runtime.workloads.gym.obs_norm.ObservationNormalizer`, its
statistics part of the state dict that is published and checkpointed).

Initialisation, as is usual for PPO (Engstrom et al. 2020, *Implementation Matters in Deep Policy
Gradients*, arXiv:2005.12729; Andrychowicz et al. 2021, *What Matters in On-Policy Reinforcement
Learning?*, arXiv:2006.05990): orthogonal weights with gain sqrt(2) on hidden layers, 0.01 on the
policy's output (a near-uniform first policy), 1 on value and Q outputs; zero biases. The Gaussian
actor's log-std is a state-independent parameter starting at 0. All weights are drawn from a
generator the caller seeds, so building is deterministic and leaves the global RNG alone.

Every sampling policy (:class:`Policy`) draws its random numbers from a generator the sampler owns:
``act`` consumes the same amount of randomness whatever the weights, so a sampler's stream is
reproducible from its seed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, Protocol

import torch
from torch import Tensor, nn
from torch.distributions import Categorical, Distribution, Independent, Normal

from runtime.train.algos.control import epsilon_greedy_logprobs
from runtime.workloads.gym.envs import SpaceInfo
from runtime.workloads.gym.obs_norm import ObservationNormalizer

Activation = Literal["tanh", "relu"]
_ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU}


class Policy(Protocol):
    """What a sampler and the evaluation agent call on published weights."""

    def act(self, obs: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Actions for ``obs`` ``[E, D]`` and their log-probabilities ``[E]`` under this policy."""
        ...

    def greedy(self, obs: Tensor) -> Tensor:
        """The most likely action for each row of ``obs`` (evaluation)."""
        ...


def mlp(
    in_dim: int,
    hidden: Sequence[int],
    out_dim: int,
    activation: Activation,
    out_gain: float,
    generator: torch.Generator,
) -> nn.Sequential:
    """Linear layers of sizes ``in_dim -> *hidden -> out_dim`` with ``activation`` between, initialised orthogonally."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(_ACTIVATIONS)}, got {activation!r}")
    sizes = [in_dim, *hidden, out_dim]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        linear = torch.nn.utils.skip_init(nn.Linear, a, b)  # no default init: it would draw from the global RNG
        last = i == len(sizes) - 2
        nn.init.orthogonal_(linear.weight, gain=out_gain if last else math.sqrt(2.0), generator=generator)
        nn.init.zeros_(linear.bias)
        layers.append(linear)
        if not last:
            layers.append(_ACTIVATIONS[activation]())
    return nn.Sequential(*layers)


class _ObsNet(nn.Module):
    """A network whose input may pass through an observation normaliser first."""

    def __init__(self, obs_dim: int, normalize_obs: bool):
        super().__init__()
        self.obs_norm = ObservationNormalizer(obs_dim) if normalize_obs else None

    def inputs(self, obs: Tensor) -> Tensor:
        return self.obs_norm(obs) if self.obs_norm is not None else obs


class CategoricalActor(_ObsNet):
    """A policy over ``Discrete`` actions: logits from an MLP."""

    def __init__(
        self,
        obs_dim: int,
        num_actions: int,
        hidden: Sequence[int],
        activation: Activation,
        normalize_obs: bool,
        generator: torch.Generator,
    ):
        super().__init__(obs_dim, normalize_obs)
        self.body = mlp(obs_dim, hidden, num_actions, activation, 0.01, generator)

    def distribution(self, obs: Tensor) -> Distribution:
        """Categorical over actions, one per row of ``obs`` ``[N, D]``: ``log_prob(actions [N]) -> [N]``."""
        return Categorical(logits=self.body(self.inputs(obs)), validate_args=False)

    def act(self, obs: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        dist = self.distribution(obs)
        actions = torch.multinomial(dist.probs, 1, generator=generator).squeeze(1)  # type: ignore[attr-defined]
        return actions, dist.log_prob(actions)

    def greedy(self, obs: Tensor) -> Tensor:
        return self.body(self.inputs(obs)).argmax(dim=-1)


class GaussianActor(_ObsNet):
    """A policy over ``Box`` actions: a diagonal Gaussian, mean from an MLP, state-independent log-std.

    Actions are sampled unbounded; the sampler clips them to the space's bounds for the env and
    keeps the unclipped action, whose log-probability this is."""

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        hidden: Sequence[int],
        activation: Activation,
        normalize_obs: bool,
        generator: torch.Generator,
    ):
        super().__init__(obs_dim, normalize_obs)
        self.body = mlp(obs_dim, hidden, action_dim, activation, 0.01, generator)
        self.log_std = nn.Parameter(torch.zeros(action_dim))

    def distribution(self, obs: Tensor) -> Distribution:
        """Independent Normals, one row per observation: ``log_prob(actions [N, A]) -> [N]``, ``entropy() -> [N]``."""
        return self._around(self.body(self.inputs(obs)))

    def act(self, obs: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        mean = self.body(self.inputs(obs))
        noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype)
        actions = mean + self.log_std.exp() * noise
        return actions, self._around(mean).log_prob(actions)

    def greedy(self, obs: Tensor) -> Tensor:
        return self.body(self.inputs(obs))

    def _around(self, mean: Tensor) -> Distribution:
        return Independent(Normal(mean, self.log_std.exp().expand_as(mean), validate_args=False), 1)


class Critic(_ObsNet):
    """State value V(s): ``[N, D] -> [N]``."""

    def __init__(
        self,
        obs_dim: int,
        hidden: Sequence[int],
        activation: Activation,
        normalize_obs: bool,
        generator: torch.Generator,
    ):
        super().__init__(obs_dim, normalize_obs)
        self.body = mlp(obs_dim, hidden, 1, activation, 1.0, generator)

    def forward(self, obs: Tensor) -> Tensor:
        return self.body(self.inputs(obs)).squeeze(-1)


class QNetwork(_ObsNet):
    """Action values Q(s, ·): ``[N, D] -> [N, A]``."""

    def __init__(
        self,
        obs_dim: int,
        num_actions: int,
        hidden: Sequence[int],
        activation: Activation,
        normalize_obs: bool,
        generator: torch.Generator,
    ):
        super().__init__(obs_dim, normalize_obs)
        self.body = mlp(obs_dim, hidden, num_actions, activation, 1.0, generator)

    def forward(self, obs: Tensor) -> Tensor:
        return self.body(self.inputs(obs))


class EpsilonGreedyPolicy(nn.Module):
    """DQN's sampling policy: the greedy action of ``q`` or, with probability ``epsilon``, a uniform one.

    ``epsilon`` is a buffer, so the learner publishes it with the Q weights (its state dict is
    ``q.*`` and ``epsilon``). Every call draws one uniform and one random action per row whatever
    ``epsilon`` is, so the sampler's random stream does not depend on the schedule."""

    epsilon: Tensor

    def __init__(self, q: QNetwork, num_actions: int, epsilon: float = 1.0):
        super().__init__()
        self.q = q
        self.num_actions = num_actions
        self.register_buffer("epsilon", torch.tensor(float(epsilon), dtype=torch.float64))

    def act(self, obs: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        greedy = self.greedy(obs)
        explore = torch.rand(greedy.shape, generator=generator, dtype=torch.float64) < self.epsilon
        uniform = torch.randint(self.num_actions, greedy.shape, generator=generator)
        actions = torch.where(explore, uniform, greedy)
        return actions, epsilon_greedy_logprobs(actions, greedy, float(self.epsilon), self.num_actions)

    def greedy(self, obs: Tensor) -> Tensor:
        return self.q(obs).argmax(dim=-1)


def build_actor(
    space: SpaceInfo,
    hidden: Sequence[int],
    generator: torch.Generator,
    activation: Activation = "tanh",
    normalize_obs: bool = False,
) -> CategoricalActor | GaussianActor:
    """The actor for ``space``'s action kind."""
    if space.action_kind == "discrete":
        return CategoricalActor(space.obs_dim, space.action_dim, hidden, activation, normalize_obs, generator)
    return GaussianActor(space.obs_dim, space.action_dim, hidden, activation, normalize_obs, generator)


def build_critic(
    space: SpaceInfo,
    hidden: Sequence[int],
    generator: torch.Generator,
    activation: Activation = "tanh",
    normalize_obs: bool = False,
) -> Critic:
    return Critic(space.obs_dim, hidden, activation, normalize_obs, generator)


def build_q_network(
    space: SpaceInfo,
    hidden: Sequence[int],
    generator: torch.Generator,
    activation: Activation = "relu",
    normalize_obs: bool = False,
) -> QNetwork:
    if space.action_kind != "discrete":
        raise ValueError("a Q-network needs a Discrete action space")
    return QNetwork(space.obs_dim, space.action_dim, hidden, activation, normalize_obs, generator)
