"""REST views of the live UI: chart data, commands, checkpoints, roles, events and config versions of a run.

Thin, like jobs.api.views: find the run among the caller's teams (another
team's is a 404), check the role for writes (viewers get 403), call the
domain module (jobs.series, jobs.commands, jobs.checkpoints, jobs.config_history),
serialize.
"""

from __future__ import annotations

from typing import Any

from django.http import FileResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, PermissionDenied
from rest_framework.response import Response

from jobs import checkpoints, commands, series
from jobs.api import serializers as s
from jobs.api.views import JobsAPIViewMixin
from jobs.config_history import config_history
from jobs.handler import InvalidInput
from jobs.lifecycle.files import read_tail, role_dir
from jobs.models import CheckpointRecord, Command, RoleHeartbeat, RoleState, Run, RunEvent, RunRole
from rlplatform import permissions as perms
from rlplatform.api import ErrorsSerializer

LOG_TAIL_BYTES = 4096  # of a role's log, in the roles table

MAX_KEY_LENGTH = 200
TRUE_VALUES = ("1", "true", "yes")
FALSE_VALUES = ("0", "false", "no", "")


class RunScopedMixin(JobsAPIViewMixin):
    """Views under /api/runs/{run_id}/...: the run must belong to one of the caller's teams."""

    def get_run(self) -> Run:
        run = (
            Run.objects.filter(pk=self.kwargs["run_id"], experiment__team__in=self.team_scope())
            .select_related("experiment")
            .first()
        )
        if run is None:
            raise NotFound("Not found.")
        return run

    def require_editor(self, team_id: int, what: str) -> None:
        if not perms.can_edit(self.request.user, team_id, self.token):
            raise PermissionDenied(f"viewers cannot {what}")


# --- chart data -----------------------------------------------------------------------------------------


def _metrics_params(params) -> dict[str, Any]:
    errors = []
    raw_keys = params.get("keys", "")
    keys = [k for k in (part.strip() for part in raw_keys.split(",")) if k]
    if not keys:
        errors.append({"field": "keys", "message": "give one or more metric names separated by commas"})
    elif len(keys) > series.MAX_KEYS:
        errors.append({"field": "keys", "message": f"at most {series.MAX_KEYS} metrics per request"})
    elif any(len(k) > MAX_KEY_LENGTH or "\x00" in k for k in keys):
        errors.append({"field": "keys", "message": f"metric names have at most {MAX_KEY_LENGTH} characters"})
    x = params.get("x", "step")
    if x not in ("step", "time"):
        errors.append({"field": "x", "message": "must be step or time"})
    raw_max = params.get("max_points", "1000")
    max_points = int(raw_max) if raw_max.isdigit() else -1
    if not 3 <= max_points <= series.MAX_POINTS_LIMIT:
        errors.append({"field": "max_points", "message": f"must be an integer from 3 to {series.MAX_POINTS_LIMIT}"})
    rewound = params.get("include_rewound", "0").lower()
    if rewound not in TRUE_VALUES + FALSE_VALUES:
        errors.append({"field": "include_rewound", "message": "must be 0 or 1"})
    if errors:
        raise InvalidInput(errors)
    return {
        "keys": list(dict.fromkeys(keys)),
        "x": x,
        "max_points": max_points,
        "include_rewound": rewound in TRUE_VALUES,
    }


class RunMetricsViewSet(RunScopedMixin, viewsets.ViewSet):
    """Downsampled chart data of a run (min and max per bucket plus the last point)."""

    pagination_class = None  # replies are not paginated (and the schema must not say they are)

    @extend_schema(
        parameters=[
            OpenApiParameter("keys", str, required=True, description="Metric names, comma-separated"),
            OpenApiParameter("x", str, enum=["step", "time"], description="x axis (default step)"),
            OpenApiParameter("max_points", int, description="At most this many points per series (default 1000)"),
            OpenApiParameter("include_rewound", str, description="1: also points rewound by a rollback, flagged"),
        ],
        responses={200: OpenApiTypes.OBJECT, 400: ErrorsSerializer},
    )
    def list(self, request, run_id=None):
        run = self.get_run()
        return Response(series.series(run.pk, **_metrics_params(request.query_params)))

    @extend_schema(responses={200: {"type": "array", "items": {"type": "string"}}})
    @action(detail=False, methods=["get"])
    def keys(self, request, run_id=None):
        """Names of the metrics the run reported."""
        return Response(series.metric_keys(self.get_run().pk))


