"""RL algorithms: pure math (:mod:`.core`), GRPO, PPO, and the registry / plug-in point."""

from runtime.train.algos.core import (
    aggregate_loss,
    clipped_surrogate,
    gae,
    grpo_advantages,
    importance_weights,
    kl_k3,
    value_loss,
)
from runtime.train.algos.interface import Algorithm, AlgorithmError, PolicyBatch, UpdateContext, adamw_update
from runtime.train.algos.registry import get_algorithm, register_algorithm, registered_algorithms

__all__ = [
    "Algorithm",
    "AlgorithmError",
    "PolicyBatch",
    "UpdateContext",
    "adamw_update",
    "aggregate_loss",
    "clipped_surrogate",
    "gae",
    "get_algorithm",
    "grpo_advantages",
    "importance_weights",
    "kl_k3",
    "register_algorithm",
    "registered_algorithms",
    "value_loss",
]
