"""Control-plane tasks: periodic passes (queue ``default``; beat schedule in settings) and role launches.

All are idempotent and safe to overlap: every pass takes the group lock,
accounting moves each allocation's ``accounted_until`` mark, and a role start is
claimed by a conditional update (jobs.supervisor). ``start_role`` is the one
task sent to a host's own queue (``host.<name>``); the rest run on ``default``.
Importing jobs.supervisor here also registers the role supervisor with the
host agent (rlplatform.agent.on_host_ready): the worker imports this module through autodiscovery.
"""

from __future__ import annotations

from celery import shared_task
from django.db import transaction

from jobs import accounting, admission, checkpoints, launch, preemption, stream, supervisor
from jobs.alerts import tasks as alert_tasks  # noqa: F401 (registers the alerts' tasks with the worker)
from jobs.lifecycle import watchdog
from jobs.lifecycle.dispatch import request_launch
from jobs.models import Allocation, CheckpointRecord, Run


@shared_task(name="jobs.tasks.admit_pending", soft_time_limit=60, time_limit=90)
def admit_pending() -> int:
    """Admission pass over every group with queued runs (catches anything a submit or release missed)."""
    group_ids = sorted(set(Run.objects.queued().values_list("experiment__group_id", flat=True)))
    admitted = 0
    for group_id in group_ids:
        moved = admission.admit_group(group_id)
        request_launch(moved.admitted)  # committed already: sent at once
        admitted += len(moved.admitted)
        with transaction.atomic():  # live UI: the admitted runs, the queue moved
            stream.tell_changes(group_id, moved.admitted, queue_moved=moved.moved_queue)
        preemption.preempt_for_waiting(group_id)  # the first waiting run may take preemptible runs' devices
    return admitted


@shared_task(name="jobs.tasks.accrue_device_time", soft_time_limit=60, time_limit=90)
def accrue_device_time() -> float:
    """Add the device time of every active allocation to its quota; returns the seconds added."""
    group_ids = sorted(set(Allocation.objects.active().values_list("device__host__group_id", flat=True)))
    return sum(sum(accounting.accrue_group(group_id).values()) for group_id in group_ids)


@shared_task(name="jobs.tasks.apply_checkpoint_retention", soft_time_limit=120, time_limit=180)
def apply_checkpoint_retention() -> int:
    """Apply each run's checkpoint retention policy (jobs.checkpoints); returns how many were deleted."""
    run_ids = sorted(set(CheckpointRecord.objects.values_list("run_id", flat=True)))
    deleted = 0
    for run in Run.objects.filter(pk__in=run_ids).order_by("pk"):
        deleted += len(checkpoints.apply_retention(run))
    return deleted


@shared_task(name="jobs.tasks.launch_runs", soft_time_limit=240, time_limit=300)
def launch_runs(run_ids: list[int]) -> list[int]:
    """Place each admitted run's role and send its start task to its host (jobs.launch); the role ids."""
    roles = [launch.launch_run(run_id) for run_id in run_ids]
    return [role.pk for role in roles if role is not None]


@shared_task(name="jobs.tasks.start_role", soft_time_limit=90, time_limit=120)
def start_role(role_id: int, attempt: int) -> str:
    """On the role's host (queue ``host.<name>``): claim and start one attempt of the role (jobs.supervisor)."""
    return supervisor.start_role(role_id, attempt)


@shared_task(name="jobs.tasks.watch_roles", soft_time_limit=60, time_limit=90)
def watch_roles() -> dict[str, int]:
    """Beat: roles whose host is gone, start tasks the broker lost, admitted runs never launched
    (jobs.lifecycle.watchdog)."""
    return watchdog.watch()
