"""Serializers of the jobs API: shapes of requests and replies only, no logic."""

from __future__ import annotations

import copy
import datetime
import json
from functools import cache
from typing import Any

from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from jobs import queue_order
from jobs.models import Allocation, Experiment, Run
from jobs.states import ACTIVE_STATES, TERMINAL_STATES, RunState
from rlplatform.models import Device, Host, Quota


class StrictSerializer(serializers.Serializer):
    """Rejects unknown request fields: a typo such as ``submision_id`` must not be silently ignored."""

    def to_internal_value(self, data):
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError({name: ["unknown field"] for name in unknown})
        return super().to_internal_value(data)


class FieldsOnceMixin:
    """Derive a ModelSerializer's fields from the model once per class, not per instance.

    DRF rebuilds every field from the model for each serializer it creates: on the
    run-status path (CI polling) that was about a sixth of a request's CPU. Each
    instance still gets its own deep copy, as DRF does for declared fields, so
    binding a field to its serializer stays per instance.
    """

    def get_fields(self):
        cls = type(self)
        prototype = cls.__dict__.get("_prototype_fields")
        if prototype is None:
            prototype = super().get_fields()
            cls._prototype_fields = prototype  # a race only builds it twice
        return copy.deepcopy(prototype)


def _created_by() -> serializers.CharField:
    return serializers.CharField(
        source="created_by.get_username",
        read_only=True,
        default=None,
        allow_null=True,
        help_text="null: a deleted user",
    )


class ExperimentSerializer(serializers.ModelSerializer):
    team_name = serializers.CharField(source="team.name", read_only=True)
    group_name = serializers.CharField(source="group.name", read_only=True)
    quota_name = serializers.CharField(source="quota.name", read_only=True)
    created_by = _created_by()

    class Meta:
        model = Experiment
        fields = [
            "id",
            "name",
            "description",
            "team",
            "team_name",
            "group",
            "group_name",
            "quota",
            "quota_name",
            "created_by",
            "created_at",
        ]
        read_only_fields = fields


class ExperimentWebhookSerializer(serializers.Serializer):
    url = serializers.CharField(
        allow_blank=True, help_text="http(s) URL of its runs' default alert webhook; blank: no default"
    )


class ExperimentCreateSerializer(StrictSerializer):
    name = serializers.CharField(help_text="Unique within the team: letters, digits, '.', '_', '-'")
    group = serializers.CharField(help_text="Resource group id or name (granted to the team)")
    team = serializers.IntegerField(required=False, help_text="Team id; default: the token's team, or your only team")
    quota = serializers.IntegerField(
        required=False, help_text="Existing quota id of the team in the group; default: a new quota"
    )
    description = serializers.CharField(required=False, allow_blank=True, default="")


class _RunList(serializers.ListSerializer):
    """A page of runs: the queued ones' positions read once per resource group, not once per run."""

    def to_representation(self, data):
        runs = queue_order.annotate_positions(data.all() if hasattr(data, "all") else data)
        return super().to_representation(runs)


class RunSerializer(FieldsOnceMixin, serializers.ModelSerializer):
    """A run as listed (without its spec)."""

    experiment_name = serializers.CharField(source="experiment.name", read_only=True)
    team = serializers.IntegerField(source="experiment.team_id", read_only=True)
    created_by = _created_by()
    queue_position = serializers.SerializerMethodField(help_text="1-based position in the group's queue (QUEUED only)")
    terminal = serializers.SerializerMethodField(
        help_text="COMPLETED, FAILED, CANCELLED or PREEMPTED: a waiting client stops here"
    )

    class Meta:
        model = Run
        fields = [
            "id",
            "name",
            "experiment",
            "experiment_name",
            "team",
            "state",
            "reason",
            "queue_position",
            "terminal",
            "priority",
            "submission_id",
            "devices_requested",
            "rollout_workers",
            "created_by",
            "submitted_at",
            "admitted_at",
            "started_at",
            "finished_at",
        ]
        read_only_fields = fields
        list_serializer_class = _RunList

    @extend_schema_field(serializers.IntegerField(allow_null=True))
    def get_queue_position(self, run: Run) -> int | None:
        if not hasattr(run, "queue_position"):  # one run (a list sets it for the whole page)
            queue_order.annotate_positions([run])
        return run.queue_position

    @extend_schema_field(OpenApiTypes.BOOL)
    def get_terminal(self, run: Run) -> bool:
        return run.is_terminal


