"""``LLMWorkload``: the LLM workload behind the pipeline's :class:`~runtime.workloads.base.Workload` seam.

Each method delegates to the modules of this package (and to ``runtime.models``, ``runtime.train``,
``runtime.evaluation``, ``runtime.sample_queue``); it holds no state, so a spawned process builds
its own from the spec.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from runtime.contract import EVAL_ACCURACY, GEN_TOKENS_PER_S
from runtime.evaluation.evaluator import BoundEngine, evaluate
from runtime.models import save_hf
from runtime.sample_queue import pack_samples, unpack_samples
from runtime.samples import Sample
from runtime.spec import RunSpec
from runtime.train.trainer import Trainer
from runtime.weights.service import KEPT_ON
from runtime.workloads.llm.data import PromptSource, TokenCost
from runtime.workloads.llm.generation import RolloutWorker
from runtime.workloads.llm.instance import RemoteLLMRollout, RolloutInstance, build_instance
from runtime.workloads.llm.models import Models, build_engine, build_models, build_task
from runtime.workloads.llm.probe import ConsistencyProbe, PublishedPolicy


class LLMWorkload:
    """Prompts in, groups of token sequences out, scored by the task; the policy is a causal LM."""

    name = "llm"
    eval_metric = EVAL_ACCURACY  # what an evaluation event carries
    units_per_s_metric = GEN_TOKENS_PER_S  # what generate()'s units are
    evaluates_in_process = False  # a thread: a second process would need a second copy of the model

    # ---- the trainer's side ----
    def build_models(self, spec: RunSpec, device: torch.device) -> Models:
        return build_models(spec, device)

    def build_trainer(self, spec: RunSpec, models: Models, device: torch.device, group: Any = None) -> Trainer:
        return Trainer(spec, models.policy, models.tokenizer, device, models.ref_policy, models.critic, group)

    def build_task(self, spec: RunSpec) -> Any:
        return build_task(spec)

    def build_source(self, task: Any) -> PromptSource:
        return PromptSource(task.train_prompts())

    def export_policy(self, models: Models, directory: Path) -> None:
        save_hf(models.policy, models.tokenizer, directory)  # with LoRA: merged, and the adapter beside it

    def consistency_probe(self, spec: RunSpec, device: torch.device, max_samples: int) -> ConsistencyProbe:
        return ConsistencyProbe(spec, device, max_samples=max_samples)

    # ---- generation ----
    def inline_generator(
        self, spec: RunSpec, models: Models, task: Any, device: torch.device, colocated: bool
    ) -> RolloutWorker:
        # zero copy when the engine shares the trainer's module; otherwise the builder gives the engine its
        # own weights (a torch copy for the built-in engine, vLLM's own) and each sync sends the full state
        shared = models.policy if spec.engine_shares_policy else None
        engine = build_engine(shared, models.tokenizer, device, spec, colocated=colocated)
        return RolloutWorker(spec, engine, models.tokenizer, task, device)

    def rollout_instance(
        self,
        rank: int,
        spec: RunSpec,
        device: torch.device,
        weights: Any,
        conn: Any,
        flags: Any,
        state: bytes | None = None,
    ) -> RolloutInstance:
        return build_instance(rank, spec, device, weights, conn, flags)  # it reports no state: nothing to resume

    def remote_rollout(self, rank: int, spec: RunSpec, device: torch.device) -> RemoteLLMRollout:
        return RemoteLLMRollout(rank, spec, device)

    def work_cost(self, spec: RunSpec) -> TokenCost:
        return TokenCost(spec)

    def pack_samples(self, samples: list[Sample]) -> dict[str, Any]:
        return pack_samples(samples)

    def unpack_samples(self, packed: dict[str, Any], version_offset: int = 0) -> list[Sample]:
        samples = unpack_samples(packed)
        if version_offset:
            for s in samples:
                s.versions = [v + version_offset for v in s.versions]
        return samples

    # ---- evaluation ----
    def eval_engine(self, spec: RunSpec, device: torch.device, models: Models | None = None) -> Any:
        tokenizer = None if models is None else models.tokenizer  # the trainer's process: its tokenizer
        if models is not None and spec.rollout.engine == "builtin" and torch.device(device) == KEPT_ON:
            # beside the weight service's kept versions: read the version handed in place, no policy copy
            policy = PublishedPolicy(spec.model, device, seed=spec.seed)
            return BoundEngine(build_engine(policy.model, tokenizer, device, spec), policy.bind)
        return build_engine(None, tokenizer, device, spec)  # a device of its own: the engine's weights are its own

    def evaluate(self, spec: RunSpec, engine: Any, task: Any) -> dict[str, float]:
        r = spec.rollout
        return evaluate(engine, engine.tokenizer, task, task.eval_prompts(), r.max_new_tokens, r.max_batch_size)