# --- commands -------------------------------------------------------------------------------------------


class CommandSerializer(serializers.ModelSerializer):
    # Plain strings: choice enums would collide in the schema with other "kind"/"state" enums.
    kind = serializers.CharField(read_only=True)
    state = serializers.CharField(read_only=True, help_text="pending, delivered, done or failed")
    created_by = serializers.CharField(source="created_by.get_username", read_only=True, default=None)

    class Meta:
        model = Command
        fields = ["id", "kind", "args", "state", "message", "created_by", "created_at", "delivered_at", "finished_at"]
        read_only_fields = fields


class CommandCreateSerializer(serializers.Serializer):
    kind = serializers.CharField(help_text="pause, resume, stop, cancel, rollback, fork or set_params")
    args = serializers.JSONField(required=False, default=dict, help_text="Arguments of the kind")


class RunCommandsViewSet(RunScopedMixin, viewsets.ViewSet):
    """Commands of a run: list (newest first) and create (editors and admins)."""

    @extend_schema(responses={200: CommandSerializer(many=True)})
    def list(self, request, run_id=None):
        run = self.get_run()
        qs = Command.objects.filter(run=run).select_related("created_by").order_by("-pk")
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(qs, request, view=self)
        return paginator.get_paginated_response(CommandSerializer(page, many=True).data)

    @extend_schema(
        request=CommandCreateSerializer,
        responses={
            201: CommandSerializer,
            400: ErrorsSerializer,
            403: OpenApiResponse(description="Viewers cannot command runs"),
            409: OpenApiResponse(description="The run's state does not allow this command"),
        },
    )
    def create(self, request, run_id=None):
        run = self.get_run()
        self.require_editor(run.experiment.team_id, "command runs")
        data = CommandCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        command = commands.create(request.user, run, data.validated_data["kind"], data.validated_data["args"])
        return Response(CommandSerializer(command).data, status=status.HTTP_201_CREATED)


# --- checkpoints ----------------------------------------------------------------------------------------


def _checkpoint_body(record: CheckpointRecord, with_files: bool = True) -> dict[str, Any]:
    body = {
        "id": record.pk,
        "run": record.run_id,
        "attempt": record.attempt,
        "step": record.step,
        "weight_version": record.weight_version,
        "path": record.path,
        "size": record.size,
        "metrics": record.metrics,
        "pinned": record.pinned,
        "created": record.created,
    }
    if with_files:
        body["files"] = checkpoints.files(record)
    return body


class RunCheckpointsViewSet(RunScopedMixin, viewsets.ViewSet):
    """Checkpoints of a run, newest step first, with their files."""

    pagination_class = None

    @extend_schema(responses={200: s.CheckpointBodySerializer(many=True)})
    def list(self, request, run_id=None):
        run = self.get_run()
        records = CheckpointRecord.objects.filter(run=run).order_by("-step", "-pk")
        return Response([_checkpoint_body(r) for r in records])


class CheckpointViewSet(RunScopedMixin, viewsets.ViewSet):
    """One checkpoint: detail, file download, pin, unpin, delete (editors and admins write)."""

    queryset = CheckpointRecord.objects.none()  # for the schema only (types the id); get_record scopes by team

    def get_record(self, pk) -> CheckpointRecord:
        record = (
            CheckpointRecord.objects.filter(
                pk=int(pk) if str(pk).isdigit() else 0, run__experiment__team__in=self.team_scope()
            )
            .select_related("run__experiment")
            .first()
        )
        if record is None:
            raise NotFound("Not found.")
        return record

    @extend_schema(responses={200: s.CheckpointBodySerializer})
    def retrieve(self, request, pk=None):
        return Response(_checkpoint_body(self.get_record(pk)))

    @extend_schema(responses={204: None, 409: OpenApiResponse(description="Pinned")})
    def destroy(self, request, pk=None):
        record = self.get_record(pk)
        self.require_editor(record.run.experiment.team_id, "delete checkpoints")
        checkpoints.delete(request.user, record)
        return Response(status=status.HTTP_204_NO_CONTENT)

    def _pin(self, request, pk, pinned: bool) -> Response:
        record = self.get_record(pk)
        self.require_editor(record.run.experiment.team_id, "pin checkpoints")
        record = checkpoints.set_pinned(request.user, record, pinned)
        return Response(_checkpoint_body(record, with_files=False))

    @extend_schema(request=None, responses={200: s.CheckpointBodySerializer})
    @action(detail=True, methods=["post"])
    def pin(self, request, pk=None):
        return self._pin(request, pk, True)

    @extend_schema(request=None, responses={200: s.CheckpointBodySerializer})
    @action(detail=True, methods=["post"])
    def unpin(self, request, pk=None):
        return self._pin(request, pk, False)

    @extend_schema(responses={(200, "application/octet-stream"): OpenApiTypes.BINARY})
    @action(detail=True, methods=["get"], url_path=r"files/(?P<file_path>.+)")
    def files(self, request, pk=None, file_path=""):
        """Download one file of the checkpoint, streamed."""
        record = self.get_record(pk)
        try:
            path = checkpoints.file_path(record, file_path)
        except checkpoints.CheckpointFileNotFound:
            raise NotFound("Not found.") from None
        return FileResponse(path.open("rb"), as_attachment=True, filename=path.name)


