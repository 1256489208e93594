"""PPO with a learned critic (Schulman et al. 2017, *Proximal Policy Optimization Algorithms*, arXiv:1707.06347).

Advantages come from GAE (Schulman et al. 2016, arXiv:1506.02438) over the
response tokens, with the outcome reward on the last token and the critic's
values, then whitened over the whole step (across data-parallel ranks). The
policy loss is the same clipped surrogate as GRPO's
(:func:`runtime.train.algos.grpo.policy_loss`); the critic is trained by the
trainer with :func:`runtime.train.algos.core.value_loss` (clipped, as in OpenAI
baselines) and its own optimizer.

Deviation from the usual RLHF recipe: the KL to the reference is a loss term
(as in GRPO), not a per-token reward penalty, so the critic learns the task
reward only.
"""

from __future__ import annotations

from runtime.train.algos.grpo import policy_loss
from runtime.train.algos.interface import Algorithm, adamw_update


def make_ppo() -> Algorithm:
    return Algorithm(name="ppo", loss_fn=policy_loss, update_fn=adamw_update, advantages="gae", needs_critic=True)
