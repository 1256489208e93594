"""``GymWorkload``: Gymnasium environments behind the pipeline's :class:`~runtime.workloads.base.Workload` seam.

A work item asks for one segment (``env.segment_length`` steps of ``env.num_envs`` env copies); a step
trains on ``env.segments_per_step`` of them with the spec's learner (``agent.algorithm``: PPO or DQN,
:mod:`runtime.workloads.gym.learners`). The training envs live in the task; the data source's
checkpoint state carries their sampler's (seeds, episode cursors, replayed actions), so a resumed
sync run continues bit-identically. Runs in sync mode; the async sampling workers and the colocated
mode are not wired yet (``runtime.spec`` refuses those modes for this workload).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import torch

from runtime.contract import ENV_STEPS_PER_S, EVAL_RETURN_MAX, EVAL_RETURN_MEAN, EVAL_RETURN_MIN
from runtime.evaluation.evaluator import TIME_EVAL
from runtime.spec import RunSpec
from runtime.workloads.gym.envs import (
    SpaceInfo,
    check_algorithm,
    describe_spaces,
    env_field,
    make_env,
    make_vector_env,
)
from runtime.workloads.gym.evaluation import greedy_returns
from runtime.workloads.gym.learners import DQNConfig, DQNLearner, PPOConfig, PPOLearner, sampling_policy
from runtime.workloads.gym.sampler import FixedPolicy, SegmentSampler
from runtime.workloads.gym.segments import Segment, pack_segments, unpack_segments

EVAL_SEED_OFFSET = 1_000_003  # evaluation episodes are seeded apart from the training envs'


def learner_config(spec: RunSpec) -> PPOConfig | DQNConfig:
    """The learner's configuration from the spec's ``agent`` section (its validator filled the algorithm's
    defaults of ``activation`` and ``max_grad_norm``)."""
    a = spec.agent
    assert a.activation is not None and a.max_grad_norm is not None
    if a.algorithm == "ppo":
        return PPOConfig(
            hidden=tuple(a.hidden),
            activation=a.activation,
            normalize_obs=a.normalize_obs,
            gamma=a.gamma,
            max_grad_norm=a.max_grad_norm,
            lam=a.lam,
            clip=a.clip,
            value_clip=a.value_clip,
            entropy_coef=a.entropy_coef,
            epochs=a.epochs,
            minibatches=a.minibatches,
            actor_lr=a.actor_lr,
            critic_lr=a.critic_lr,
        )
    return DQNConfig(
        hidden=tuple(a.hidden),
        activation=a.activation,
        normalize_obs=a.normalize_obs,
        gamma=a.gamma,
        max_grad_norm=a.max_grad_norm,
        lr=a.lr,
        buffer_size=a.buffer_size,
        batch_size=a.batch_size,
        learning_starts=a.learning_starts,
        updates_per_step=a.updates_per_step,
        target_update_interval=a.target_update_interval,
        tau=a.tau,
        epsilon_start=a.epsilon_start,
        epsilon_end=a.epsilon_end,
        epsilon_decay_steps=a.epsilon_decay_steps,
    )


def _one_env(spec: RunSpec) -> gym.Env:
    return make_env(spec.env.id, spec.env.entry_point, spec.env.kwargs)


def describe_env(spec: RunSpec) -> SpaceInfo:
    """The env's spaces, checked against the learner (raises EnvSpecError naming the field): the preflight."""
    env = _one_env(spec)
    try:
        space = describe_spaces(env, env_field(spec.env.id))
    finally:
        env.close()
    check_algorithm(space, spec.agent.algorithm, env_field(spec.env.id))
    return space


@dataclass
class GymTask:
    """The run's envs: the training sampler (its vector env) and the evaluation agent's env."""

    spec: RunSpec
    space: SpaceInfo
    sampler: SegmentSampler
    eval_env: gym.Env


@dataclass
class SegmentItem:
    """A work item: one segment to sample, made with weights of at least ``min_version``."""

    index: int
    min_version: int = 0
    pinned: bool = False

    def pack(self) -> dict[str, Any]:
        return {"index": self.index, "min_version": self.min_version, "pinned": self.pinned}


