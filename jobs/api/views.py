"""REST views of the jobs app: experiments, runs (submit, list, detail, cancel, wait) and quotas.

Thin by design: check the caller's role, call jobs.handler, serialize. Domain
errors become HTTP codes through jobs.errors. Querysets are limited to the
caller's teams (the token's team only, for an API token), so another team's
object is a 404.
"""

from __future__ import annotations

import re
import time

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections, connection
from django.http.request import split_domain_port, validate_host
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, PermissionDenied
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response

from jobs import errors, handler, longpoll
from jobs.api import serializers as s
from jobs.models import Experiment, Run
from jobs.states import RunState
from rlplatform import permissions as perms
from rlplatform.api import APIViewMixin, ErrorsSerializer
from rlplatform.api_auth import authenticate_token
from rlplatform.models import Quota, ResourceGroup, Team
from rlplatform.security_headers import CONTENT_SECURITY_POLICY, CSP_HEADER

WAIT_DEFAULT_S = 30.0
WAIT_MAX_S = 300.0
QUOTA_STAFF_ONLY = "quotas are set by platform administrators (staff, signed in); team members can read them"


class JobsAPIViewMixin(APIViewMixin):
    exception_handler = staticmethod(errors.exception_handler)


def _require(allowed: bool, message: str) -> None:
    if not allowed:
        raise PermissionDenied(message)


def _int_or_none(value) -> int | None:
    return int(value) if isinstance(value, str) and value.isdigit() else None


# --- experiments -------------------------------------------------------------------------------------


