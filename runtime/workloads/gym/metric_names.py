"""The metric names the gym learners report, with their meanings, in one place.

Names the LLM trainer already reports mean the same here and come from :mod:`runtime.contract`;
the new ones below are meant to join ``contract.METRICS`` (then this module re-exports them).
"""

from __future__ import annotations

from runtime.contract import (
    CLIP_FRACTION,
    ENTROPY,
    GRAD_NORM,
    LOSS_POLICY,
    LOSS_VALUE,
    LR,
    STALENESS_MAX,
    STALENESS_MEAN,
)

EPISODE_RETURN_MEAN = "episode/return_mean"
EPISODE_RETURN_MIN = "episode/return_min"
EPISODE_RETURN_MAX = "episode/return_max"
EPISODE_LENGTH_MEAN = "episode/length_mean"
EPISODES = "episode/count"
ENV_STEPS = "env/steps"
APPROX_KL = "approx_kl"
LOSS_TD = "loss/td"
TD_ERROR = "td_error"
Q_MEAN = "q/mean"
EPSILON = "epsilon"
TARGET_SYNCS = "target/syncs"
REPLAY_SIZE = "replay/size"

GYM_METRICS: dict[str, str] = {
    EPISODE_RETURN_MEAN: "Mean undiscounted return of the episodes that ended in this step's segments.",
    EPISODE_RETURN_MIN: "Lowest such return.",
    EPISODE_RETURN_MAX: "Highest such return.",
    EPISODE_LENGTH_MEAN: "Mean length (env steps) of those episodes.",
    EPISODES: "Episodes that ended in this step's segments (the return metrics are absent when 0).",
    ENV_STEPS: "Environment steps the learner has trained on since the start of the run, cumulative.",
    APPROX_KL: "PPO: mean k3 estimate of KL(behaviour || updated policy) over the step's minibatches.",
    LOSS_TD: "DQN: Huber loss of the TD errors, mean over the step's updates.",
    TD_ERROR: "DQN: mean |Q(s, a) - target| over the step's updates.",
    Q_MEAN: "DQN: mean Q-value of the actions taken in the sampled transitions.",
    EPSILON: "DQN: exploration rate the samplers get with this step's weights.",
    TARGET_SYNCS: "DQN: target-network syncs (hard copies or Polyak updates) since the start, cumulative.",
    REPLAY_SIZE: "DQN: transitions held in the replay buffer.",
}

# Reported by the gym learners with the meaning contract.METRICS gives them (for control:
# per transition instead of per token; LOSS_VALUE is the critic's loss).
SHARED_METRICS = (LOSS_POLICY, LOSS_VALUE, ENTROPY, CLIP_FRACTION, GRAD_NORM, LR, STALENESS_MEAN, STALENESS_MAX)
