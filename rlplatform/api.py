"""REST API of the platform app: teams, resource groups, hosts, devices, API tokens, audit log.

Also the plumbing every API view shares (the jobs API builds on it):
pagination, the one error format, and the exception table.

Visibility is always by queryset: an object of a team the caller (or the
caller's token) cannot see is simply absent, so it is a 404, never a 403.
Every error reply has the body ``{"errors": [{"field": "...", "message": "..."}]}``
(rlplatform.error_bodies; the exception table below decides the status).
"""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.core.exceptions import ObjectDoesNotExist, RequestDataTooBig
from django.db.models import Count, Exists, OuterRef, ProtectedError, Q
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_field
from rest_framework import mixins, permissions, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ParseError, PermissionDenied, ValidationError
from rest_framework.pagination import PageNumberPagination
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from rlplatform import permissions as perms
from rlplatform import tokens
from rlplatform.api_auth import request_token
from rlplatform.error_bodies import WHOLE_REQUEST, field_errors_body, refusal_body
from rlplatform.input_boundary import InputRejected
from rlplatform.memberships import MembershipError
from rlplatform.models import APIToken, AuditLog, Device, Host, ResourceGroup, Role, Team
from rlplatform.tokens import RevokeDenied, TokenError

# --- shared plumbing --------------------------------------------------------------------------


class Pagination(PageNumberPagination):
    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500


class FieldErrorSerializer(serializers.Serializer):
    field = serializers.CharField()
    message = serializers.CharField()


class ErrorsSerializer(serializers.Serializer):
    """Body of every 400 reply."""

    errors = FieldErrorSerializer(many=True)


class ErrorReplySerializer(serializers.Serializer):
    """Body of every error reply but a 400's (401, 403, 404, 409, 415, ...): the message twice."""

    detail = serializers.CharField()
    # Not required while the input boundary's 404 (a path no route matches) still answers with detail alone.
    errors = FieldErrorSerializer(many=True, required=False, help_text='One entry, its field "request"')


class APIAutoSchema(AutoSchema):
    """The schema of every operation also states the error replies it can give, unless it documents its own:
    400 (the input boundary applies to every request), 401/403, 404 where a path names an object or a page,
    409 for writes, 415 where there is a body."""

    def _get_response_bodies(self, direction="response"):
        responses = super()._get_response_bodies(direction)
        errors = {
            "400": OpenApiResponse(ErrorsSerializer, description="Bad input, each problem naming its field"),
            "401": OpenApiResponse(ErrorReplySerializer, description="No credentials, or a token not valid"),
            "403": OpenApiResponse(ErrorReplySerializer, description="Your role does not allow this"),
        }
        if "{" in self.path:
            errors["404"] = OpenApiResponse(ErrorReplySerializer, description="No such object among your teams'")
        elif self.method == "GET" and self._is_list_view() and self._get_paginator() is not None:
            errors["404"] = OpenApiResponse(ErrorReplySerializer, description="No such page")
        if self.method not in ("GET", "HEAD", "OPTIONS"):
            errors["409"] = OpenApiResponse(ErrorReplySerializer, description="The object's state does not allow this")
        if self.method in ("POST", "PUT", "PATCH"):
            errors["415"] = OpenApiResponse(ErrorReplySerializer, description="The body is not JSON")
        for code, response in errors.items():
            if code not in responses:
                responses[code] = self._get_response_for_code(response, code, direction=direction)
        return responses


def errors_response(errors: list[dict[str, str]], code: int = status.HTTP_400_BAD_REQUEST) -> Response:
    return Response(field_errors_body(errors), status=code)


def _flatten(detail: Any, prefix: str = "") -> list[dict[str, str]]:
    """DRF's nested ValidationError detail as a flat list of dotted field paths."""
    if isinstance(detail, dict):
        out: list[dict[str, str]] = []
        for key, value in detail.items():
            name = "" if key == "non_field_errors" else str(key)
            out.extend(_flatten(value, f"{prefix}.{name}" if prefix and name else (prefix or name)))
        return out
    if isinstance(detail, list):
        if all(not isinstance(item, dict | list) for item in detail):
            return [{"field": prefix or WHOLE_REQUEST, "message": str(item)} for item in detail]
        out = []
        for i, item in enumerate(detail):
            out.extend(_flatten(item, f"{prefix}.{i}" if prefix else str(i)))
        return out
    return [{"field": prefix or WHOLE_REQUEST, "message": str(detail)}]


def _field_errors(exc: Exception) -> list[dict[str, str]]:
    errors = getattr(exc, "errors", None)
    if isinstance(errors, list):
        return errors
    return [{"field": getattr(exc, "field", WHOLE_REQUEST), "message": getattr(exc, "message", str(exc))}]


