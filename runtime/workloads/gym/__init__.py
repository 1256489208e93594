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
* :mod:`~runtime.workloads.gym.errors` — the input errors (no gymnasium import: the CLI classes them early).
* :mod:`~runtime.workloads.gym.build`, :mod:`~runtime.workloads.gym.data`, :mod:`~runtime.workloads.gym.instance`,
  :mod:`~runtime.workloads.gym.workload` — the spec's learner and env, work items and the cursor, the async
  sampling worker, and :class:`GymWorkload` (the ``Workload`` protocol).

The math is in :mod:`runtime.train.algos.control`. Import from the submodules: this package imports
nothing, so importing one light submodule does not import gymnasium or torch.
"""