class RunDetailSerializer(RunSerializer):
    """A run with its spec, resolved spec and the devices it holds."""

    devices = serializers.SerializerMethodField(help_text='Devices held now, as "host:index"')
    resolved_spec = serializers.JSONField(read_only=True)

    class Meta(RunSerializer.Meta):
        fields = [*RunSerializer.Meta.fields, "parent_checkpoint", "devices", "spec", "resolved_spec"]
        read_only_fields = fields

    @extend_schema_field(serializers.ListField(child=serializers.CharField()))
    def get_devices(self, run: Run) -> list[str]:
        if not run.is_active:
            return []  # only ADMITTED..PAUSED runs hold devices: skip the query
        held = run.allocations.active().order_by("device__host__name", "device__index")
        return [f"{host}:{index}" for host, index in held.values_list("device__host__name", "device__index")]


# --- the run-status read (GET /api/runs/{id}/, what CI polls) --------------------------------------------
#
# RunDetailSerializer's reply built from one hand-written query instead of the ORM and DRF fields: on
# the 2-core dev machine compiling the ORM queries and running DRF's per-field machinery cost more CPU
# than the database itself. The shape is RunDetailSerializer's exactly (same keys, order and formats);
# tests/api/test_api_runs.py compares the two for runs in every kind of state.

_DATETIME = serializers.DateTimeField()
_STATUS_DATETIMES = ("submitted_at", "admitted_at", "started_at", "finished_at")
_ACTIVE = frozenset(s.value for s in ACTIVE_STATES)
_TERMINAL = frozenset(s.value for s in TERMINAL_STATES)
# Run columns read by the status query, in the order the reply needs them.
_STATUS_RUN_COLUMNS = (
    "id",
    "name",
    "experiment_id",
    "state",
    "reason",
    "priority",
    "submission_id",
    "devices_requested",
    "rollout_workers",
    *_STATUS_DATETIMES,
    "parent_checkpoint",
    "spec",
    "resolved_spec",
)


@cache
def _status_sql(teams: int) -> str:
    """The run with its experiment's name and team, its creator's username and the devices it holds (one
    row per device, the run's columns repeated; one row without a device), limited to ``teams`` team ids."""
    q = connection.ops.quote_name
    user = get_user_model()._meta
    run, exp = q(Run._meta.db_table), q(Experiment._meta.db_table)
    alloc, dev, host = q(Allocation._meta.db_table), q(Device._meta.db_table), q(Host._meta.db_table)
    username = user.get_field(get_user_model().USERNAME_FIELD).column
    columns = ", ".join(f"r.{q(c)}" for c in _STATUS_RUN_COLUMNS)
    return (
        f"SELECT {columns}, e.{q('name')}, e.{q('team_id')}, e.{q('group_id')}, u.{q(username)}, h.{q('name')}, "
        f"d.{q('index')} "
        f"FROM {run} r JOIN {exp} e ON e.{q('id')} = r.{q('experiment_id')} "
        f"LEFT JOIN {q(user.db_table)} u ON u.{q(user.pk.column)} = r.{q('created_by_id')} "
        f"LEFT JOIN {alloc} a ON a.{q('run_id')} = r.{q('id')} AND a.{q('released_at')} IS NULL "
        f"LEFT JOIN {dev} d ON d.{q('id')} = a.{q('device_id')} "
        f"LEFT JOIN {host} h ON h.{q('id')} = d.{q('host_id')} "
        f"WHERE r.{q('id')} = %s AND e.{q('team_id')} IN ({', '.join(['%s'] * teams)}) "
        f"ORDER BY h.{q('name')}, d.{q('index')}"
    )