class ExperimentViewSet(JobsAPIViewMixin, mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    """Experiments of your teams. Editors and admins create them."""

    serializer_class = s.ExperimentSerializer

    def get_queryset(self):
        qs = Experiment.objects.filter(team__in=self.team_scope())
        team = self.request.query_params.get("team")
        if team is not None:
            qs = qs.filter(team_id=_int_or_none(team) or 0)
        return qs.select_related("team", "group", "quota", "created_by").order_by("team_id", "name")

    @extend_schema(parameters=[OpenApiParameter("team", int, description="Only experiments of this team")])
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(request=s.ExperimentCreateSerializer, responses={201: s.ExperimentSerializer, 400: ErrorsSerializer})
    def create(self, request, *args, **kwargs):
        data = s.ExperimentCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        team = _pick_team(request.user, self.token, values.get("team"))
        _require(
            perms.can_edit(request.user, team, self.token), f"viewers of team {team.name} cannot create experiments"
        )
        group = _visible_group(request.user, self.token, values["group"])
        quota = None
        if values.get("quota") is not None:
            quota = Quota.objects.filter(pk=values["quota"], team=team).first()
            if quota is None:
                raise handler.InvalidInput.one("quota", f"team {team.name} has no quota {values['quota']}")
        experiment = handler.create_experiment(
            request.user, team, values["name"], group, quota=quota, description=values["description"]
        )
        return Response(s.ExperimentSerializer(experiment).data, status=status.HTTP_201_CREATED)


def _pick_team(user, token, team_id: int | None):
    """The team a create acts in: the one named, else the token's, else the user's only team."""
    teams = perms.teams_for(user, token=token)
    if team_id is not None:
        team = teams.filter(pk=team_id).first()
        if team is None:
            raise handler.InvalidInput.one("team", f"no team {team_id} among yours")
        return team
    candidates = list(teams[:2])
    if len(candidates) != 1:
        raise handler.InvalidInput.one("team", "required: you belong to several teams (or none)")
    return candidates[0]


def _visible_group(user, token, ref: str) -> ResourceGroup:
    groups = perms.groups_for(user, token)
    group = groups.filter(pk=int(ref)).first() if ref.isdigit() else None
    group = group or groups.filter(name=ref).first()
    if group is None:
        raise handler.InvalidInput.one("group", f"no resource group {ref!r} available to your teams")
    return group


# --- runs ---------------------------------------------------------------------------------------------


def _resolve_experiment(user, token, ref: str, team_id: int | None) -> Experiment:
    """An experiment by id or name among the caller's teams; unknown or ambiguous is a 400 on `experiment`."""
    qs = Experiment.objects.filter(team__in=perms.teams_for(user, token=token)).select_related("team", "group", "quota")
    if team_id is not None:
        qs = qs.filter(team_id=team_id)
    ref = ref.strip()
    if ref.isdigit():
        by_id = qs.filter(pk=int(ref)).first()
        if by_id is not None:
            return by_id
    matches = list(qs.filter(name=ref)[:2])
    if not matches:
        raise handler.InvalidInput.one("experiment", f"no experiment {ref!r} in your teams")
    if len(matches) > 1:
        raise handler.InvalidInput.one(
            "experiment", f"{ref!r} names experiments in several of your teams: pass `team` or the experiment id"
        )
    return matches[0]


def _parse_timeout(raw: str | None) -> float:
    if raw is None or raw == "":
        return WAIT_DEFAULT_S
    try:
        value = float(raw)
    except ValueError:
        raise handler.InvalidInput.one("timeout", "must be a number of seconds") from None
    if not 0 <= value <= WAIT_MAX_S:
        raise handler.InvalidInput.one("timeout", f"must be between 0 and {WAIT_MAX_S:g} seconds")
    return value


RUN_LIST_PARAMS = [
    OpenApiParameter("state", str, enum=[st.value for st in RunState], description="Only runs in this state"),
    OpenApiParameter("experiment", str, description="Only runs of this experiment (id or name)"),
    OpenApiParameter("team", int, description="Only runs of this team"),
]


class RunViewSet(JobsAPIViewMixin, mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    """Runs of your teams' experiments: submit, list, detail, cancel, wait."""

    def get_serializer_class(self):
        return s.RunSerializer if self.action == "list" else s.RunDetailSerializer

    def get_queryset(self):
        qs = Run.objects.filter(experiment__team__in=self.team_scope())
        qs = qs.select_related("experiment", "created_by")
        if self.action != "list":
            return qs
        params = self.request.query_params
        if params.get("state"):
            state = params["state"].upper()
            if state not in RunState.__members__:
                raise handler.InvalidInput.one("state", f"unknown state; use one of {', '.join(RunState)}")
            qs = qs.filter(state=state)
        if params.get("team"):
            qs = qs.filter(experiment__team_id=_int_or_none(params["team"]) or 0)
        if params.get("experiment"):
            ref = params["experiment"]
            qs = qs.filter(experiment_id=int(ref)) if ref.isdigit() else qs.filter(experiment__name=ref)
        return qs.order_by("-submitted_at", "-pk")

    @extend_schema(parameters=RUN_LIST_PARAMS)
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    def retrieve(self, request, *args, **kwargs):
        # The status read CI polls: one query through serializers.run_status_reply, not the ORM and
        # RunDetailSerializer (same reply). Another team's run, like a missing one, is a 404.
        run_id = _int_or_none(kwargs["pk"])
        scope = self.team_scope()
        team_ids = scope if isinstance(scope, list) else list(scope.values_list("pk", flat=True))
        body = s.run_status_reply(run_id, team_ids) if run_id is not None else None
        if body is None:
            raise NotFound("Not found.")
        return Response(body)

    @extend_schema(
        request=s.RunSubmitSerializer,
        responses={
            201: OpenApiResponse(s.RunDetailSerializer, description="Queued (and possibly admitted at once)"),
            200: OpenApiResponse(s.RunDetailSerializer, description="Same submission_id seen before: the earlier run"),
            400: ErrorsSerializer,
            409: OpenApiResponse(description="submission_id already used with a different spec"),
        },
    )
    def create(self, request, *args, **kwargs):
        data = s.RunSubmitSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        experiment = _resolve_experiment(request.user, self.token, values["experiment"], values.get("team"))
        _require(
            perms.can_edit(request.user, experiment.team_id, self.token),
            f"viewers of team {experiment.team.name} cannot submit runs",
        )
        run, created = handler.submit_run(
            request.user,
            experiment,
            values["spec"],
            submission_id=values["submission_id"],
            priority=values["priority"],
            name=values["name"],
            overrides=values["overrides"],
        )
        body = s.RunDetailSerializer(run).data
        return Response(body, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @extend_schema(
        request=s.CancelSerializer,
        responses={200: s.RunDetailSerializer, 409: OpenApiResponse(description="The run already ended")},
    )
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        run = self.get_object()
        _require(
            perms.can_edit(request.user, run.experiment.team_id, self.token),
            "viewers cannot cancel runs",
        )
        data = s.CancelSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        run = handler.cancel_run(request.user, run, data.validated_data["reason"] or None)
        return Response(s.RunDetailSerializer(run).data)

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "timeout",
                OpenApiTypes.FLOAT,
                description=f"Seconds to wait at most (default {WAIT_DEFAULT_S:g}, max {WAIT_MAX_S:g})",
            )
        ],
        responses={200: s.RunDetailSerializer, 400: ErrorsSerializer},
    )
    @action(detail=True, methods=["get"])
    def wait(self, request, pk=None):
        """Long-poll: answers when the run reaches a terminal state or the timeout passes (check `terminal`)."""
        # The run as it is now. The waiting happens around this, in _long_poll (see as_view), where no
        # thread and no database connection is held.
        _parse_timeout(request.query_params.get("timeout"))
        return Response(s.RunDetailSerializer(self.get_object()).data)

    @classmethod
    def as_view(cls, actions=None, **initkwargs):
        view = super().as_view(actions, **initkwargs)
        return _long_poll(view) if actions is not None and actions.get("get") == "wait" else view


