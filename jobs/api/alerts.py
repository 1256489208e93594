"""REST for a run's alert rules and webhook (jobs.alerts), under ``/api/runs/{run_id}/alerts/`` (an
experiment's default webhook is jobs.api.views.ExperimentViewSet's ``alerts/webhook/``).

Thin, like jobs.api.live: the run must be one of the caller's teams' (another team's is a 404), writes need
an editor (viewers get 403), bad input is a 400 naming the field (jobs.alerts.rules) and changes nothing.
"""

from __future__ import annotations

from django.db import IntegrityError, transaction
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, inline_serializer
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound
from rest_framework.response import Response

from jobs.alerts import evaluate, rules
from jobs.api.live import RunScopedMixin
from jobs.handler import InvalidInput
from jobs.models import AlertDelivery, AlertRule, AlertWebhook
from rlplatform.api import ErrorsSerializer


class AlertRuleSerializer(serializers.Serializer):
    id = serializers.IntegerField(read_only=True)
    kind = serializers.CharField(help_text="bubble, staleness, no_step, non_finite, throughput or restarts")
    metric = serializers.CharField(required=False, allow_blank=True, help_text="Blank: the kind's own metric")
    threshold = serializers.FloatField(help_text="Its meaning depends on the kind (README Alerts)")
    meaning = serializers.CharField(read_only=True)
    enabled = serializers.BooleanField(required=False)
    firing = serializers.BooleanField(read_only=True)
    value = serializers.FloatField(read_only=True, allow_null=True)
    changed_at = serializers.DateTimeField(read_only=True, allow_null=True)


class WebhookSerializer(serializers.Serializer):
    url = serializers.CharField(
        allow_blank=True, required=False, help_text="The run's own http(s) URL; blank: none (the experiment's default)"
    )
    off = serializers.BooleanField(
        required=False, help_text="true: no webhook at all, not even the experiment's default (url blank)"
    )


class WebhookStateSerializer(serializers.Serializer):
    url = serializers.CharField(allow_blank=True, help_text="The run's own webhook URL; blank: none")
    off = serializers.BooleanField(help_text="The run opted out: no webhook, not even the experiment's default")
    experiment_url = serializers.CharField(allow_blank=True, help_text="The experiment's default; blank: none")
    effective = serializers.CharField(allow_blank=True, help_text="Where its transitions are POSTed; blank: nowhere")


_RULE_ID = [OpenApiParameter("id", int, OpenApiParameter.PATH, description="The rule's id")]
_WRITE_ERRORS = {400: ErrorsSerializer, 403: OpenApiResponse(description="Viewers cannot change alerts")}


_DELIVERIES = inline_serializer(
    name="AlertDelivery",
    fields={
        "id": serializers.IntegerField(),
        "rule": serializers.IntegerField(allow_null=True),
        "url": serializers.CharField(),
        "state": serializers.CharField(),
        "attempts": serializers.IntegerField(),
        "error": serializers.CharField(allow_blank=True, allow_null=True),
        "body": serializers.DictField(),
        "created_at": serializers.DateTimeField(),
        "finished_at": serializers.DateTimeField(allow_null=True),
    },
    many=True,
)


class RunAlertsViewSet(RunScopedMixin, viewsets.ViewSet):
    """A run's alert rules with their state (list, create, change, delete), its webhook, its deliveries."""

    pagination_class = None
    lookup_value_regex = "[0-9]+"

    def _rule(self, run, pk) -> AlertRule:
        rule = AlertRule.objects.filter(run=run, pk=pk if str(pk).isdigit() else 0).first()
        if rule is None:
            raise NotFound("Not found.")
        return rule

    @extend_schema(responses={200: AlertRuleSerializer(many=True)})
    def list(self, request, run_id=None):
        run = self.get_run()
        return Response([rules.rule_body(r) for r in AlertRule.objects.filter(run=run).order_by("pk")])

    @extend_schema(request=AlertRuleSerializer, responses={201: AlertRuleSerializer, **_WRITE_ERRORS})
    def create(self, request, run_id=None):
        run = self.get_run()
        self.require_editor(run.experiment.team_id, "change alerts")
        fields = rules.clean_rule(request.data)
        try:
            with transaction.atomic():
                rule = AlertRule.objects.create(run=run, **fields)
        except IntegrityError:
            raise InvalidInput.one("kind", "the run already has a rule of this kind on this metric") from None
        return Response(rules.rule_body(rule), status=status.HTTP_201_CREATED)

    @extend_schema(
        parameters=_RULE_ID, request=AlertRuleSerializer, responses={200: AlertRuleSerializer, **_WRITE_ERRORS}
    )
    def partial_update(self, request, run_id=None, pk=None):
        run = self.get_run()
        self.require_editor(run.experiment.team_id, "change alerts")
        fields = rules.clean_rule(request.data, self._rule(run, pk))
        try:
            with transaction.atomic():
                rule = AlertRule.objects.select_for_update().get(pk=self._rule(run, pk).pk)
                changed = {k: v for k, v in fields.items() if getattr(rule, k) != v}
                if changed:
                    evaluate.reset(rule, "rule changed: " + ", ".join(sorted(changed)))
                    for key, value in changed.items():
                        setattr(rule, key, value)
                    rule.save()
        except IntegrityError:
            raise InvalidInput.one("metric", "the run already has a rule of this kind on this metric") from None
        return Response(rules.rule_body(rule))

    @extend_schema(
        parameters=_RULE_ID, responses={204: None, 403: OpenApiResponse(description="Viewers cannot change alerts")}
    )
    def destroy(self, request, run_id=None, pk=None):
        run = self.get_run()
        self.require_editor(run.experiment.team_id, "change alerts")
        with transaction.atomic():
            rule = AlertRule.objects.select_for_update().get(pk=self._rule(run, pk).pk)
            evaluate.reset(rule, "rule deleted")
            rule.delete()
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(methods=["GET"], responses={200: WebhookStateSerializer})
    @extend_schema(methods=["PUT"], request=WebhookSerializer, responses={200: WebhookStateSerializer, **_WRITE_ERRORS})
    @action(detail=False, methods=["get", "put"])
    def webhook(self, request, run_id=None):
        """The run's webhook: its own URL, whether it opted out, its experiment's default and the one its
        transitions go to. PUT ``{"url": ...}`` sets its own; ``{"url": ""}`` removes it (the experiment's
        default applies); ``{"off": true}`` opts out (no webhook, not even the default)."""
        run = self.get_run()
        if request.method == "PUT":
            self.require_editor(run.experiment.team_id, "change alerts")
            url, off = rules.clean_run_webhook(request.data)
            if url or off:
                AlertWebhook.objects.update_or_create(run=run, defaults={"url": url, "off": off})
            else:
                AlertWebhook.objects.filter(run=run).delete()
        return Response(rules.webhook_body(run))

    @extend_schema(responses={200: _DELIVERIES})
    @action(detail=False, methods=["get"])
    def deliveries(self, request, run_id=None):
        """The run's newest 100 webhook deliveries: state (pending, delivered, failed), attempts, last error."""
        run = self.get_run()
        rows = AlertDelivery.objects.filter(run=run).order_by("-pk")[:100]
        return Response(
            [
                {
                    "id": d.pk,
                    "rule": d.rule_id,
                    "url": d.url,
                    "state": d.state,
                    "attempts": d.attempts,
                    "error": d.error,
                    "body": d.body,
                    "created_at": d.created_at,
                    "finished_at": d.finished_at,
                }
                for d in rows
            ]
        )
