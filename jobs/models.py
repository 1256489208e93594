"""Experiments, runs and device allocations.

A Run carries its spec (as submitted) and resolved spec (all defaults), its
state (jobs.states) with the stored reason, and — while queued — its position
in the admission order. Change state only through ``jobs.handler``: it applies
transitions as conditional UPDATEs and releases devices.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from jobs.states import ACTIVE_STATES, TERMINAL_STATES, RunState
from rlplatform.models import Quota, ResourceGroup, Team

STATE_CHOICES = [(s.value, s.value.title()) for s in RunState]


class Experiment(models.Model):
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="experiments")
    name = models.CharField(max_length=100)
    description = models.TextField(blank=True)
    group = models.ForeignKey(ResourceGroup, on_delete=models.PROTECT, related_name="experiments")
    quota = models.ForeignKey(Quota, on_delete=models.PROTECT, related_name="experiments")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["team_id", "name"]
        constraints = [models.UniqueConstraint(fields=["team", "name"], name="experiment_unique_team_name")]

    def __str__(self) -> str:
        return f"{self.team}/{self.name}"


class RunQuerySet(models.QuerySet):
    def active(self):
        """Runs holding devices."""
        return self.filter(state__in=[s.value for s in ACTIVE_STATES])

    def queued(self):
        return self.filter(state=RunState.QUEUED.value)

    def terminal(self):
        return self.filter(state__in=[s.value for s in TERMINAL_STATES])

    def in_group(self, group_id: int):
        return self.filter(experiment__group_id=group_id)


class Run(models.Model):
    experiment = models.ForeignKey(Experiment, on_delete=models.CASCADE, related_name="runs")
    name = models.CharField(max_length=200)
    spec = models.TextField(help_text="The spec as submitted (YAML or JSON)")
    resolved_spec = models.JSONField(help_text="The validated spec with every default filled in")
    state = models.CharField(max_length=10, choices=STATE_CHOICES, default=RunState.QUEUED.value, db_index=True)
    reason = models.TextField(blank=True, help_text="Why it waits (QUEUED), failed or was preempted")
    priority = models.IntegerField(null=True, blank=True, help_text="Overrides the quota's priority when set")
    submission_id = models.CharField(
        max_length=128, null=True, blank=True, help_text="Client key; a resubmit with the same key returns this run"
    )
    # Copied from the resolved spec so admission never parses JSON.
    devices_requested = models.PositiveIntegerField()
    rollout_workers = models.PositiveIntegerField()
    queue_position = models.PositiveIntegerField(
        null=True, blank=True, help_text="1-based, among queued runs of the group"
    )
    parent_checkpoint = models.CharField(max_length=500, blank=True, help_text="Checkpoint this run forks from")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    submitted_at = models.DateTimeField(default=timezone.now, db_index=True)
    admitted_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = RunQuerySet.as_manager()

    class Meta:
        ordering = ["-submitted_at", "-pk"]
        constraints = [
            models.UniqueConstraint(
                fields=["experiment", "submission_id"],
                condition=Q(submission_id__isnull=False),
                name="run_unique_submission_id",
            ),
        ]
        indexes = [models.Index(fields=["experiment", "state"], name="run_experiment_state_idx")]

    def __str__(self) -> str:
        return f"run {self.pk} {self.name} ({self.state})"

    @property
    def is_active(self) -> bool:
        return RunState(self.state) in ACTIVE_STATES

    @property
    def is_terminal(self) -> bool:
        return RunState(self.state) in TERMINAL_STATES


class AllocationQuerySet(models.QuerySet):
    def active(self):
        return self.filter(released_at__isnull=True)


class Allocation(models.Model):
    """One device held by one run. Released rows stay as history; a device has at most one active row."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="allocations")
    device = models.ForeignKey("rlplatform.Device", on_delete=models.PROTECT, related_name="allocations")
    created_at = models.DateTimeField(default=timezone.now)
    # Device time up to here is already added to the quota's device_seconds_used.
    accounted_until = models.DateTimeField(default=timezone.now)
    released_at = models.DateTimeField(null=True, blank=True)

    objects = AllocationQuerySet.as_manager()

    class Meta:
        ordering = ["run_id", "device_id"]
        constraints = [
            models.UniqueConstraint(
                fields=["device"], condition=Q(released_at__isnull=True), name="allocation_one_active_per_device"
            ),
        ]

    def __str__(self) -> str:
        return f"run {self.run_id} -> device {self.device_id}"
