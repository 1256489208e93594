"""``GymWorkload``: Gymnasium environments behind the pipeline's :class:`~runtime.workloads.base.Workload` seam.

A work item asks for one segment (``env.segment_length`` steps of ``env.num_envs`` env copies); a step
trains on ``env.segments_per_step`` of them with the spec's learner (``agent.algorithm``: PPO or DQN,
:mod:`runtime.workloads.gym.learners`). The training envs live in the task; the data source's
checkpoint state carries their sampler's (seeds, episode cursors, replayed actions), so a resumed
sync run continues bit-identically. The colocated mode samples with the learner's own networks
(:class:`~runtime.workloads.gym.build.ColocatedEngine`: the same numbers as sync, without the copy). In
async mode the segments come from sampling workers (:mod:`runtime.workloads.gym.instance`) under the
pipeline's lag bound.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import torch

from runtime.checkpoint import CheckpointError, load_checkpoint
from runtime.contract import ENV_STEPS_PER_S, EVAL_RETURN_MEAN
from runtime.spec import RunSpec
from runtime.workloads.gym.build import ColocatedEngine, PolicyEngine, describe_env, learner_config, one_env
from runtime.workloads.gym.data import SegmentItem, SegmentSource
from runtime.workloads.gym.envs import SpaceInfo, make_vector_env
from runtime.workloads.gym.errors import LearnerError
from runtime.workloads.gym.evaluation import evaluate_policy
from runtime.workloads.gym.instance import GymRolloutInstance, NoProbe, RemoteGymRollout, SegmentCost, local_instance
from runtime.workloads.gym.learners import DQNConfig, DQNLearner, PPOConfig, PPOLearner
from runtime.workloads.gym.sampler import FixedPolicy, SegmentSampler
from runtime.workloads.gym.segments import Segment, pack_segments, unpack_segments

EVAL_SEED_OFFSET = 1_000_003  # evaluation episodes are seeded apart from the training envs'
NETWORKS = {PPOLearner: ("actor", "critic"), DQNLearner: ("q", "target")}  # what a fork starts from


def start_from_checkpoint(learner: PPOLearner | DQNLearner, path: Path) -> None:
    """Load the networks of a gym checkpoint (``agent.init_path``: a fork) into a new learner; a checkpoint that
    is not a gym run's of the same algorithm and sizes is bad input naming the field."""
    try:
        state = load_checkpoint(path, keys=["trainer"])["trainer"]
    except (CheckpointError, OSError) as exc:
        raise LearnerError(f"agent.init_path: {path} is not a readable checkpoint ({exc})") from None
    names = NETWORKS[type(learner)]
    missing = [n for n in names if not isinstance(state.get(n), dict)]
    if missing:
        raise LearnerError(
            f"agent.init_path: {path} holds no {' and '.join(missing)} network (a checkpoint of another workload "
            f"or algorithm; this run's learner is {type(learner).__name__})"
        )
    for name in names:
        try:
            getattr(learner, name).load_state_dict(state[name])
        except RuntimeError as exc:  # other layer sizes, or an observation of another shape
            raise LearnerError(f"agent.init_path: the checkpoint's {name} does not fit this run's ({exc})") from None


@dataclass
class GymTask:
    """The run's envs: the training sampler (its vector env) and the evaluation agent's env."""

    spec: RunSpec
    space: SpaceInfo
    sampler: SegmentSampler
    eval_env: gym.Env


@dataclass
class SegmentGenerator:
    """The sync mode's inline generator: each work item becomes the next segment of the task's sampler."""

    engine: PolicyEngine | ColocatedEngine
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
    evaluates_in_process = True  # its episodes are Python loops: a thread would take the learner's GIL

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
        if spec.agent.init_path:
            start_from_checkpoint(models.learner, Path(spec.agent.init_path))
        return models.learner

    def build_task(self, spec: RunSpec) -> GymTask:
        space = describe_env(spec)
        envs = make_vector_env(lambda: one_env(spec), spec.env.num_envs)
        sampler = SegmentSampler(envs, space, spec.env.segment_length, seed=spec.seed)
        return GymTask(spec, space, sampler, one_env(spec))

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
        return NoProbe()  # the sampler runs the learner's own module, in float32: nothing can drift

    # ---- generation ----
    def inline_generator(
        self, spec: RunSpec, models: GymModels, task: GymTask, device: torch.device, colocated: bool
    ) -> SegmentGenerator:
        if colocated:  # sampling on the learner's own networks: no copy, no weight load between steps
            assert models.learner is not None, "inline_generator before build_trainer"
            return SegmentGenerator(ColocatedEngine(models.learner, models.space), task.sampler)
        return SegmentGenerator(PolicyEngine(models.space, models.cfg, device), task.sampler)

    def rollout_instance(
        self, rank: int, spec: RunSpec, device: Any, weights: Any, conn: Any, flags: Any, state: bytes | None = None
    ) -> GymRolloutInstance:
        return local_instance(rank, spec, device, weights, conn, flags, state)

    def remote_rollout(self, rank: int, spec: RunSpec, device: Any) -> RemoteGymRollout:
        return RemoteGymRollout(rank, spec, device)

    def work_cost(self, spec: RunSpec) -> Any:
        return SegmentCost(spec)

    def pack_samples(self, samples: list[Segment]) -> dict[str, Any]:
        return pack_segments(samples)

    def unpack_samples(self, packed: dict[str, Any], version_offset: int = 0) -> list[Segment]:
        return unpack_segments(packed, version_offset)

    # ---- evaluation ----
    def eval_engine(self, spec: RunSpec, device: torch.device, models: GymModels | None = None) -> PolicyEngine:
        if models is None:
            models = self.build_models(spec, device)
        return PolicyEngine(models.space, models.cfg, device)

    def evaluate(self, spec: RunSpec, engine: PolicyEngine | ColocatedEngine, task: GymTask) -> dict[str, float]:
        """Greedy episodes of the engine's policy on the evaluation env (the same seeds every time), tagged with
        the weight version they evaluated."""
        return evaluate_policy(
            engine, task.eval_env, task.space, spec.env.eval_episodes, seed=spec.seed + EVAL_SEED_OFFSET
        )
