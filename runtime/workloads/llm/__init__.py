"""The LLM workload: prompts in, a group of token sequences per prompt out, scored by the task.

``pipeline/`` schedules work and never looks inside a sample; it reaches this package through
:class:`LLMWorkload` (:mod:`runtime.workloads.base`). The parts:

* :mod:`~runtime.workloads.llm.data` — :class:`WorkItem` (one prompt issued, with its issue index and
  the oldest weight version allowed to generate it) and :class:`PromptSource` (the data cursor).
* :mod:`~runtime.workloads.llm.generation` — :class:`RolloutWorker` (a group per prompt, scored by the
  task's verifier or the reward service), :func:`make_samples`, :func:`reward_scores`, :func:`batch_seed`.
* :mod:`~runtime.workloads.llm.models` — :class:`Models`, :func:`build_models` (policy, tokenizer,
  reference, critic), :func:`build_engine` (the engine builder every path uses: builtin or vllm), :func:`build_task`.
* :mod:`~runtime.workloads.llm.instance` — :class:`RolloutInstance`, the async mode's rollout instance.
* :mod:`~runtime.workloads.llm.probe` — :class:`ConsistencyProbe`.
* :mod:`~runtime.workloads.llm.workload` — :class:`LLMWorkload`, the protocol over the above.
"""

from runtime.workloads.llm.data import PromptSource, WorkItem
from runtime.workloads.llm.generation import RolloutWorker, batch_seed, make_samples, reward_scores
from runtime.workloads.llm.instance import RolloutInstance
from runtime.workloads.llm.models import Models, build_engine, build_models, build_task
from runtime.workloads.llm.probe import ConsistencyProbe
from runtime.workloads.llm.workload import LLMWorkload

__all__ = [
    "ConsistencyProbe",
    "LLMWorkload",
    "Models",
    "PromptSource",
    "RolloutInstance",
    "RolloutWorker",
    "WorkItem",
    "batch_seed",
    "build_engine",
    "build_models",
    "build_task",
    "make_samples",
    "reward_scores",
]