def _answer_now(view, request, kwargs):
    """The DRF answer of ``view``, rendered; the request's database connection then goes back to the pool."""
    try:
        response = view(request, **kwargs)
        response.render()
        return response
    finally:
        if not connection.in_atomic_block:  # (inside a test's transaction there is nothing to hand back)
            connection.close()


def _long_poll(view):
    """``wait`` as an async view: DRF answers (authentication, team scope, timeout check, the reply) before
    and after the wait, each time in a thread that hands its database connection back; in between
    jobs.longpoll waits for the run's end on the channel layer, holding no connection and no thread."""

    async def wait_view(request, **kwargs):
        started = time.monotonic()
        response = await sync_to_async(_answer_now)(view, request, kwargs)
        if response.status_code != 200 or request.method not in ("GET", "HEAD") or response.data["terminal"]:
            return response
        remaining = _parse_timeout(request.GET.get("timeout")) - (time.monotonic() - started)
        if remaining <= 0:
            return response
        await longpoll.wait_until_ended(int(kwargs["pk"]), remaining)
        return await sync_to_async(_answer_now)(view, request, kwargs)  # checks the caller's access again

    # What DRF, drf-spectacular and CsrfViewMiddleware read off a view function.
    for name in ("cls", "initkwargs", "actions", "csrf_exempt", "__doc__"):
        if hasattr(view, name):
            setattr(wait_view, name, getattr(view, name))
    return wait_view


# --- quotas ---------------------------------------------------------------------------------------------


class QuotaViewSet(
    JobsAPIViewMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.UpdateModelMixin,
    viewsets.GenericViewSet,
):
    """Quotas. Members read their teams' quotas; platform staff (signed in, not by token) see,
    create and change every quota (audited).

    Team admins may not: teams share a group's devices, so a team raising its own
    device cap or priority would take devices from the others.
    Lowering a limit below current use stops nothing: new admissions wait.
    """

    serializer_class = s.QuotaSerializer

    def _is_staff(self) -> bool:
        return perms.can_manage_groups(self.request.user, self.token)

    def get_queryset(self):
        qs = Quota.objects.all() if self._is_staff() else Quota.objects.filter(team__in=self.team_scope())
        return qs.select_related("team", "group").order_by("team_id", "group_id", "name")

    @extend_schema(
        request=s.QuotaCreateSerializer, responses={201: s.QuotaSerializer, 400: ErrorsSerializer, 403: None}
    )
    def create(self, request, *args, **kwargs):
        _require(self._is_staff(), QUOTA_STAFF_ONLY)
        data = s.QuotaCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = dict(data.validated_data)
        team_id, group_id = values.pop("team"), values.pop("group")
        team = Team.objects.filter(pk=team_id).first()
        if team is None:
            raise handler.InvalidInput.one("team", f"no team {team_id}")
        group = ResourceGroup.objects.filter(pk=group_id).first()
        if group is None:
            raise handler.InvalidInput.one("group", f"no resource group {group_id}")
        if not group.teams.filter(pk=team.pk).exists():
            raise handler.InvalidInput.one("group", f"resource group {group.name} is not granted to team {team.name}")
        quota = handler.create_quota(request.user, team, group, values.pop("name"), **values)
        return Response(s.QuotaSerializer(quota).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        request=s.QuotaUpdateSerializer, responses={200: s.QuotaSerializer, 400: ErrorsSerializer, 403: None}
    )
    def update(self, request, *args, **kwargs):
        quota = self.get_object()  # a quota of another team is a 404, as everywhere
        _require(self._is_staff(), QUOTA_STAFF_ONLY)
        data = s.QuotaUpdateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        quota = handler.update_quota(request.user, quota, **data.validated_data)
        return Response(s.QuotaSerializer(quota).data)

    @extend_schema(
        request=s.QuotaUpdateSerializer, responses={200: s.QuotaSerializer, 400: ErrorsSerializer, 403: None}
    )
    def partial_update(self, request, *args, **kwargs):
        return self.update(request, *args, **kwargs)


# --- the run-status fast path (ASGI) ------------------------------------------------------------------
#
# CI polls GET /api/runs/{id}/. Through Django's ASGI handler a read costs about 10 ms of CPU on the
# 2-core dev machine, most of it not the read: each of the seven middlewares' hooks runs in its own
# thread hop (about 0.25 ms each), plus the request signals and DRF's dispatch. This wrapper answers the
# plain case — a GET with an API token, no query string, JSON accepted — itself: one hop to a thread, the
# same token check and the same run query, and the bytes and headers Django and DRF would send (tested
# side by side in tests/api/test_api_runs.py). Anything else, and every answer but a 200 (bad token,
# another team's run, a disallowed host), goes to Django, which answers as always.