def _datetime(value) -> str | None:
    if value is None:
        return None
    if timezone.is_naive(value):  # SQLite hands back naive UTC; the ORM would make it aware
        value = timezone.make_aware(value, datetime.UTC)
    return _DATETIME.to_representation(value)


def run_status_reply(run_id: int, team_ids: list[int]) -> dict[str, Any] | None:
    """``RunDetailSerializer(run).data`` for the run ``run_id`` if it belongs to one of ``team_ids``, else None."""
    if not team_ids:
        return None
    with connection.cursor() as cursor:
        cursor.execute(_status_sql(len(team_ids)), [run_id, *team_ids])
        rows = cursor.fetchall()
    if not rows:
        return None
    n = len(_STATUS_RUN_COLUMNS)
    run = dict(zip(_STATUS_RUN_COLUMNS, rows[0][:n], strict=True))
    experiment_name, team_id, group_id, username = rows[0][n : n + 4]
    state = run["state"]
    # Only ADMITTED..PAUSED runs hold devices, as RunDetailSerializer.get_devices says.
    devices = [f"{host}:{index}" for *_, host, index in rows if host is not None] if state in _ACTIVE else []
    spec = run["resolved_spec"]
    return {
        "id": run["id"],
        "name": run["name"],
        "experiment": run["experiment_id"],
        "experiment_name": experiment_name,
        "team": team_id,
        "state": state,
        "reason": run["reason"],
        "queue_position": queue_order.position_of(run["id"], group_id) if state == RunState.QUEUED.value else None,
        "terminal": state in _TERMINAL,
        "priority": run["priority"],
        "submission_id": run["submission_id"],
        "devices_requested": run["devices_requested"],
        "rollout_workers": run["rollout_workers"],
        "created_by": username,
        **{name: _datetime(run[name]) for name in _STATUS_DATETIMES},
        "parent_checkpoint": run["parent_checkpoint"],
        "devices": devices,
        "spec": run["spec"],
        "resolved_spec": json.loads(spec) if isinstance(spec, str | bytes) else spec,
    }


@extend_schema_field({"oneOf": [{"type": "string"}, {"type": "object", "additionalProperties": True}]})
class SpecInputField(serializers.JSONField):
    """YAML/JSON text or a JSON object; validated by the runtime's schema in the handler."""


class RunSubmitSerializer(StrictSerializer):
    experiment = serializers.CharField(help_text="Experiment id or name")
    team = serializers.IntegerField(
        required=False, help_text="Team id, when an experiment name exists in several of your teams"
    )
    spec = SpecInputField(help_text="The run spec: YAML or JSON text, or an object")
    submission_id = serializers.CharField(
        required=False, allow_null=True, default=None, help_text="Idempotency key: a retry returns the same run (200)"
    )
    priority = serializers.IntegerField(
        required=False, allow_null=True, default=None, help_text="Overrides the quota's priority"
    )
    name = serializers.CharField(required=False, allow_null=True, default=None, help_text="Default: the spec's name")
    overrides = serializers.ListField(
        child=serializers.CharField(), required=False, default=list, help_text='"section.field=value" overrides'
    )


class PlanInputsSerializer(StrictSerializer):
    """What the capacity model needs that a spec does not say (jobs.planning.PlanInputs); every field optional."""

    prompt_tokens = serializers.IntegerField(required=False, help_text="Tokens of every prompt (default 32)")
    response_tokens = serializers.FloatField(
        required=False, help_text="Median response length in tokens (default: a quarter of rollout.max_new_tokens)"
    )
    response_sigma = serializers.FloatField(required=False, help_text="Log-space spread of a prompt's answers (0-5)")
    prompt_sigma = serializers.FloatField(required=False, help_text="Log-space spread of prompts' medians (0-5)")
    devices_per_node = serializers.IntegerField(required=False, help_text="Default: the group's largest host")
    max_lag = serializers.IntegerField(required=False, help_text="Async modes planned at max_policy_lag 1..this (1-8)")
    costs = serializers.DictField(
        required=False,
        help_text="capacity.Costs fields (docs/capacity.md): costs to plan on instead of the group's calibration",
    )


