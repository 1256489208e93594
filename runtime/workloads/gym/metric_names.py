"""The metric names the gym learners report, with their meanings, in one place.

Every name is :mod:`runtime.contract`'s (the platform charts them by these names); this module
groups the gym learners' own (``GYM_METRICS``) and the ones they share with the LLM trainer.
"""

from __future__ import annotations

from runtime.contract import (
    APPROX_KL,
    CLIP_FRACTION,
    ENTROPY,
    ENV_STEPS,
    EPISODE_LENGTH_MEAN,
    EPISODE_RETURN_MAX,
    EPISODE_RETURN_MEAN,
    EPISODE_RETURN_MIN,
    EPISODES,
    EPSILON,
    GRAD_NORM,
    LOSS_POLICY,
    LOSS_TD,
    LOSS_VALUE,
    LR,
    METRICS,
    Q_MEAN,
    REPLAY_SIZE,
    STALENESS_MAX,
    STALENESS_MEAN,
    TARGET_SYNC_EVENTS,
    TARGET_SYNC_WAIT,
    TARGET_SYNCS,
    TD_ERROR,
)

GYM_METRICS: dict[str, str] = {
    name: METRICS[name]
    for name in (
        EPISODE_RETURN_MEAN,
        EPISODE_RETURN_MIN,
        EPISODE_RETURN_MAX,
        EPISODE_LENGTH_MEAN,
        EPISODES,
        ENV_STEPS,
        APPROX_KL,
        LOSS_TD,
        TD_ERROR,
        Q_MEAN,
        EPSILON,
        TARGET_SYNCS,
        TARGET_SYNC_EVENTS,
        TARGET_SYNC_WAIT,
        REPLAY_SIZE,
    )
}

# Reported by the gym learners with the meaning contract.METRICS gives them (for control:
# per transition instead of per token; LOSS_VALUE is the critic's loss).
SHARED_METRICS = (LOSS_POLICY, LOSS_VALUE, ENTROPY, CLIP_FRACTION, GRAD_NORM, LR, STALENESS_MEAN, STALENESS_MAX)