# --- roles, events, config versions --------------------------------------------------------------------


class RunRolesViewSet(RunScopedMixin, viewsets.ViewSet):
    """The run's role processes: as the platform launched them (host, devices, process state, restarts, exit,
    log tail) and as they last reported (heartbeat status, last seen)."""

    pagination_class = None

    @extend_schema(responses={200: s.RoleBodySerializer(many=True)})
    def list(self, request, run_id=None):
        run = self.get_run()
        beats: dict[tuple[str, int], RoleHeartbeat] = {}
        latest: dict[str, RoleHeartbeat] = {}
        for beat in RoleHeartbeat.objects.filter(run=run).order_by("role", "-attempt"):
            beats[(beat.role, beat.attempt)] = beat
            latest.setdefault(beat.role, beat)
        out = []
        for role in RunRole.objects.filter(run=run).select_related("host"):
            beat = beats.get((role.name, role.attempt))
            out.append(
                {
                    "role": role.name,
                    "attempt": role.attempt,
                    "status": beat.status if beat is not None and role.state == RoleState.RUNNING else role.state,
                    "process": role.state,
                    "host": role.host.name,
                    "devices": role.device_indices,
                    "restarts": role.restarts,
                    "exit_code": role.exit_code,
                    "message": role.message,
                    "first_seen": beat.first_seen if beat else role.launched_at,
                    "last_seen": beat.last_seen if beat else role.supervised_at,
                    "log_tail": read_tail(role_dir(role) / "log", LOG_TAIL_BYTES),
                }
            )
        launched = {r["role"] for r in out}
        for name, beat in latest.items():
            if name in launched:
                continue  # a child of a launched role reports under its own name only when it has one
            info = beat.info or {}
            out.append(
                {
                    "role": name,
                    "attempt": beat.attempt,
                    "status": beat.status,
                    "process": "",
                    "host": info.get("host", ""),
                    "devices": info.get("devices", []),
                    "restarts": beat.attempt,
                    "exit_code": None,
                    "message": "",
                    "first_seen": beat.first_seen,
                    "last_seen": beat.last_seen,
                    "log_tail": info.get("log_tail", ""),
                }
            )
        return Response(out)


class RunEventsViewSet(RunScopedMixin, viewsets.ViewSet):
    """The run's runtime events in time order (``?kind=`` filters), paginated."""

    @extend_schema(
        parameters=[OpenApiParameter("kind", str, description="Only events of this kind")],
        responses={200: OpenApiTypes.OBJECT},
    )
    def list(self, request, run_id=None):
        run = self.get_run()
        qs = RunEvent.objects.filter(run=run).order_by("time", "pk")
        if request.query_params.get("kind"):
            qs = qs.filter(kind=request.query_params["kind"])
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(
            qs.values("id", "attempt", "role", "seq", "kind", "payload", "time"), request, view=self
        )
        return paginator.get_paginated_response(page)


class RunConfigVersionsViewSet(RunScopedMixin, viewsets.ViewSet):
    """Live parameter changes of the run, each with the parameters in force and a diff to the previous version."""

    pagination_class = None

    @extend_schema(responses={200: s.ConfigVersionBodySerializer(many=True)})
    def list(self, request, run_id=None):
        return Response(config_history(self.get_run()))


__all__ = [
    "CheckpointViewSet",
    "RunCheckpointsViewSet",
    "RunCommandsViewSet",
    "RunConfigVersionsViewSet",
    "RunEventsViewSet",
    "RunMetricsViewSet",
    "RunRolesViewSet",
]