# Domain exception -> HTTP status: the one table. Bodies: 400 carries field errors, the rest refusal_body.
# jobs.errors extends it with the jobs domain's exceptions, jobs.ingest.views with the ingest API's WrongRun.
PLATFORM_ERRORS: list[tuple[type[Exception], int]] = [
    (InputRejected, status.HTTP_400_BAD_REQUEST),
    (TokenError, status.HTTP_400_BAD_REQUEST),
    (MembershipError, status.HTTP_400_BAD_REQUEST),
    (RevokeDenied, status.HTTP_403_FORBIDDEN),
    (ObjectDoesNotExist, status.HTTP_404_NOT_FOUND),
    (ProtectedError, status.HTTP_409_CONFLICT),
]


def _message(exc: Exception) -> str:
    if isinstance(exc, ProtectedError):
        return "still in use by other objects; remove those first"
    if isinstance(exc, ObjectDoesNotExist):
        return "Not found."  # the same for a missing object and another team's
    return str(exc)


def make_exception_handler(table: list[tuple[type[Exception], int]]):
    """A DRF exception handler that maps ``table``'s exceptions (first match wins) and gives every error
    reply the errors shape: field errors for a 400, refusal_body for the others (DRF's own included)."""

    def handler(exc: Exception, context: dict) -> Response | None:
        for exc_type, code in table:
            if isinstance(exc, exc_type):
                if code == status.HTTP_400_BAD_REQUEST:
                    return errors_response(_field_errors(exc))
                return Response(refusal_body(_message(exc)), status=code)
        if isinstance(exc, ValidationError):
            return errors_response(_flatten(exc.detail))
        if isinstance(exc, RequestDataTooBig):  # Django's own size check, when a view reads request.body
            return errors_response([{"field": "body", "message": str(exc)}])
        response = drf_exception_handler(exc, context)
        if response is None:
            return None
        if response.status_code == status.HTTP_400_BAD_REQUEST:
            # Any other 400 of DRF (ParseError from a parser other than ours, ...): the same shape.
            field = "body" if isinstance(exc, ParseError) else WHOLE_REQUEST
            return errors_response(_flatten(response.data.get("detail", response.data), field))
        if isinstance(response.data, dict) and set(response.data) == {"detail"}:
            # DRF's 401, 403, 404, 405, 406, 415, 429: the same body, keeping the reply's headers
            # (WWW-Authenticate, Allow, Retry-After).
            response.data = refusal_body(str(response.data["detail"]))
        return response

    return handler


platform_exception_handler = make_exception_handler(PLATFORM_ERRORS)


class APIViewMixin:
    """Pagination and the error table for every view of the API."""

    pagination_class = Pagination
    exception_handler = staticmethod(platform_exception_handler)

    def get_exception_handler(self):
        return self.exception_handler

    @property
    def token(self) -> APIToken | None:
        return request_token(self.request)

    def team_scope(self):
        """The teams whose objects this request may read: for ``team__in=`` filters.

        For a token that is its own team alone, and authentication already
        checked the membership, so the hot path (CI polling a run) skips the
        membership join.
        """
        token = self.token
        if token is not None:
            return [token.team_id]
        return perms.teams_for(self.request.user)


class IsPlatformStaffOrReadOnly(permissions.BasePermission):
    """Cluster-wide objects (groups, hosts, devices): members read, platform staff write (session only)."""

    message = "only platform staff change resource groups, hosts and devices"

    def has_permission(self, request, view) -> bool:
        if request.method in permissions.SAFE_METHODS:
            return True
        return perms.can_manage_groups(request.user, request_token(request))


def _allocation_model():
    # jobs depends on rlplatform, not the reverse: reach the model by name.
    return apps.get_model("jobs", "Allocation")


# --- teams --------------------------------------------------------------------------------------


class TeamSerializer(serializers.ModelSerializer):
    role = serializers.SerializerMethodField(help_text="Your role in the team (viewer, editor, admin)")

    class Meta:
        model = Team
        fields = ["id", "name", "description", "role", "created_at"]

    @extend_schema_field(OpenApiTypes.STR)
    def get_role(self, team: Team) -> str | None:
        request = self.context["request"]
        role = perms.role_of(request.user, team, request_token(request))
        return role.value if role else None


class TeamViewSet(APIViewMixin, viewsets.ReadOnlyModelViewSet):
    """Teams you belong to (only the token's team, for an API token)."""

    serializer_class = TeamSerializer

    def get_queryset(self):
        return perms.teams_for(self.request.user, token=self.token).order_by("name")


# --- resource groups, hosts, devices ---------------------------------------------------------


