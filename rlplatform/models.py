"""The platform's data model: who may use which devices, and how much.

Team / Membership (roles viewer < editor < admin) over Django users;
ResourceGroup (a pool of one device kind) / Host / Device; Quota (the limits
of one experiment inside one group); APIToken (hashed at rest); AuditLog;
ScrapeToken (the one credential of /metrics, hashed at rest).
Runs and allocations live in the jobs app, which depends on this one.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone


class Role(models.TextChoices):
    VIEWER = "viewer", "Viewer"
    EDITOR = "editor", "Editor"
    ADMIN = "admin", "Admin"


# Higher rank includes every right of the lower ones.
ROLE_RANK = {Role.VIEWER: 1, Role.EDITOR: 2, Role.ADMIN: 3}


class DeviceKind(models.TextChoices):
    NPU = "npu", "Ascend NPU"
    GPU = "gpu", "GPU"
    CPU = "cpu", "CPU"


# The run spec says cuda where the platform says gpu.
SPEC_DEVICE_TO_KIND = {"npu": DeviceKind.NPU, "cuda": DeviceKind.GPU, "cpu": DeviceKind.CPU}


def validate_data_roots(value) -> None:
    """``Team.data_roots``: a list of absolute directory paths (resolved when a spec is checked)."""
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValidationError("must be a list of absolute directory paths")
    for item in value:
        if "\x00" in item or not PurePosixPath(item).is_absolute():
            raise ValidationError(f"{item!r} is not an absolute path")


class Team(models.Model):
    name = models.CharField(max_length=100, unique=True)
    description = models.TextField(blank=True)
    data_roots = models.JSONField(
        default=list,
        blank=True,
        validators=[validate_data_roots],
        help_text="Directories this team's run specs may read models and datasets from (absolute paths, "
        'e.g. ["/data/team-a"]), besides its own runs\' directories and TANDEM_SHARED_MODEL_ROOT.',
    )
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Membership(models.Model):
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.VIEWER)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["team_id", "user_id"]
        constraints = [models.UniqueConstraint(fields=["team", "user"], name="membership_unique_team_user")]

    def __str__(self) -> str:
        return f"{self.user} in {self.team} ({self.role})"


class ResourceGroup(models.Model):
    """A pool of devices of one kind. Teams listed in ``teams`` may place experiments in it."""

    name = models.CharField(max_length=100, unique=True)
    kind = models.CharField(max_length=3, choices=DeviceKind.choices)
    device_model = models.CharField(max_length=100, blank=True, help_text="e.g. Ascend 910B, H100, x86-64")
    description = models.TextField(blank=True)
    teams = models.ManyToManyField(Team, blank=True, related_name="resource_groups")
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class HostStatus(models.TextChoices):
    ONLINE = "online", "Online"
    DRAINING = "draining", "Draining"  # keeps its runs, takes no new ones
    OFFLINE = "offline", "Offline"
    LOST = "lost", "Lost"  # missed its heartbeats


class Host(models.Model):
    group = models.ForeignKey(ResourceGroup, on_delete=models.PROTECT, related_name="hosts")
    name = models.CharField(max_length=200, unique=True)
    address = models.CharField(max_length=255, blank=True)
    queue = models.CharField(max_length=200, blank=True, help_text="Celery queue of this host's worker")
    labels = models.JSONField(
        default=dict, blank=True, help_text='Topology labels, e.g. {"rack": "r1", "switch": "s1"}'
    )
    status = models.CharField(max_length=10, choices=HostStatus.choices, default=HostStatus.ONLINE)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["group_id", "name"]

    def __str__(self) -> str:
        return self.name

    def save(self, *args, **kwargs):
        if not self.queue:
            self.queue = f"host.{self.name}"
        super().save(*args, **kwargs)

    @property
    def switch(self) -> str | None:
        value = (self.labels or {}).get("switch")
        return str(value) if value not in (None, "") else None


class Device(models.Model):
    host = models.ForeignKey(Host, on_delete=models.CASCADE, related_name="devices")
    index = models.PositiveIntegerField(
        help_text="Index on the host (ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES)"
    )
    kind = models.CharField(max_length=3, choices=DeviceKind.choices)
    model = models.CharField(max_length=100, blank=True)
    memory_mb = models.PositiveIntegerField(default=0)
    healthy = models.BooleanField(default=True)
    usage = models.JSONField(
        default=dict,
        blank=True,
        help_text="The host agent's newest reading with its heartbeat: util_pct, mem_used_mb, at (ISO time)",
    )

    class Meta:
        ordering = ["host_id", "index"]
        constraints = [models.UniqueConstraint(fields=["host", "index"], name="device_unique_host_index")]

    def __str__(self) -> str:
        return f"{self.host.name}:{self.kind}{self.index}"


class Quota(models.Model):
    """The limits of one experiment inside one resource group.

    Experiments point at a quota (jobs.Experiment.quota); experiments sharing a
    quota pool its limits. ``device_seconds_used`` accumulates as runs hold
    devices (jobs.accounting); a budget of None means unlimited.
    """

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="quotas")
    group = models.ForeignKey(ResourceGroup, on_delete=models.PROTECT, related_name="quotas")
    name = models.CharField(max_length=100)
    max_devices = models.PositiveIntegerField(default=8, help_text="Devices held at once (hard cap)")
    max_concurrent_runs = models.PositiveIntegerField(default=4, help_text="Runs admitted at once")
    max_rollout_workers = models.PositiveIntegerField(default=64, help_text="Rollout workers of all admitted runs")
    priority = models.IntegerField(default=0, help_text="Default priority of its runs; higher is admitted first")
    device_hour_budget = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(0.0)], help_text="Device-hours allowed; empty = unlimited"
    )
    device_seconds_used = models.FloatField(default=0.0)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    updated_at = models.DateTimeField(auto_now=True)

    AUDITED_FIELDS = (
        "name",
        "max_devices",
        "max_concurrent_runs",
        "max_rollout_workers",
        "priority",
        "device_hour_budget",
    )

    class Meta:
        ordering = ["team_id", "name"]
        constraints = [models.UniqueConstraint(fields=["team", "group", "name"], name="quota_unique_team_group_name")]

    def __str__(self) -> str:
        return f"{self.team}/{self.name} @ {self.group}"

    @property
    def device_hours_used(self) -> float:
        return self.device_seconds_used / 3600.0


class APIToken(models.Model):
    """A bearer token acting as ``user`` within ``team`` only. Only a hash is stored (rlplatform.tokens)."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True, help_text="Public lookup part of the token")
    token_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-pk"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    def is_valid(self, now=None) -> bool:
        now = now or timezone.now()
        return self.revoked_at is None and self.expires_at > now


