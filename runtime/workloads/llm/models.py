"""The LLM workload's models: the trainer's policy, tokenizer, reference and critic; the engine; the task."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from runtime.spec import RunSpec


@dataclass
class Models:
    policy: Any
    tokenizer: Any
    ref_policy: Any = None
    critic: Any = None


def build_models(spec: RunSpec, device: torch.device) -> Models:
    """The trainer's models: policy + tokenizer, a frozen reference when the KL penalty needs it, a critic for PPO."""
    from runtime.models import ValueModel, build_policy
    from runtime.train.algos import get_algorithm

    policy, tokenizer = build_policy(spec.model, device, seed=spec.seed)
    ref = None
    if spec.model.reference and spec.algorithm.kl_coef > 0:
        ref = copy.deepcopy(policy).eval().requires_grad_(False)
    critic = None
    if get_algorithm(spec.algorithm.name).needs_critic:
        critic = ValueModel.from_policy(policy).to(device)
    return Models(policy=policy, tokenizer=tokenizer, ref_policy=ref, critic=critic)


def build_engine(model: Any, tokenizer: Any, device: torch.device, spec: RunSpec) -> Any:
    from runtime.rollout.engine import Engine

    r = spec.rollout
    return Engine(model, tokenizer, device, max_batch_size=r.max_batch_size, max_batch_tokens=r.max_batch_tokens)


def build_task(spec: RunSpec) -> Any:
    from runtime.tasks import build_task as _build

    return _build(spec.task, spec.model.path)  # the model directory: its tokenizer's chat template