_STATUS_PATH = re.compile(r"/api/runs/([0-9]+)/")
_JSON_ACCEPTS = (None, b"*/*", b"application/json")
# The middleware whose effects the fast path reproduces (host check and headers). Any other list turns it
# off: a middleware added later (rate limits, logging, ...) must see every request.
FAST_PATH_MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "rlplatform.security_headers.ContentSecurityPolicyMiddleware",
    # Nothing to refuse on the fast path's requests: a GET with no query string and no body.
    "rlplatform.input_boundary.InputBoundaryMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]


def fast_path_enabled() -> bool:
    """Off unless the settings are ones whose effects on this reply the fast path reproduces."""
    return (
        settings.MIDDLEWARE == FAST_PATH_MIDDLEWARE
        and not settings.SECURE_SSL_REDIRECT  # TLS set-ups redirect and add HSTS: Django does that
        and not settings.SECURE_HSTS_SECONDS
        and not settings.USE_X_FORWARDED_HOST
        and not settings.USE_X_FORWARDED_PORT
        and not settings.PREPEND_WWW
        and not settings.DISALLOWED_USER_AGENTS
        and settings.X_FRAME_OPTIONS == "DENY"
        and "DEFAULT_RENDERER_CLASSES" not in settings.REST_FRAMEWORK
    )


def _security_headers() -> list[tuple[bytes, bytes]]:
    """SecurityMiddleware's and ContentSecurityPolicyMiddleware's headers of a plain-HTTP reply."""
    headers = [(CSP_HEADER.encode(), CONTENT_SECURITY_POLICY.encode())]
    if settings.SECURE_CONTENT_TYPE_NOSNIFF:
        headers.append((b"X-Content-Type-Options", b"nosniff"))
    if settings.SECURE_REFERRER_POLICY:
        policy = settings.SECURE_REFERRER_POLICY
        policy = policy if isinstance(policy, str) else ",".join(policy)
        headers.append((b"Referrer-Policy", policy.encode()))
    if settings.SECURE_CROSS_ORIGIN_OPENER_POLICY:
        headers.append((b"Cross-Origin-Opener-Policy", settings.SECURE_CROSS_ORIGIN_OPENER_POLICY.encode()))
    return headers


def _allowed_host(host: bytes) -> bool:
    allowed = settings.ALLOWED_HOSTS
    if settings.DEBUG and not allowed:
        allowed = [".localhost", "127.0.0.1", "[::1]"]
    domain, _port = split_domain_port(host.decode("latin-1"))
    return bool(domain) and validate_host(domain, allowed)


def _fast_status(run_id: int, host: bytes, credential: str) -> list | None:
    """(headers, body) of the 200 reply, or None: Django answers instead."""
    close_old_connections()  # what Django's request_started / request_finished signals do
    try:
        if not _allowed_host(host):
            return None
        token = authenticate_token(credential)
        if token is None:
            return None
        body = s.run_status_reply(run_id, [token.team_id])
        if body is None:
            return None
        content = JSONRenderer().render(body)
        headers = [
            (b"Content-Type", b"application/json"),
            (b"Vary", b"Accept"),
            (b"Allow", b"GET, HEAD, OPTIONS"),
            (b"X-Frame-Options", b"DENY"),
            (b"Content-Length", str(len(content)).encode()),
            *_security_headers(),
        ]
        return [headers, content]
    finally:
        close_old_connections()


class RunStatusFastPath:
    """ASGI wrapper around the HTTP application: serves the plain run-status read (see above) itself."""

    def __init__(self, app):
        self.app = app
        self.enabled = fast_path_enabled()

    async def __call__(self, scope, receive, send):
        match = None
        if self.enabled and scope["type"] == "http" and scope["method"] == "GET" and not scope.get("query_string"):
            match = _STATUS_PATH.fullmatch(scope["path"]) if not scope.get("root_path") else None
        if match is not None:
            headers = dict(scope["headers"])  # ASGI header names are lower-case
            parts = headers.get(b"authorization", b"").split()
            host = headers.get(b"host")
            if (
                len(parts) == 2
                and parts[0].lower() == b"bearer"
                and host is not None
                and headers.get(b"accept") in _JSON_ACCEPTS
            ):
                try:
                    credential = parts[1].decode()
                except UnicodeError:
                    credential = None
                reply = None
                if credential is not None:
                    reply = await sync_to_async(_fast_status, thread_sensitive=False)(
                        int(match.group(1)), host, credential
                    )
                if reply is not None:
                    await send({"type": "http.response.start", "status": 200, "headers": reply[0]})
                    await send({"type": "http.response.body", "body": reply[1]})
                    return
        await self.app(scope, receive, send)