class SegmentSource:
    """The data cursor: segment indices in order, re-issued ones first; its state carries the sampler's."""

    def __init__(self, sampler: SegmentSampler):
        self.sampler = sampler
        self.cursor = 0
        self.reissue: list[SegmentItem] = []

    def next(self, n: int, min_version: int = 0) -> list[SegmentItem]:
        items, self.reissue = self.reissue[:n], self.reissue[n:]
        for item in items:
            item.min_version = max(item.min_version, min_version)
        while len(items) < n:
            items.append(SegmentItem(self.cursor, min_version))
            self.cursor += 1
        return items

    def give_back(self, items: list[SegmentItem], min_version: int = 0) -> None:
        back = [SegmentItem(i.index, max(i.min_version, min_version), i.pinned) for i in items]
        self.reissue = sorted([*back, *self.reissue], key=lambda i: i.index)

    def regenerate(self, stale: list[Any], min_version: int) -> None:
        self.give_back([SegmentItem(s.group_id) for s in stale], min_version)

    def unpack_item(self, packed: dict[str, Any]) -> SegmentItem:
        return SegmentItem(int(packed["index"]), int(packed["min_version"]), bool(packed.get("pinned", False)))

    def state_dict(self) -> dict[str, Any]:
        return {
            "cursor": self.cursor,
            "reissue": [i.pack() for i in self.reissue],
            "sampler": self.sampler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = int(state["cursor"])
        self.reissue = [self.unpack_item(p) for p in state["reissue"]]
        self.sampler.load_state_dict(state["sampler"])


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


@dataclass
class SegmentGenerator:
    """The sync mode's inline generator: each work item becomes the next segment of the task's sampler."""

    engine: PolicyEngine
    sampler: SegmentSampler
    dropped: list[int] = field(default_factory=list)  # nothing is dropped: there is no reward service
    reward: Any = None

    def generate(self, items: list[SegmentItem]) -> tuple[list[Segment], int]:
        source = FixedPolicy(self.engine.policy, self.engine.version)
        segments = [self.sampler.sample(source, sample_id=item.index, group_id=item.index) for item in items]
        return segments, len(segments) * self.sampler.steps_per_segment


@dataclass
class GymModels:
    """What the trainer is built over: the spaces and the learner's configuration (the learner owns its networks)."""

    space: SpaceInfo
    cfg: PPOConfig | DQNConfig
    learner: PPOLearner | DQNLearner | None = None


class GymWorkload:
    """Env steps in, segments out; the policy is a small MLP trained by PPO or DQN."""

    name = "gym"
    eval_metric = EVAL_RETURN_MEAN  # what an evaluation event carries
    units_per_s_metric = ENV_STEPS_PER_S  # what generate()'s units are

    # ---- the trainer's side ----
    def build_models(self, spec: RunSpec, device: torch.device) -> GymModels:
        return GymModels(describe_env(spec), learner_config(spec))

    def build_trainer(
        self, spec: RunSpec, models: GymModels, device: torch.device, group: Any = None
    ) -> PPOLearner | DQNLearner:
        if group is not None:  # runtime.spec refuses trainer_devices > 1 for this workload
            raise ValueError("resources.trainer_devices: workload gym trains on one device")
        cls = PPOLearner if isinstance(models.cfg, PPOConfig) else DQNLearner
        models.learner = cls(models.space, models.cfg, seed=spec.seed, device=device)  # type: ignore[arg-type]
        return models.learner

    def build_task(self, spec: RunSpec) -> GymTask:
        space = describe_env(spec)
        envs = make_vector_env(lambda: _one_env(spec), spec.env.num_envs)
        sampler = SegmentSampler(envs, space, spec.env.segment_length, seed=spec.seed)
        return GymTask(spec, space, sampler, _one_env(spec))

    def build_source(self, task: GymTask) -> SegmentSource:
        return SegmentSource(task.sampler)

    def export_policy(self, models: GymModels, directory: Path) -> None:
        """The sampling policy's weights (``policy.pt``) and what rebuilds its module (``policy.json``)."""
        assert models.learner is not None, "export_policy before build_trainer"
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(models.learner.publish_state(), directory / "policy.pt")
        about = {"space": models.space.__dict__, "config": {**models.cfg.__dict__, "kind": type(models.cfg).__name__}}
        (directory / "policy.json").write_text(json.dumps(about, indent=1, default=list) + "\n")

    def consistency_probe(self, spec: RunSpec, device: torch.device, max_samples: int) -> Any:
        raise NotImplementedError("workload gym has no async mode yet (runtime.spec refuses it)")

    # ---- generation ----
    def inline_generator(
        self, spec: RunSpec, models: GymModels, task: GymTask, device: torch.device, colocated: bool
    ) -> SegmentGenerator:
        return SegmentGenerator(PolicyEngine(models.space, models.cfg, device), task.sampler)

    def rollout_instance(self, rank: int, spec: RunSpec, device: Any, weights: Any, conn: Any, flags: Any) -> Any:
        raise NotImplementedError("workload gym has no async sampling workers yet (runtime.spec refuses async)")

    def pack_samples(self, samples: list[Segment]) -> dict[str, Any]:
        return pack_segments(samples)

    def unpack_samples(self, packed: dict[str, Any], version_offset: int = 0) -> list[Segment]:
        return unpack_segments(packed, version_offset)

    # ---- evaluation ----
    def eval_engine(self, spec: RunSpec, device: torch.device, models: GymModels | None = None) -> PolicyEngine:
        if models is None:
            models = self.build_models(spec, device)
        return PolicyEngine(models.space, models.cfg, device)

    def evaluate(self, spec: RunSpec, engine: PolicyEngine, task: GymTask) -> dict[str, float]:
        """Greedy episodes of the engine's policy on the evaluation env (the same seeds every time)."""
        import time

        started = time.perf_counter()
        returns = greedy_returns(
            engine.policy, task.eval_env, task.space, spec.env.eval_episodes, seed=spec.seed + EVAL_SEED_OFFSET
        )
        return {
            EVAL_RETURN_MEAN: statistics.fmean(returns),
            EVAL_RETURN_MIN: min(returns),
            EVAL_RETURN_MAX: max(returns),
            TIME_EVAL: time.perf_counter() - started,
        }