class ResourceGroupSerializer(serializers.ModelSerializer):
    devices_total = serializers.IntegerField(read_only=True)
    devices_healthy = serializers.IntegerField(read_only=True)
    devices_used = serializers.IntegerField(read_only=True)
    devices_free = serializers.SerializerMethodField(help_text="Healthy devices on online hosts not held by a run")
    teams = serializers.PrimaryKeyRelatedField(queryset=Team.objects.all(), many=True, required=False)

    class Meta:
        model = ResourceGroup
        fields = [
            "id",
            "name",
            "kind",
            "device_model",
            "description",
            "teams",
            "devices_total",
            "devices_healthy",
            "devices_used",
            "devices_free",
            "created_at",
        ]

    @extend_schema_field(OpenApiTypes.INT)
    def get_devices_free(self, group) -> int:
        return getattr(group, "devices_free_count", 0)


def annotate_group_usage(queryset):
    """Device counts per group in one query: total, healthy, held by a run, free to admit."""
    Allocation = _allocation_model()
    held = Q(hosts__devices__in=Allocation.objects.active().values("device_id"))
    usable = Q(hosts__devices__healthy=True, hosts__status="online")
    return queryset.annotate(
        devices_total=Count("hosts__devices", distinct=True),
        devices_healthy=Count("hosts__devices", filter=Q(hosts__devices__healthy=True), distinct=True),
        devices_used=Count("hosts__devices", filter=held, distinct=True),
        devices_free_count=Count("hosts__devices", filter=usable & ~held, distinct=True),
    )


class ResourceGroupViewSet(APIViewMixin, viewsets.ModelViewSet):
    """Pools of devices. Members of a granted team read; platform staff create and change them."""

    serializer_class = ResourceGroupSerializer
    permission_classes = [permissions.IsAuthenticated, IsPlatformStaffOrReadOnly]

    def get_queryset(self):
        return annotate_group_usage(perms.groups_for(self.request.user, self.token)).order_by("name")


class HostSerializer(serializers.ModelSerializer):
    group = serializers.PrimaryKeyRelatedField(queryset=ResourceGroup.objects.all())

    class Meta:
        model = Host
        fields = ["id", "group", "name", "address", "queue", "labels", "status", "last_heartbeat", "created_at"]
        read_only_fields = ["last_heartbeat"]

    def validate_labels(self, value):
        if not isinstance(value, dict) or not all(isinstance(v, str | int) for v in value.values()):
            raise ValidationError('must be an object of string labels, e.g. {"rack": "r1", "switch": "s1"}')
        return value


class HostViewSet(APIViewMixin, viewsets.ModelViewSet):
    serializer_class = HostSerializer
    permission_classes = [permissions.IsAuthenticated, IsPlatformStaffOrReadOnly]

    @extend_schema(parameters=[OpenApiParameter("group", int, description="Only hosts of this resource group")])
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    def get_queryset(self):
        qs = Host.objects.filter(group__in=perms.groups_for(self.request.user, self.token)).order_by("group_id", "name")
        group = self.request.query_params.get("group")
        if group is not None:
            qs = qs.filter(group_id=_int_param("group", group))
        return qs


class DeviceSerializer(serializers.ModelSerializer):
    host = serializers.PrimaryKeyRelatedField(queryset=Host.objects.all())
    host_name = serializers.CharField(source="host.name", read_only=True)
    in_use = serializers.BooleanField(read_only=True, help_text="Held by an admitted run")

    class Meta:
        model = Device
        fields = ["id", "host", "host_name", "index", "kind", "model", "memory_mb", "healthy", "in_use"]

    def validate(self, attrs):
        host = attrs.get("host") or getattr(self.instance, "host", None)
        kind = attrs.get("kind") or getattr(self.instance, "kind", None)
        if host is not None and kind is not None and kind != host.group.kind:
            # Admission counts a group's devices as one kind; a stray kind would be allocated wrongly.
            raise ValidationError({"kind": [f"host {host.name} is in a {host.group.kind} group"]})
        return attrs


class DeviceViewSet(APIViewMixin, viewsets.ModelViewSet):
    serializer_class = DeviceSerializer
    permission_classes = [permissions.IsAuthenticated, IsPlatformStaffOrReadOnly]

    @extend_schema(
        parameters=[
            OpenApiParameter("group", int, description="Only devices of this resource group"),
            OpenApiParameter("host", int, description="Only devices of this host"),
        ]
    )
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    def get_queryset(self):
        Allocation = _allocation_model()
        qs = (
            Device.objects.filter(host__group__in=perms.groups_for(self.request.user, self.token))
            .select_related("host")
            .annotate(in_use=Exists(Allocation.objects.active().filter(device=OuterRef("pk"))))
            .order_by("host_id", "index")
        )
        params = self.request.query_params
        if "group" in params:
            qs = qs.filter(host__group_id=_int_param("group", params["group"]))
        if "host" in params:
            qs = qs.filter(host_id=_int_param("host", params["host"]))
        return qs


