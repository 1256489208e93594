"""Django admin for quotas (audited; saving re-runs admission), experiments, runs and allocations.

Runs are read-only here: state changes go through jobs.handler so the state
machine, locks and audit trail apply.
"""

from __future__ import annotations

from django.contrib import admin
from django.db import transaction

from jobs import handler
from jobs.models import Allocation, Experiment, Run
from rlplatform.admin import AuditedAdmin
from rlplatform.models import Quota


@admin.register(Quota)
class QuotaAdmin(AuditedAdmin):
    audited_fields = Quota.AUDITED_FIELDS
    audit_name = "quota"
    list_display = [
        "name",
        "team",
        "group",
        "max_devices",
        "max_concurrent_runs",
        "max_rollout_workers",
        "priority",
        "device_hour_budget",
        "device_hours_used",
    ]
    list_filter = ["group", "team"]
    search_fields = ["name", "team__name"]
    readonly_fields = ["device_seconds_used"]

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        # Raised limits may let queued runs in; lowered ones only hold new admissions back.
        transaction.on_commit(lambda: handler.admit_and_stream(obj.group_id))


@admin.register(Experiment)
class ExperimentAdmin(admin.ModelAdmin):
    list_display = ["name", "team", "group", "quota", "created_at"]
    list_filter = ["team", "group"]
    search_fields = ["name"]


class AllocationInline(admin.TabularInline):
    model = Allocation
    extra = 0
    readonly_fields = ["device", "created_at", "accounted_until", "released_at"]
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = ["pk", "name", "experiment", "state", "priority", "reason", "submitted_at"]
    list_filter = ["state", "experiment__team", "experiment__group"]
    search_fields = ["name", "submission_id"]
    readonly_fields = [f.name for f in Run._meta.fields]
    inlines = [AllocationInline]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
