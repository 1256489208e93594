"""Preemption: a waiting higher-priority run takes the devices of preemptible lower-priority runs.

When the first run in a group's queue waits for free devices (not for its quota),
the pass looks among the group's RUNNING or PAUSED runs whose spec says
``resources.preemptible: true`` and whose effective priority is lower than the
waiting run's, lowest priority first (then the most recently started, which
loses the least work). It picks the fewest such victims whose devices, with the
free ones, let the waiting run be placed (jobs.placement.place_run), and sends each a
``preempt`` command. The runtime writes a checkpoint and exits; jobs.lifecycle then
moves the victim PREEMPTED -> QUEUED, admission gives the devices to the waiting
run, and the victim resumes from its checkpoint when devices free up again.

A victim already asked since its admission (its command pending, or done while
its process exits) is not asked twice;
nothing is sent when even all candidates together would not make room.
"""

from __future__ import annotations

from django.db import transaction
from django.db.models import Exists, F, OuterRef

from jobs import admission, commands, placement, queue_order
from jobs.lifecycle.events import record_event
from jobs.models import Allocation, Command, CommandKind, CommandState, Run
from jobs.states import RunState
from rlplatform import locks

NO_FREE_DEVICES = "no free "  # the start of admission's reason for a run that waits for devices


def preempt_for_waiting(group_id: int) -> list[int]:
    """One preemption pass over a group; returns the runs sent a preempt command."""
    with transaction.atomic():
        locks.lock_group(group_id)
        waiting = (
            queue_order.queued_in_order(group_id)
            .values_list("pk", "effective_priority", "devices_requested", "reason", "resolved_spec__resources")
            .first()
        )
        if waiting is None or not waiting[3].startswith(NO_FREE_DEVICES):
            return []
        waiting_id, priority, need, _reason, resources = waiting
        # Asked already during this admission (pending, or done while the process is still exiting): not again.
        asked = Command.objects.filter(
            run=OuterRef("pk"), kind=CommandKind.PREEMPT, created_at__gte=OuterRef("admitted_at")
        ).exclude(state=CommandState.FAILED)
        candidates = [
            run
            for run in queue_order.with_effective_priority(
                Run.objects.filter(experiment__group_id=group_id, state__in=[RunState.RUNNING, RunState.PAUSED])
                .exclude(Exists(asked))
                .select_related("experiment")
            ).order_by("effective_priority", F("started_at").desc(nulls_last=True), "-pk")
            if run.effective_priority < priority and run.resolved_spec.get("resources", {}).get("preemptible")
        ]
        victims = _fewest_victims(group_id, placement.shape_of(resources, need), candidates)
        for victim in victims:
            commands.create(None, victim, CommandKind.PREEMPT)
            record_event(victim.pk, "preempting", {"for_run": waiting_id})
    return [v.pk for v in victims]


def _fewest_victims(group_id: int, shape: placement.Shape, candidates: list[Run]) -> list[Run]:
    """The shortest prefix of ``candidates`` whose devices, added to the free ones, place a run of ``shape``
    (jobs.placement.place_run)."""
    free_by_host, _host_of, switch_of, _ = admission._free_devices(group_id)
    held = {}
    for run_id, device_id, host_id in (
        Allocation.objects.active().filter(run__in=candidates).values_list("run_id", "device_id", "device__host_id")
    ):
        held.setdefault(run_id, []).append((device_id, host_id))
    pool = {host: list(devices) for host, devices in free_by_host.items()}
    chosen: list[Run] = []
    for run in candidates:
        for device_id, host_id in held.get(run.pk, []):
            pool.setdefault(host_id, []).append(device_id)
        chosen.append(run)
        if placement.place_run(shape, pool, switch_of) is not None:
            return chosen
    return []
