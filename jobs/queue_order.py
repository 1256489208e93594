"""The order of a resource group's queue, and each queued run's place in it, derived when read.

Admission (jobs.admission) walks the queue in this order. A run's 1-based position is its place among
the group's QUEUED runs in the same order; it is not stored, so a cancel or an admission at the head
of a long queue writes nothing for the runs behind it (their positions move by being read again).

Order: effective priority descending — the run's own priority capped at its quota's, else the quota's —
then submission time, then id.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from django.db.models import F, QuerySet
from django.db.models.functions import Coalesce, Least

from jobs.models import Run
from jobs.states import RunState


def with_effective_priority(runs: QuerySet[Run]) -> QuerySet[Run]:
    """``runs`` annotated with ``effective_priority`` (also what preemption compares)."""
    return runs.annotate(
        effective_priority=Least(Coalesce("priority", "experiment__quota__priority"), F("experiment__quota__priority"))
    )


def queued_in_order(group_id: int) -> QuerySet[Run]:
    """The group's QUEUED runs in queue order, annotated with ``effective_priority``."""
    return with_effective_priority(Run.objects.queued().filter(experiment__group_id=group_id)).order_by(
        F("effective_priority").desc(), "submitted_at", "pk"
    )


def positions(group_id: int) -> dict[int, int]:
    """Run id -> 1-based position of every QUEUED run of the group (one read of the queue's ids)."""
    ids = queued_in_order(group_id).values_list("pk", flat=True)
    return {run_id: place for place, run_id in enumerate(ids, start=1)}


def position_of(run_id: int, group_id: int) -> int | None:
    """The run's 1-based position in its group's queue; None when it is not QUEUED."""
    return positions(group_id).get(run_id)


def positions_of(runs: Iterable[tuple[int, str, int]]) -> dict[int, int]:
    """Positions of the QUEUED ones among ``runs`` given as (id, state, group id): one read per group."""
    by_group: dict[int, list[int]] = defaultdict(list)
    for run_id, state, group_id in runs:
        if state == RunState.QUEUED:
            by_group[group_id].append(run_id)
    found: dict[int, int] = {}
    for group_id, run_ids in by_group.items():
        places = positions(group_id)
        found.update({run_id: places[run_id] for run_id in run_ids if run_id in places})
    return found


def annotate_positions(runs: Iterable[Run]) -> list[Run]:
    """Set ``queue_position`` on each run instance (None unless QUEUED), as an annotation would; returns them.

    Reads ``run.experiment.group_id`` (select_related the experiment for a list)."""
    runs = list(runs)
    found = positions_of((run.pk, run.state, run.experiment.group_id) for run in runs)
    for run in runs:
        run.queue_position = found.get(run.pk)  # type: ignore[attr-defined]  # derived, like an annotation
    return runs
