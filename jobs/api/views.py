"""REST views of the jobs app: experiments, runs (submit, list, detail, cancel, wait) and quotas.

Thin by design: parse, check the caller's role, call jobs.lookups (what a
request names) and jobs.handler (what it does), serialise. Domain errors
become HTTP codes through jobs.errors. Querysets are limited to the caller's
teams (the token's team only, for an API token), so another team's object is
a 404. The plain run-status read CI polls is also answered in front of Django,
by jobs.api.fast_status.
"""

from __future__ import annotations

import time

from asgiref.sync import sync_to_async
from django.db import connection
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, PermissionDenied
from rest_framework.response import Response

from capacity import InputError
from jobs import errors, handler, longpoll, lookups, planning, start_estimate
from jobs.alerts import rules as alert_rules
from jobs.api import serializers as s
from jobs.models import Experiment, ExperimentAlertWebhook, Run
from jobs.states import RunState
from rlplatform import permissions as perms
from rlplatform.api import APIViewMixin, ErrorsSerializer
from rlplatform.models import Quota

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
    """Experiments of your teams. Editors and admins create them and set their runs' default alert webhook."""

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
        team = lookups.pick_team(request.user, self.token, values.get("team"))
        _require(
            perms.can_edit(request.user, team, self.token), f"viewers of team {team.name} cannot create experiments"
        )
        group = lookups.visible_group(request.user, self.token, values["group"])
        quota = lookups.team_quota(team, values["quota"]) if values.get("quota") is not None else None
        experiment = handler.create_experiment(
            request.user, team, values["name"], group, quota=quota, description=values["description"]
        )
        return Response(s.ExperimentSerializer(experiment).data, status=status.HTTP_201_CREATED)

    @extend_schema(methods=["GET"], responses={200: s.ExperimentWebhookSerializer})
    @extend_schema(
        methods=["PUT"],
        request=s.ExperimentWebhookSerializer,
        responses={
            200: s.ExperimentWebhookSerializer,
            400: ErrorsSerializer,
            403: OpenApiResponse(description="Viewers cannot change the experiment's webhook"),
        },
    )
    @action(detail=True, methods=["get", "put"], url_path="alerts/webhook")
    def alert_webhook(self, request, pk=None):
        """The default alert webhook of the experiment's runs ("" none): each run without a webhook setting
        of its own (``/api/runs/{id}/alerts/webhook/``) POSTs its alert transitions here. PUT ``{"url": ...}``
        sets it (an http(s) URL); "" removes it."""
        experiment = self.get_object()
        if request.method == "PUT":
            _require(
                perms.can_edit(request.user, experiment.team_id, self.token),
                f"viewers of team {experiment.team.name} cannot change the experiment's webhook",
            )
            url = alert_rules.clean_experiment_webhook(request.data)
            if url:
                ExperimentAlertWebhook.objects.update_or_create(experiment=experiment, defaults={"url": url})
            else:
                ExperimentAlertWebhook.objects.filter(experiment=experiment).delete()
        return Response({"url": alert_rules.experiment_webhook_url(experiment.pk)})


# --- runs ---------------------------------------------------------------------------------------------


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


def _checked_like_submit(experiment: Experiment, values: dict) -> dict:
    """The resolved spec of a plan request, after a submit's checks in the same order (arguments, spec, paths
    the team may read, the group's devices and the quota), with the same errors; nothing is stored."""
    _text, parsed, resolved = handler.check_submission(
        experiment,
        values["spec"],
        submission_id=values["submission_id"],
        priority=values["priority"],
        name=values["name"],
        overrides=values["overrides"],
    )
    handler.check_fits(experiment, parsed)
    return resolved


class RunViewSet(JobsAPIViewMixin, mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    """Runs of your teams' experiments: submit, plan, list, detail, cancel, wait, start estimate."""

    def get_serializer_class(self):
        return s.RunSerializer if self.action == "list" else s.RunDetailSerializer

    def _experiment_to_submit_to(self, values: dict, refusal: str) -> Experiment:
        """The request's experiment, which the user (and token) must be able to edit: viewers get 403."""
        experiment = lookups.resolve_experiment(self.request.user, self.token, values["experiment"], values.get("team"))
        _require(
            perms.can_edit(self.request.user, experiment.team_id, self.token),
            f"viewers of team {experiment.team.name} {refusal}",
        )
        return experiment

    def get_queryset(self):
        qs = Run.objects.filter(experiment__team__in=self.team_scope())
        qs = qs.select_related("experiment", "experiment__group", "created_by")
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
        experiment = self._experiment_to_submit_to(values, "cannot submit runs")
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
        request=s.RunPlanSerializer,
        responses={200: OpenApiResponse(s.PlanSerializer, description="The plan (an estimate); nothing stored")},
    )
    @action(detail=False, methods=["post"])
    def plan(self, request):
        """The predicted samples/s, step time and device-hours of the spec in each mode on the experiment's
        resource group, the recommended mode and lag, and the spec fields whose effect is not modelled.
        Same input and checks as a submit; nothing is stored (docs/control-plane-api.md)."""
        data = s.RunPlanSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        experiment = self._experiment_to_submit_to(values, "cannot submit runs, nor plan them")
        resolved = _checked_like_submit(experiment, values)
        try:
            inputs = planning.PlanInputs.from_request(dict(values.get("inputs") or {}))
        except InputError as exc:
            raise handler.InvalidInput(exc.errors) from None
        group = planning.Group.of(experiment.group, max_devices=experiment.quota.max_devices)
        return Response(planning.plan(resolved, group, inputs))

    @extend_schema(responses={200: s.StartEstimateSerializer})
    @action(detail=True, methods=["get"], url_path="start-estimate")
    def estimated_start(self, request, pk=None):
        """A queued run's estimated start, from the runs ahead of it and those holding the group's devices at
        their predicted speed (an estimate; null, with the reason, when there is none or the run is not queued)."""
        run = self.get_object()
        found = start_estimate.estimate(run, timezone.now())
        return Response({"run": run.pk, "state": run.state, **found.as_dict()})

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
        team, group = lookups.granted_pair(values.pop("team"), values.pop("group"))
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
