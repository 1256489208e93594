"""When a queued run may start: the runs ahead of it and those holding devices, played forward in time.

The runs holding the group's devices end after their remaining steps at their predicted step time
(jobs.planning.step_time: the capacity model on the group's calibration); then the queue is walked in
admission's order (jobs.queue_order), each run starting once enough devices are free and holding them
for its whole predicted run. The run's estimated start is when its turn comes.

An estimate: it counts devices only (quota limits, placement on hosts, start-up time and preemption
are left out) and it is as good as the calibration. It is computed on read, in a bounded number of
queries (the queue's ids, the specs ahead, the runs holding devices, their progress, the group's
devices), and with at most :data:`MAX_PREDICTED` runs to predict (each prediction is cached by its
inputs in jobs.planning).
"""

from __future__ import annotations

import datetime
import heapq
from dataclasses import dataclass, field
from typing import Any

from django.db.models import Max

from jobs import planning, queue_order
from jobs.models import MetricPoint, Run
from jobs.states import RunState
from rlplatform.models import Device, HostStatus

MAX_PREDICTED = 20
"""Runs ahead plus runs holding devices the estimate predicts at most; beyond, it gives no estimate."""


@dataclass
class Estimate:
    start: datetime.datetime | None
    reason: str = ""
    """Why there is no estimate (start None), or what the estimate rests on."""
    runs_ahead: int = 0
    holding: int = 0
    calibrations: list[dict[str, str]] = field(default_factory=list)

    @property
    def note(self) -> str:
        return f"{planning.ESTIMATE_NOTE} Devices only: quota limits, placement on hosts and start-up time are not counted."

    @property
    def calibration_names(self) -> str:
        return ", ".join(c["name"] for c in self.calibrations)

    def as_dict(self) -> dict[str, Any]:
        return {
            "estimated_start": self.start.isoformat() if self.start is not None else None,
            "estimate_basis": {
                "estimate": True,
                "note": self.note,
                "reason": self.reason,
                "runs_ahead": self.runs_ahead,
                "runs_holding_devices": self.holding,
                "calibrations": self.calibrations,
            },
        }


class _Unknown(Exception):
    pass


class _Predictor:
    """Predicted run times of specs on one group, and the calibrations they came from."""

    def __init__(self, group: planning.Group):
        self.group = group
        self.calibrations: dict[str, dict[str, str]] = {}

    def seconds(self, run_id: int, spec: dict[str, Any], steps_done: int = 0) -> float:
        try:
            step_s, source = planning.step_time(spec, self.group)
        except planning.Unplannable as exc:
            raise _Unknown(f"run {run_id}'s time cannot be predicted: {exc}") from None
        described = source.describe()
        self.calibrations[described["name"]] = {"name": described["name"], "source": described["source"]}
        steps = int((spec.get("pipeline") or {}).get("steps", 0))
        return max(steps - steps_done, 0) * step_s


def estimate(run: Run, now: datetime.datetime) -> Estimate:
    """The estimated start of ``run`` (select_related its experiment's group); no estimate unless it is queued."""
    if run.state != RunState.QUEUED:
        return Estimate(None, "only a queued run has an estimated start")
    group_model = run.experiment.group
    queue = list(queue_order.queued_in_order(group_model.pk).values_list("pk", "devices_requested"))
    ids = [pk for pk, _ in queue]
    if run.pk not in ids:
        return Estimate(None, "the run has left the queue")
    place = ids.index(run.pk)
    holding = list(
        Run.objects.active()
        .filter(experiment__group_id=group_model.pk)
        .values_list("pk", "state", "devices_requested", "resolved_spec")
    )
    base = Estimate(None, runs_ahead=place, holding=len(holding))
    if place + len(holding) > MAX_PREDICTED:
        base.reason = (
            f"{place} runs ahead and {len(holding)} holding devices: more than the {MAX_PREDICTED} it predicts"
        )
        return base
    paused = [pk for pk, state, _, _ in holding if state == RunState.PAUSED]
    if paused:
        base.reason = f"run {paused[0]} is paused: it holds its devices until it is resumed"
        return base
    capacity = Device.objects.filter(
        host__group_id=group_model.pk, healthy=True, host__status=HostStatus.ONLINE
    ).count()
    predictor = _Predictor(planning.Group.of(group_model))
    specs = dict(Run.objects.filter(pk__in=ids[: place + 1]).values_list("pk", "resolved_spec"))
    done = dict(
        MetricPoint.objects.live()
        .filter(run_id__in=[pk for pk, *_ in holding])
        .values("run_id")
        .annotate(step=Max("step"))
        .values_list("run_id", "step")
    )
    try:
        ends = [(predictor.seconds(pk, spec, done.get(pk) or 0), need) for pk, _, need, spec in holding]
        offset = _walk(queue[: place + 1], capacity - sum(need for _, need in ends), ends, specs, predictor)
    except _Unknown as exc:
        base.reason = str(exc)
        base.calibrations = list(predictor.calibrations.values())
        return base
    base.calibrations = list(predictor.calibrations.values())
    if offset is None:
        base.reason = f"it needs more than the group's {capacity} healthy devices on online hosts"
        return base
    base.start = now + datetime.timedelta(seconds=offset)
    base.reason = (
        "devices are free now: the next admission pass starts it"
        if offset == 0
        else f"after {place} runs ahead and the {len(holding)} runs holding devices end, at their predicted speed"
    )
    return base


def _walk(
    queue: list[tuple[int, int]],
    free: int,
    ends: list[tuple[float, int]],
    specs: dict[int, dict[str, Any]],
    predictor: _Predictor,
) -> float | None:
    """Seconds from now until the last run of ``queue`` starts: each run in order takes its devices once
    enough are free (a run needing more than the whole group is passed over, as admission does), and
    holds them for its predicted run. None when the last one can never start."""
    releases = list(ends)
    heapq.heapify(releases)
    capacity = free + sum(need for _, need in releases)
    clock = 0.0
    for index, (pk, need) in enumerate(queue):
        last = index == len(queue) - 1
        if need > capacity:
            if last:
                return None
            continue
        while free < need:
            at, freed = heapq.heappop(releases)  # enough devices are held: something ends
            clock, free = max(clock, at), free + freed
        if last:
            return clock
        free -= need
        heapq.heappush(releases, (clock + predictor.seconds(pk, specs[pk]), need))
    return None
