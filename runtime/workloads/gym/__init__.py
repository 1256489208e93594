"""The gym workload's parts: Gymnasium environments, trajectory segments, and the PPO / DQN learners.

* :mod:`~runtime.workloads.gym.envs` — :func:`make_env` from ``env.id`` or ``env.entry_point`` (+ ``env.kwargs``),
  :class:`SpaceInfo`, :func:`check_algorithm`, :func:`make_vector_env`, seeds per worker and episode;
  :class:`EnvSpecError` names the field at fault.
* :mod:`~runtime.workloads.gym.obs_norm` — :class:`ObservationNormalizer`, running statistics inside a network.
* :mod:`~runtime.workloads.gym.networks` — actor (categorical / diagonal Gaussian), critic, Q-network,
  :class:`EpsilonGreedyPolicy`; the :class:`Policy` protocol samplers call.
* :mod:`~runtime.workloads.gym.segments` — :class:`Segment` (the workload's sample), pack / unpack.
* :mod:`~runtime.workloads.gym.sampler` — :class:`SegmentSampler` (a vector env -> segments, its checkpoint state).
* :mod:`~runtime.workloads.gym.replay` — :class:`ReplayBuffer` (DQN).
* :mod:`~runtime.workloads.gym.learners` — :class:`PPOLearner`, :class:`DQNLearner` (the trainers),
  :func:`sampling_policy` (the module a sampler loads published weights into).
* :mod:`~runtime.workloads.gym.evaluation` — :func:`greedy_returns` (the evaluation agent's episodes).
* :mod:`~runtime.workloads.gym.metric_names` — the metrics the learners report.

The math is in :mod:`runtime.train.algos.control`. Not yet wired: the ``Workload`` class, the spec
section, the data source and the async sampling worker.
"""

from runtime.workloads.gym.envs import (
    ACTION_KINDS,
    EnvSpecError,
    SpaceInfo,
    check_algorithm,
    describe_spaces,
    env_field,
    episode_seed,
    make_env,
    make_vector_env,
    worker_seeds,
)
from runtime.workloads.gym.evaluation import greedy_returns
from runtime.workloads.gym.learners import DQNConfig, DQNLearner, LearnerError, PPOConfig, PPOLearner, sampling_policy
from runtime.workloads.gym.replay import ReplayBuffer, Transitions
from runtime.workloads.gym.sampler import FixedPolicy, PolicySource, SamplerError, SegmentSampler
from runtime.workloads.gym.segments import Segment, pack_segments, unpack_segments

__all__ = [
    "ACTION_KINDS",
    "DQNConfig",
    "DQNLearner",
    "EnvSpecError",
    "FixedPolicy",
    "LearnerError",
    "PPOConfig",
    "PPOLearner",
    "PolicySource",
    "ReplayBuffer",
    "SamplerError",
    "Segment",
    "SegmentSampler",
    "SpaceInfo",
    "Transitions",
    "check_algorithm",
    "describe_spaces",
    "env_field",
    "episode_seed",
    "greedy_returns",
    "make_env",
    "make_vector_env",
    "pack_segments",
    "sampling_policy",
    "unpack_segments",
    "worker_seeds",
]