class RunPlanSerializer(RunSubmitSerializer):
    """A submission's fields (checked as a submit checks them, nothing stored), plus the model's inputs."""

    inputs = PlanInputsSerializer(required=False)


class PlanModeSerializer(serializers.Serializer):
    mode = serializers.CharField(help_text="sync, colocated or async")
    max_policy_lag = serializers.IntegerField(allow_null=True, help_text="async only")
    as_submitted = serializers.BooleanField(help_text="The spec's own mode (and lag)")
    devices = serializers.IntegerField(
        help_text="Devices the mode occupies (async: the trainer's and one per instance)"
    )
    fits = serializers.BooleanField(help_text="Within the group and the experiment's quota")
    samples_per_s = serializers.FloatField(allow_null=True)
    step_time_s = serializers.FloatField(allow_null=True)
    run_time_s = serializers.FloatField(allow_null=True, help_text="pipeline.steps x the step time")
    device_hours = serializers.FloatField(allow_null=True, help_text="devices x the run time")
    time_split = serializers.DictField(child=serializers.FloatField(), help_text="Seconds of a step, by part")
    bottleneck = serializers.CharField(allow_null=True)
    mean_staleness = serializers.FloatField(allow_null=True)
    problem = serializers.CharField(allow_blank=True, help_text="Why the mode does not fit or was not simulated")


class PlanCalibrationSerializer(serializers.Serializer):
    name = serializers.CharField()
    source = serializers.CharField(help_text="How the costs were obtained")
    kind = serializers.CharField(help_text="measured, derived (from a hardware preset) or request")
    measured_at = serializers.CharField(allow_blank=True)
    notes = serializers.CharField(allow_blank=True)


class PlanRecommendationSerializer(serializers.Serializer):
    mode = serializers.CharField()
    max_policy_lag = serializers.IntegerField(allow_null=True)
    bottleneck = serializers.CharField()
    why = serializers.CharField()


class NotModelledSerializer(serializers.Serializer):
    field = serializers.CharField(help_text="A spec field path, or a section")
    reason = serializers.CharField(help_text="The effect the model leaves out")


class PlanGroupSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    kind = serializers.CharField()
    devices = serializers.IntegerField()


class PlanSerializer(serializers.Serializer):
    """The plan of a spec (jobs.planning.plan): an estimate, with the calibration it rests on."""

    estimate = serializers.BooleanField(help_text="Always true: predictions of a model, not measurements")
    note = serializers.CharField()
    modelled = serializers.BooleanField(help_text="false: nothing was simulated; `reason` says why")
    reason = serializers.CharField(allow_blank=True)
    group = PlanGroupSerializer()
    calibration = PlanCalibrationSerializer(allow_null=True)
    inputs = serializers.DictField(help_text="The model inputs used (defaults and the request's)")
    modes = PlanModeSerializer(many=True)
    recommended = PlanRecommendationSerializer(allow_null=True)
    not_modelled = NotModelledSerializer(many=True)


class StartEstimateBasisSerializer(serializers.Serializer):
    estimate = serializers.BooleanField()
    note = serializers.CharField()
    reason = serializers.CharField(allow_blank=True, help_text="What the estimate rests on, or why there is none")
    runs_ahead = serializers.IntegerField()
    runs_holding_devices = serializers.IntegerField()
    calibrations = serializers.ListField(child=serializers.DictField(child=serializers.CharField()))


