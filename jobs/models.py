"""Experiments, runs and device allocations.

A Run carries its spec (as submitted) and resolved spec (all defaults), its
state (jobs.states) with the stored reason. A queued run's position is not
stored: jobs.queue_order derives it when read. Change state only through ``jobs.handler``: it applies
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
    parent_checkpoint = models.CharField(max_length=500, blank=True, help_text="Checkpoint this run forks from")
    excluded_hosts = models.JSONField(
        default=list, blank=True, help_text="Ids of hosts admission must not place it on (its role kept failing there)"
    )
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


# --- Role processes on hosts (jobs.lifecycle places and restarts them, jobs.supervisor runs them) ------


class RoleState(models.TextChoices):
    PENDING = "pending"  # placed; its start task is on the host's queue
    LAUNCHING = "launching"  # claimed by the host's worker, process being started
    RUNNING = "running"  # the process lives (the host's supervisor renews ``supervised_at``)
    EXITED = "exited"  # the process ended (``exit_code``; None when it vanished without one)


class RunRole(models.Model):
    """One role process of a run on one host: ``trainer-0`` (the pipeline, and the trainer ranks on its host),
    ``trainer-<i>`` (trainer ranks on a further host), ``rollout-<i>`` (a remote rollout instance).

    ``attempt`` counts launches: a restart bumps it, and the runtime reports under it (its run token is
    minted per attempt). Change it only through ``jobs.lifecycle.role_states``.
    """

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="roles")
    name = models.CharField(max_length=100)
    host = models.ForeignKey("rlplatform.Host", on_delete=models.PROTECT, related_name="roles")
    device_indices = models.JSONField(default=list, help_text="Indices of the host's devices the role sees")
    attempt = models.PositiveIntegerField(default=0)
    restarts = models.PositiveIntegerField(default=0, help_text="Restarts after failures (not preemptions)")
    host_failures = models.JSONField(default=dict, blank=True, help_text="Failed attempts per host id")
    state = models.CharField(max_length=10, choices=RoleState.choices, default=RoleState.PENDING)
    pid = models.IntegerField(null=True, blank=True, help_text="Process group of the role on its host")
    exit_code = models.IntegerField(null=True, blank=True)
    message = models.TextField(blank=True, help_text="Why it exited, from its log")
    workdir = models.CharField(max_length=500, help_text="The run's directory (checkpoints, spool, logs)")
    claimed_by = models.CharField(max_length=200, blank=True, help_text="Worker that started this attempt")
    queued_at = models.DateTimeField(default=timezone.now, help_text="When this attempt's start task was sent")
    launched_at = models.DateTimeField(null=True, blank=True)
    exited_at = models.DateTimeField(null=True, blank=True)
    supervised_at = models.DateTimeField(null=True, blank=True, help_text="Last time its supervisor saw it")
    stop_requested = models.BooleanField(
        default=False, help_text="Asked to stop: another trainer role of its run failed, and they restart together"
    )

    class Meta:
        ordering = ["run_id", "name"]
        constraints = [models.UniqueConstraint(fields=["run", "name"], name="runrole_unique_name")]
        indexes = [models.Index(fields=["host", "state"], name="runrole_host_state_idx")]

    def __str__(self) -> str:
        return f"run {self.run_id} {self.name}#{self.attempt} on {self.host_id} ({self.state})"


# --- Runtime-facing records: run tokens, ingest, commands (jobs.ingest, jobs.commands) ----------------


class RunToken(models.Model):
    """A bearer token that lets the role processes of one run attempt write to the ingest API.

    Minted by ``jobs.ingest.tokens.mint_run_token`` at launch; only a hash is stored.
    """

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="tokens")
    attempt = models.PositiveIntegerField()
    prefix = models.CharField(max_length=16, unique=True, help_text="Public lookup part of the token")
    token_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run_id", "attempt", "pk"]

    def __str__(self) -> str:
        return f"run {self.run_id} attempt {self.attempt} ({self.prefix}…)"


class MetricPointQuerySet(models.QuerySet):
    def live(self):
        """What readers show by default: points not rewound by a rollback."""
        return self.filter(rewound=False)


class MetricPoint(models.Model):
    """All metrics of one step of one run attempt, as a JSON object ``{name: number | null}``.

    Only one *live* row per (run, attempt, step): a replayed step merges its new
    keys in (first value of a key wins). Rows past a completed rollback are
    marked ``rewound`` — kept for the record, hidden by default — and the steps
    that follow the rollback get live rows of their own.
    """

    # No separate index on run: metricpoint_run_step_idx starts with it (one index less to write per point).
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="metric_points", db_index=False)
    attempt = models.PositiveIntegerField()
    step = models.BigIntegerField()
    time = models.DateTimeField(help_text="When the runtime measured it")
    metrics = models.JSONField(default=dict)
    rewound = models.BooleanField(default=False)

    objects = MetricPointQuerySet.as_manager()

    class Meta:
        ordering = ["run_id", "step", "attempt", "pk"]
        constraints = [
            models.UniqueConstraint(
                fields=["run", "attempt", "step"], condition=Q(rewound=False), name="metricpoint_unique_live_step"
            ),
        ]
        indexes = [models.Index(fields=["run", "step"], name="metricpoint_run_step_idx")]

    def __str__(self) -> str:
        return f"run {self.run_id}/{self.attempt} step {self.step}"


class SeriesStore(models.Model):
    """A run whose chart data the block store (jobs.series_store) holds completely, from its first point on.

    Runs without this row are read from the JSON rows. Its row lock serialises the run's store writers.
    """

    run = models.OneToOneField(Run, on_delete=models.CASCADE, primary_key=True, related_name="+")
    blocks = models.PositiveIntegerField(default=0, help_text="Point blocks written; the last one takes new points")


class SeriesPointBlock(models.Model):
    """Up to jobs.series_store.BLOCK_POINTS metric rows of a run in arrival order, as packed records.

    One 33-byte little-endian record per MetricPoint row (jobs.series_store.ROW): its id, step, attempt
    (int64), time (float8 Unix seconds, as PostgreSQL extracts it) and rewound flag (uint8).
    """

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="+", db_index=False)
    block = models.PositiveIntegerField()
    count = models.PositiveIntegerField()
    min_step = models.BigIntegerField()
    max_step = models.BigIntegerField()
    rows = models.BinaryField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "block"], name="seriespointblock_unique")]

    def __str__(self) -> str:
        return f"run {self.run_id} point block {self.block}"


class SeriesValueBlock(models.Model):
    """One metric's values (float8, NaN for null or absent) aligned with the entries of a point block.

    Shorter than its point block when the metric is absent from the block's last entries.
    """

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="+", db_index=False)
    key = models.CharField(max_length=200)
    block = models.PositiveIntegerField()
    values = models.BinaryField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "key", "block"], name="seriesvalueblock_unique")]

    def __str__(self) -> str:
        return f"run {self.run_id} {self.key} block {self.block}"


class SeriesRewind(models.Model):
    """Ids of the MetricPoint rows one rewind marked (int64 little-endian), for the chart-data store.

    Kept apart from the point blocks so that a rewind (inside a rollback command's transaction, which holds
    the command row and the run's stream counter) never waits for the store's lock that ingest holds.
    """

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="+")
    ids = models.BinaryField()

    def __str__(self) -> str:
        return f"run {self.run_id} rewind of {len(self.ids) // 8} rows"


class RunEvent(models.Model):
    """One runtime event (checkpoint, eval, resume, ...), idempotent on (run, attempt, role, seq)."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="events", db_index=False)
    attempt = models.PositiveIntegerField()
    role = models.CharField(max_length=100, blank=True, help_text="Reporting role; seq counts per role")
    seq = models.BigIntegerField()
    kind = models.CharField(max_length=50)
    payload = models.JSONField(default=dict)
    time = models.DateTimeField()

    class Meta:
        ordering = ["run_id", "attempt", "time", "pk"]
        constraints = [
            models.UniqueConstraint(fields=["run", "attempt", "role", "seq"], name="runevent_unique_seq"),
        ]

    def __str__(self) -> str:
        return f"run {self.run_id}/{self.attempt} {self.kind} #{self.seq}"


class CheckpointRecord(models.Model):
    """A checkpoint the runtime wrote (its directory on the run's storage), one row per path."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="checkpoints")
    attempt = models.PositiveIntegerField(default=0)
    step = models.BigIntegerField()
    weight_version = models.BigIntegerField(null=True, blank=True)
    path = models.CharField(max_length=500)
    size = models.BigIntegerField(null=True, blank=True, help_text="Bytes")
    metrics = models.JSONField(default=dict, blank=True)
    created = models.DateTimeField(default=timezone.now)
    pinned = models.BooleanField(default=False, help_text="Kept by the retention policy and not deletable")

    class Meta:
        ordering = ["run_id", "step", "pk"]
        constraints = [models.UniqueConstraint(fields=["run", "path"], name="checkpointrecord_unique_path")]

    def __str__(self) -> str:
        return f"run {self.run_id} checkpoint step {self.step}"


class RoleHeartbeat(models.Model):
    """The last sign of life of one role process of a run attempt (the watchdog reads these)."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="heartbeats")
    role = models.CharField(max_length=100)
    attempt = models.PositiveIntegerField()
    status = models.CharField(max_length=40, default="running")
    info = models.JSONField(default=dict, blank=True)
    first_seen = models.DateTimeField(default=timezone.now)
    last_seen = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["run_id", "role", "attempt"]
        constraints = [models.UniqueConstraint(fields=["run", "role", "attempt"], name="roleheartbeat_unique_role")]

    def __str__(self) -> str:
        return f"run {self.run_id} {self.role}/{self.attempt} {self.status}"


class CommandKind(models.TextChoices):
    PAUSE = "pause"
    RESUME = "resume"
    STOP = "stop"
    CANCEL = "cancel"
    ROLLBACK = "rollback"
    FORK = "fork"
    SET_PARAMS = "set_params"
    PREEMPT = "preempt"  # sent by the platform only (jobs.preemption): checkpoint, exit, requeue


class CommandState(models.TextChoices):
    PENDING = "pending"
    DELIVERED = "delivered"
    DONE = "done"
    FAILED = "failed"


class Command(models.Model):
    """An instruction to a run's runtime, persisted with its state: pending -> delivered -> done | failed.

    Change it only through ``jobs.commands``.
    """

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="commands")
    kind = models.CharField(max_length=20, choices=CommandKind.choices)
    args = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=10, choices=CommandState.choices, default=CommandState.PENDING)
    message = models.TextField(blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    delivered_at = models.DateTimeField(null=True, blank=True)
    deliveries = models.PositiveIntegerField(default=0, help_text="Replies that carried it (redelivered if unacked)")
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run_id", "pk"]
        indexes = [models.Index(fields=["run", "state"], name="command_run_state_idx")]

    def __str__(self) -> str:
        return f"command {self.pk} {self.kind} of run {self.run_id} ({self.state})"


class ConfigVersion(models.Model):
    """A numbered live change of a run's safe parameters (``params``: dotted name -> value)."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="config_versions")
    number = models.PositiveIntegerField()
    params = models.JSONField()
    command = models.OneToOneField(
        Command, null=True, blank=True, on_delete=models.SET_NULL, related_name="config_version"
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["run_id", "number"]
        constraints = [models.UniqueConstraint(fields=["run", "number"], name="configversion_unique_number")]

    def __str__(self) -> str:
        return f"run {self.run_id} config v{self.number}"


# --- Live UI: the per-run stream (jobs.stream) and checkpoint pins (jobs.checkpoints) ---------------------


class RunStreamCounter(models.Model):
    """The last sequence number handed out in a run's stream.

    A row of its own (not a column of Run) so that allocating a number locks this row only:
    the lock is held to the end of the appending transaction, so a run's entries commit in
    seq order and a rolled-back append gives its number back (no gaps).
    """

    run = models.OneToOneField(Run, on_delete=models.CASCADE, primary_key=True, related_name="stream_counter")
    last_seq = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"run {self.run_id} stream at {self.last_seq}"


class StreamType(models.TextChoices):
    METRICS = "metrics"
    STATE = "state"
    ROLE = "role"
    EVENT = "event"
    COMMAND = "command"
    CHECKPOINT = "checkpoint"
    CONFIG = "config"
    REWOUND = "rewound"


class RunStreamEntry(models.Model):
    """One change a viewer of a run sees, numbered gap-free per run (``seq`` from 1). Append with jobs.stream."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="stream_entries", db_index=False)
    seq = models.BigIntegerField()
    type = models.CharField(max_length=12, choices=StreamType.choices)
    data = models.JSONField(default=dict)
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["run_id", "seq"]
        constraints = [models.UniqueConstraint(fields=["run", "seq"], name="runstreamentry_unique_seq")]

    def __str__(self) -> str:
        return f"run {self.run_id} #{self.seq} {self.type}"


# --- Alerts (jobs.alerts): per-run rules evaluated as metrics arrive, webhook deliveries ----------------


class AlertRule(models.Model):
    """One alert rule of a run (jobs.alerts.rules: the kinds and what ``threshold`` means for each), with
    its evaluation state: whether it fires now, and what the next evaluation continues from."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="alert_rules")
    kind = models.CharField(max_length=20)
    metric = models.CharField(max_length=200, blank=True, help_text="The metric it watches (blank: the kind's own)")
    threshold = models.FloatField(help_text="What it compares with; its meaning depends on the kind")
    enabled = models.BooleanField(default=True)
    firing = models.BooleanField(default=False)
    value = models.FloatField(null=True, blank=True, help_text="The value at the last firing or resolving")
    changed_at = models.DateTimeField(null=True, blank=True, help_text="When it last fired or resolved")
    last_step = models.BigIntegerField(null=True, blank=True, help_text="Newest step evaluated")
    streak = models.PositiveIntegerField(default=0, help_text="staleness: consecutive steps at the bound")
    history = models.JSONField(default=list, blank=True, help_text="throughput: the recent values (the median's)")
    seen_at = models.DateTimeField(null=True, blank=True, help_text="no_step: when the run's newest step arrived")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["run_id", "pk"]
        constraints = [models.UniqueConstraint(fields=["run", "kind", "metric"], name="alertrule_unique_kind")]
        indexes = [models.Index(fields=["kind", "enabled", "firing"], name="alertrule_kind_state")]

    def __str__(self) -> str:
        return f"run {self.run_id} alert {self.kind} {self.metric} {self.threshold:g}"


class AlertWebhook(models.Model):
    """A run's own webhook setting (jobs.alerts.webhook.target): its transitions are POSTed to ``url``; ``off``
    (url blank): to no webhook at all, not even the experiment's default. No row: the experiment's default."""

    run = models.OneToOneField(Run, on_delete=models.CASCADE, primary_key=True, related_name="alert_webhook")
    url = models.URLField(max_length=500, blank=True)
    off = models.BooleanField(default=False, help_text="The run opted out: no webhook, not the experiment's either")

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=(Q(off=True) & Q(url="")) | (Q(off=False) & ~Q(url="")), name="alertwebhook_url_or_off"
            )
        ]

    def __str__(self) -> str:
        return f"run {self.run_id} webhook {'off' if self.off else self.url}"


class ExperimentAlertWebhook(models.Model):
    """An experiment's default webhook: where the alert transitions of each of its runs without a webhook
    setting of their own (AlertWebhook) are POSTed. No row: no default."""

    experiment = models.OneToOneField(
        Experiment, on_delete=models.CASCADE, primary_key=True, related_name="alert_webhook"
    )
    url = models.URLField(max_length=500)

    def __str__(self) -> str:
        return f"experiment {self.experiment_id} default webhook {self.url}"


class AlertDelivery(models.Model):
    """One webhook delivery of one transition: pending until delivered, or failed after its retries."""

    PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="alert_deliveries")
    rule = models.ForeignKey(AlertRule, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    url = models.URLField(max_length=500)
    body = models.JSONField()
    state = models.CharField(max_length=10, default=PENDING)
    attempts = models.PositiveIntegerField(default=0)
    error = models.TextField(blank=True, help_text="Why the last attempt failed")
    created_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run_id", "pk"]

    def __str__(self) -> str:
        return f"run {self.run_id} delivery {self.pk} {self.state}"