def _int_param(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValidationError({name: ["must be an integer id"]}) from None


# --- API tokens -----------------------------------------------------------------------------------


class TokenSerializer(serializers.ModelSerializer):
    user = serializers.CharField(source="user.get_username", read_only=True)
    team_name = serializers.CharField(source="team.name", read_only=True)
    valid = serializers.SerializerMethodField()

    class Meta:
        model = APIToken
        fields = [
            "id",
            "name",
            "user",
            "team",
            "team_name",
            "prefix",
            "created_at",
            "expires_at",
            "revoked_at",
            "last_used_at",
            "valid",
        ]
        read_only_fields = fields

    @extend_schema_field(OpenApiTypes.BOOL)
    def get_valid(self, token: APIToken) -> bool:
        return token.is_valid()


class TokenCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=100)
    team = serializers.IntegerField(help_text="Team id; the token acts only within this team")
    expires_at = serializers.DateTimeField(required=False, help_text="Default: now + TANDEM_TOKEN_TTL_DAYS")


class TokenCreatedSerializer(TokenSerializer):
    token = serializers.CharField(read_only=True, help_text="The secret; shown only in this reply")

    class Meta(TokenSerializer.Meta):
        fields = [*TokenSerializer.Meta.fields, "token"]
        read_only_fields = fields


class TokenViewSet(
    APIViewMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet
):
    """Your API tokens, and for team admins every token of their teams.

    Create shows the secret once; DELETE and POST .../revoke/ revoke (the row
    stays, for the audit trail). Creating needs a session login: a token can
    not mint tokens, so a leaked CI token cannot outlive its own expiry.
    """

    serializer_class = TokenSerializer

    def get_queryset(self):
        user = self.request.user
        if not user.is_authenticated:  # schema generation
            return APIToken.objects.none()
        admin_teams = perms.teams_for(user, Role.ADMIN, token=self.token)
        qs = APIToken.objects.filter(Q(user=user) | Q(team__in=admin_teams)).select_related("user", "team")
        if self.token is not None:
            qs = qs.filter(team_id=self.token.team_id)
        return qs.order_by("-created_at", "-pk")

    @extend_schema(request=TokenCreateSerializer, responses={201: TokenCreatedSerializer, 400: ErrorsSerializer})
    def create(self, request):
        if self.token is not None:
            raise PermissionDenied("log in with a session to create tokens")
        data = TokenCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        team = perms.teams_for(request.user, token=None).filter(pk=data.validated_data["team"]).first()
        if team is None:
            return errors_response([{"field": "team", "message": "no such team among yours"}])
        token, raw = tokens.mint(
            request.user,
            team,
            data.validated_data["name"],
            expires_at=data.validated_data.get("expires_at"),
            actor=request.user,
        )
        body = TokenCreatedSerializer(token, context={"request": request}).data
        body["token"] = raw
        return Response(body, status=status.HTTP_201_CREATED)

    def _revoke(self, request) -> Response:
        token = self.get_object()
        tokens.revoke(token, actor=request.user)  # RevokeDenied: a 403, through the table
        token.refresh_from_db()
        return Response(TokenSerializer(token, context={"request": request}).data)

    @extend_schema(request=None, responses={200: TokenSerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request, pk=None):
        return self._revoke(request)

    @extend_schema(responses={200: TokenSerializer})
    def destroy(self, request, *args, **kwargs):
        return self._revoke(request)


# --- audit log ----------------------------------------------------------------------------------------


class AuditLogSerializer(serializers.ModelSerializer):
    class Meta:
        model = AuditLog
        fields = [
            "id",
            "created_at",
            "actor_name",
            "team",
            "action",
            "target_type",
            "target_id",
            "target_repr",
            "before",
            "after",
        ]
        read_only_fields = fields


class AuditLogViewSet(APIViewMixin, viewsets.ReadOnlyModelViewSet):
    """Audit entries of the teams you administer (all entries, for superusers), newest first."""

    serializer_class = AuditLogSerializer

    @extend_schema(
        parameters=[
            OpenApiParameter("action", str, description="e.g. quota.update, run.cancel, token.revoke"),
            OpenApiParameter("team", int, description="Only entries of this team"),
            OpenApiParameter("target_type", str, description="e.g. rlplatform.quota, jobs.run"),
        ]
    )
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    def get_queryset(self):
        user = self.request.user
        qs = AuditLog.objects.all()
        if not (user.is_superuser and self.token is None):
            qs = qs.filter(team__in=perms.teams_for(user, Role.ADMIN, token=self.token))
        params = self.request.query_params
        if "action" in params:
            qs = qs.filter(action=params["action"])
        if "team" in params:
            qs = qs.filter(team_id=_int_param("team", params["team"]))
        if "target_type" in params:
            qs = qs.filter(target_type=params["target_type"])
        return qs.order_by("-created_at", "-pk")
