"""What every process of a gym run builds from its spec: the learner's configuration, the env (its spaces
checked against the learner), and the policy a sampler or the evaluation agent runs (``PolicyEngine``, a copy
that takes published weights; ``ColocatedEngine``, the learner's own networks)."""

from __future__ import annotations

from dataclasses import fields

import gymnasium as gym
import torch

from runtime.spec import RunSpec
from runtime.workloads.gym.envs import SpaceInfo, check_algorithm, describe_spaces, env_field, make_env
from runtime.workloads.gym.learners import DQNConfig, DQNLearner, PPOConfig, PPOLearner, sampling_policy
from runtime.workloads.gym.networks import EpsilonGreedyPolicy, Policy


def learner_config(spec: RunSpec) -> PPOConfig | DQNConfig:
    """The learner's configuration from the spec's ``agent`` section: every configuration field the section
    has, by name; the others keep their defaults (``adam_eps``, ``normalize_advantages``, ``huber_delta``).
    The section's validator filled the algorithm's defaults of ``activation`` and ``max_grad_norm``."""
    a = spec.agent
    cls: type[PPOConfig] | type[DQNConfig] = PPOConfig if a.algorithm == "ppo" else DQNConfig
    values = {f.name: getattr(a, f.name) for f in fields(cls) if f.name in type(a).model_fields}
    values["hidden"] = tuple(a.hidden)
    return cls(**values)


def one_env(spec: RunSpec) -> gym.Env:
    return make_env(spec.env.id, spec.env.entry_point, spec.env.kwargs)


def describe_env(spec: RunSpec) -> SpaceInfo:
    """The env's spaces, checked against the learner (raises EnvSpecError naming the field): the preflight."""
    env = one_env(spec)
    try:
        space = describe_spaces(env, env_field(spec.env.id))
    finally:
        env.close()
    check_algorithm(space, spec.agent.algorithm, env_field(spec.env.id))
    return space


class PolicyEngine:
    """A sampling (or evaluation) policy that takes published weights: ``update_weights(state, version)``."""

    def __init__(self, space: SpaceInfo, cfg: PPOConfig | DQNConfig, device: torch.device):
        self.policy = sampling_policy(space, cfg).to(device)
        self.policy.eval()
        self.version = 0

    def update_weights(self, state: dict[str, torch.Tensor] | None, version: int) -> None:
        if state is not None:
            self.policy.load_state_dict(state)
        self.version = version


class ColocatedEngine:
    """The colocated mode's policy: the learner's own networks, no copy. PPO samples with the actor itself;
    DQN with an ε-greedy policy over the online Q-network, whose ε is the learner's as of the last
    ``update_weights`` (a publication: what a copy would have received)."""

    def __init__(self, learner: PPOLearner | DQNLearner, space: SpaceInfo):
        self.learner = learner
        self.policy: Policy
        if isinstance(learner, PPOLearner):
            self.policy = learner.actor
        else:
            self.policy = EpsilonGreedyPolicy(learner.q, space.action_dim, learner.epsilon)
        self.version = 0

    def update_weights(self, state: dict[str, torch.Tensor] | None, version: int) -> None:
        if state is not None:
            raise ValueError("a colocated engine runs on the learner's own networks: it takes no weights")
        if isinstance(self.policy, EpsilonGreedyPolicy):
            assert isinstance(self.learner, DQNLearner)
            self.policy.epsilon.fill_(self.learner.epsilon)
        self.version = version