class StartEstimateSerializer(serializers.Serializer):
    """A queued run's estimated start (jobs.start_estimate); null with the reason for any other run."""

    run = serializers.IntegerField()
    state = serializers.CharField()
    estimated_start = serializers.DateTimeField(allow_null=True)
    estimate_basis = StartEstimateBasisSerializer()


class CancelSerializer(StrictSerializer):
    reason = serializers.CharField(required=False, allow_blank=True, default="")


class QuotaSerializer(serializers.ModelSerializer):
    team_name = serializers.CharField(source="team.name", read_only=True)
    group_name = serializers.CharField(source="group.name", read_only=True)
    device_hours_used = serializers.FloatField(read_only=True)

    class Meta:
        model = Quota
        fields = [
            "id",
            "name",
            "team",
            "team_name",
            "group",
            "group_name",
            "max_devices",
            "max_concurrent_runs",
            "max_rollout_workers",
            "priority",
            "device_hour_budget",
            "device_hours_used",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["id", "team", "group", "created_at", "updated_at"]


class QuotaCreateSerializer(StrictSerializer):
    name = serializers.CharField()
    team = serializers.IntegerField()
    group = serializers.IntegerField()
    max_devices = serializers.IntegerField(required=False)
    max_concurrent_runs = serializers.IntegerField(required=False)
    max_rollout_workers = serializers.IntegerField(required=False)
    priority = serializers.IntegerField(required=False)
    device_hour_budget = serializers.FloatField(required=False, allow_null=True)


class QuotaUpdateSerializer(StrictSerializer):
    name = serializers.CharField(required=False)
    max_devices = serializers.IntegerField(required=False)
    max_concurrent_runs = serializers.IntegerField(required=False)
    max_rollout_workers = serializers.IntegerField(required=False)
    priority = serializers.IntegerField(required=False)
    device_hour_budget = serializers.FloatField(required=False, allow_null=True)


# --- reply shapes of the live UI's endpoints (jobs.api.live builds the bodies; these document them) ------


class CheckpointFileSerializer(serializers.Serializer):
    path = serializers.CharField(help_text="Relative to the checkpoint directory")
    size = serializers.IntegerField(help_text="Bytes")


class CheckpointBodySerializer(serializers.Serializer):
    id = serializers.IntegerField()
    run = serializers.IntegerField()
    attempt = serializers.IntegerField()
    step = serializers.IntegerField()
    weight_version = serializers.IntegerField(allow_null=True)
    path = serializers.CharField()
    size = serializers.IntegerField(allow_null=True, help_text="Bytes")
    metrics = serializers.DictField(help_text="Metrics at the checkpoint's step")
    pinned = serializers.BooleanField()
    created = serializers.DateTimeField()
    files = CheckpointFileSerializer(many=True, required=False, help_text="Absent in pin/unpin replies")


class ConfigVersionBodySerializer(serializers.Serializer):
    number = serializers.IntegerField(help_text="0: the spec as submitted")
    params = serializers.DictField(help_text="Parameters this version changed")
    effective = serializers.DictField(help_text="Every live parameter in force from this version on")
    diff = serializers.DictField(help_text='{"param": {"before": ..., "after": ...}}')
    state = serializers.CharField(help_text="initial, pending, delivered, done or failed")
    created_by = serializers.CharField(required=False, allow_null=True)
    created_at = serializers.DateTimeField(required=False)


class RoleBodySerializer(serializers.Serializer):
    role = serializers.CharField()
    attempt = serializers.IntegerField()
    status = serializers.CharField()
    process = serializers.CharField(allow_blank=True, help_text="Process state; empty for a role not launched here")
    host = serializers.CharField(allow_blank=True)
    devices = serializers.ListField(help_text="Device indices on the host")
    restarts = serializers.IntegerField()
    exit_code = serializers.IntegerField(allow_null=True)
    message = serializers.CharField(allow_blank=True)
    first_seen = serializers.DateTimeField(allow_null=True)
    last_seen = serializers.DateTimeField(allow_null=True)
    log_tail = serializers.CharField(allow_blank=True)