class AuditLog(models.Model):
    """Who changed what, from what, to what, when. Written by rlplatform.audit.record only."""

    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_name = models.CharField(max_length=150, blank=True, help_text="Username at the time (kept if deleted)")
    team = models.ForeignKey(Team, null=True, blank=True, on_delete=models.SET_NULL, related_name="audit_entries")
    action = models.CharField(max_length=64, db_index=True)
    target_type = models.CharField(max_length=64)
    target_id = models.CharField(max_length=64)
    target_repr = models.CharField(max_length=200)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-created_at", "-pk"]
        indexes = [models.Index(fields=["target_type", "target_id"], name="audit_target_idx")]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.actor_name or 'system'} {self.action} {self.target_repr}"


class ScrapeToken(models.Model):
    """A bearer token that may read ``/metrics`` and nothing else (scope ``metrics:read``), for a Prometheus
    server. It belongs to no team and acts as no user; only a hash is stored (rlplatform.scrape_tokens)."""

    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True, help_text="Public lookup part of the token")
    token_hash = models.CharField(max_length=64, unique=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-pk"]

    def __str__(self) -> str:
        return f"scrape token {self.name} ({self.prefix}…)"

    def is_valid(self, now=None) -> bool:
        now = now or timezone.now()
        return self.revoked_at is None and self.expires_at > now
