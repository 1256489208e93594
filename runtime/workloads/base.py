"""The ``Workload`` seam: what the pipeline asks of a workload, and :func:`workload_for`.

A workload says what a step's samples are and how they are made, scored, packed, trained on and
evaluated; the pipeline (``runtime/pipeline/``) schedules that work, moves samples through the
:class:`~runtime.sample_queue.SampleQueue` (any item with ``sample_id`` and ``version``), checkpoints
and applies directives, without looking inside a sample. Only what the pipeline calls is here.

The objects a workload returns are opaque to the pipeline except where a docstring below says what
it uses of them. Samples carry ``sample_id``, ``version`` (the oldest weight version behind it) and
``group_id`` (the issue index of the work item that made it). Work items carry ``index`` (unique
over the run), ``min_version`` (generation waits for weights at least this new), ``pinned`` and
``pack()`` (a plain dict for queues and checkpoints).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from runtime.spec import RunSpec
from runtime.workloads.llm import LLMWorkload


@runtime_checkable
class DataSource(Protocol):
    """The data cursor: issues work items in order; its state goes into every checkpoint."""

    reissue: Any  # work given back, served before fresh work, in issue order (items with index, min_version)

    def next(self, n: int, min_version: int = 0) -> list[Any]:
        """The next ``n`` work items, re-issued ones first, each to be made with weights >= ``min_version``."""
        ...

    def give_back(self, items: list[Any], min_version: int = 0) -> None:
        """Issue ``items`` again before any fresh work (a dead instance's, the work in flight at a checkpoint)."""
        ...

    def regenerate(self, stale: list[Any], min_version: int) -> None:
        """Issue again the work that made the ``stale`` samples, at the same issue indices (so the new
        samples reuse their ids), with weights >= ``min_version``."""
        ...

    def unpack_item(self, packed: dict[str, Any]) -> Any:
        """A work item from its ``pack()`` (the work in flight in a checkpoint)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The cursor and the re-issue list, plain data for a checkpoint."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class WorkCost(Protocol):
    """How much generation a work item asks for, in the units rollout instances measure their throughput in
    (the async dispatch sends each item to the instance that would finish it soonest)."""

    def predict(self, item: Any) -> float: ...

    def observe(self, samples: list[Any]) -> None:
        """Learn from finished samples (the llm's: their response lengths)."""
        ...


@runtime_checkable
class Workload(Protocol):
    """What the pipeline builds and calls for a run; stateless, so every process builds its own."""

    name: str
    eval_metric: str  # the metric an evaluation event carries (runtime.contract), e.g. eval/accuracy
    units_per_s_metric: str  # the throughput metric of what generate() counts (tokens, env steps)
    # async mode: evaluate in a process of its own (runtime.evaluation.process) rather than a thread of the
    # trainer's, which shares its interpreter lock; for an evaluator that is cheap to build twice
    evaluates_in_process: bool

    # ---- the trainer's side ----
    def build_models(self, spec: RunSpec, device: Any) -> Any:
        """The trainer's models on ``device``. The pipeline passes them back to the methods below and
        publishes nothing of them itself (the trainer's ``publish_state`` does)."""
        ...

    def build_trainer(self, spec: RunSpec, models: Any, device: Any, group: Any = None) -> Any:
        """The trainer over ``models`` (one rank of a data-parallel ``group`` when given): ``train_step(samples,
        step) -> metrics``, ``publish_state()``, ``version``, ``state_dict``/``load_state_dict``, ``set_lr``;
        the colocated mode also calls ``offload_optimizer``/``reload_optimizer``."""
        ...

    def build_task(self, spec: RunSpec) -> Any:
        """What the run learns from (training work, held-out evaluation); opaque to the pipeline, which
        passes it to :meth:`build_source`, :meth:`inline_generator` and :meth:`evaluate`."""
        ...

    def build_source(self, task: Any) -> DataSource:
        """The data cursor over ``task``'s training work."""
        ...

    def export_policy(self, models: Any, directory: Path) -> None:
        """Write the policy where a checkpoint keeps it for use outside the runtime (the LLM's: HF format)."""
        ...

    def consistency_probe(self, spec: RunSpec, device: Any, max_samples: int) -> Any:
        """Async mode: ``measure(samples, weight_service) -> metrics`` compares the generator's and the trainer's
        numbers on samples older than the trainer's weights (may return {})."""
        ...

    # ---- generation ----
    def inline_generator(self, spec: RunSpec, models: Any, task: Any, device: Any, colocated: bool) -> Any:
        """sync / colocated: the generator in the trainer's process. ``generate(items) -> (samples, units
        generated)`` (samples sorted by id); ``engine.update_weights(state, version)`` takes published weights
        (``state`` None when ``colocated``: it runs on the trainer's own parameters) and is what
        :meth:`evaluate` evaluates; ``dropped`` lists the indices of items that yielded no samples and
        ``reward`` is a remote reward client (``metrics()``) or None."""
        ...

    def rollout_instance(
        self, rank: int, spec: RunSpec, device: Any, weights: Any, conn: Any, flags: Any, state: bytes | None = None
    ) -> Any:
        """Async mode, inside a spawned rollout process (:mod:`runtime.rollout.instance`): the instance that
        ``run(work_q, ended)`` takes work items and sends samples on ``conn`` per that module's protocol,
        taking weights from the subscriber ``weights``; then ``close()``. ``state`` is what an instance of
        this rank last reported with accepted samples (``info["state"]``, see that module), to continue from;
        None for a fresh start."""
        ...

    def remote_rollout(self, rank: int, spec: RunSpec, device: Any) -> Any:
        """Async mode, a remote rollout instance's process (:mod:`runtime.rollout.remote`): what it builds once
        and keeps across sessions with (restarted) trainers. ``session(weights, conn, flags, state)`` returns
        the instance loop for one connection (as :meth:`rollout_instance`'s; its ``close()`` ends the session
        only); ``close()`` at exit."""
        ...

    def work_cost(self, spec: RunSpec) -> WorkCost:
        """Async mode: the trainer's estimate of each work item's generation work."""
        ...

    def pack_samples(self, samples: list[Any]) -> dict[str, Any]:
        """Samples as plain tensors and lists (``torch.load(weights_only=True)`` reads them): what a rollout
        instance sends and what a checkpoint keeps of the queue. Raises
        :class:`~runtime.sample_queue.PackError` on samples it cannot pack."""
        ...

    def unpack_samples(self, packed: dict[str, Any], version_offset: int = 0) -> list[Any]:
        """Inverse of :meth:`pack_samples`; ``version_offset`` is added to every weight version the samples
        record (a rollback renumbers the restored timeline's versions)."""
        ...

    # ---- evaluation ----
    def eval_engine(self, spec: RunSpec, device: Any, models: Any = None) -> Any:
        """A policy to evaluate on ``device`` (``update_weights(state, version)`` loads the weights), for an
        evaluator in a thread of the trainer (``models``: the trainer's, to share what can be) or a process
        of its own."""
        ...

    def evaluate(self, spec: RunSpec, engine: Any, task: Any) -> dict[str, float]:
        """Metrics of ``engine``'s current weights on ``task``'s held-out work, ``eval/accuracy`` among them."""
        ...


def workload_for(spec: RunSpec) -> Workload:
    """The workload that runs ``spec``, named by its ``workload`` field (gymnasium is imported only for a gym run)."""
    if spec.workload == "gym":
        from runtime.workloads.gym.workload import GymWorkload

        return GymWorkload()
    return LLMWorkload()
