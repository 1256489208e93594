"""Django admin for teams, memberships, groups, hosts, devices, tokens and the audit log.

Changes of audited models (teams, whose data roots widen what their specs may
read, and memberships here; quotas in jobs/admin.py, since a quota change
re-runs admission) write audit rows through AuditedAdmin.
Tokens are minted through the API (the plaintext must be shown once), so the
admin can only list and revoke them.
"""

from __future__ import annotations

from django.contrib import admin, messages
from django.db import transaction

from rlplatform import audit, tokens
from rlplatform.memberships import AUDITED_FIELDS as MEMBERSHIP_FIELDS
from rlplatform.memberships import notify_access_changed
from rlplatform.models import APIToken, AuditLog, Device, Host, Membership, ResourceGroup, Team


class AuditedAdmin(admin.ModelAdmin):
    """Writes an audit row (before/after of ``audited_fields``) for every save and delete."""

    audited_fields: tuple[str, ...] = ()
    audit_name = ""

    def _action(self, verb: str) -> str:
        return f"{self.audit_name or self.model._meta.model_name}.{verb}"

    def save_model(self, request, obj, form, change):
        with transaction.atomic():
            before = None
            if change:
                old = type(obj).objects.filter(pk=obj.pk).first()
                before = audit.snapshot(old, self.audited_fields) if old else None
            super().save_model(request, obj, form, change)
            after = audit.snapshot(obj, self.audited_fields)
            if before != after:
                audit.record(request.user, self._action("update" if change else "create"), obj, before, after)

    def delete_model(self, request, obj):
        with transaction.atomic():
            audit.record(request.user, self._action("delete"), obj, audit.snapshot(obj, self.audited_fields), None)
            super().delete_model(request, obj)

    def delete_queryset(self, request, queryset):
        with transaction.atomic():
            for obj in queryset:
                audit.record(request.user, self._action("delete"), obj, audit.snapshot(obj, self.audited_fields), None)
            super().delete_queryset(request, queryset)


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]

    # Inline edits bypass ModelAdmin.save_model; keep them read-only so every change goes through MembershipAdmin.
    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Team)
class TeamAdmin(AuditedAdmin):
    # data_roots widens what the team's specs may read (jobs/confinement.py): every change is audited.
    audited_fields = ("name", "description", "data_roots")
    audit_name = "team"
    list_display = ["name", "created_at"]
    fields = ["name", "description", "data_roots"]
    search_fields = ["name"]
    inlines = [MembershipInline]


@admin.register(Membership)
class MembershipAdmin(AuditedAdmin):
    audited_fields = MEMBERSHIP_FIELDS
    audit_name = "membership"
    list_display = ["team", "user", "role", "created_at"]
    list_filter = ["role", "team"]
    search_fields = ["user__username", "team__name"]
    autocomplete_fields = ["user", "team"]

    # Saved here, not through rlplatform.memberships: tell the users' open live-UI sockets to re-check too.
    def save_model(self, request, obj, form, change):
        with transaction.atomic():
            before = Membership.objects.filter(pk=obj.pk).values_list("user_id", flat=True).first() if change else None
            super().save_model(request, obj, form, change)
            for user_id in {before, obj.user_id} - {None}:
                notify_access_changed(user_id)

    def delete_model(self, request, obj):
        with transaction.atomic():
            super().delete_model(request, obj)
            notify_access_changed(obj.user_id)

    def delete_queryset(self, request, queryset):
        with transaction.atomic():
            user_ids = set(queryset.values_list("user_id", flat=True))
            super().delete_queryset(request, queryset)
            for user_id in user_ids:
                notify_access_changed(user_id)


class HostInline(admin.TabularInline):
    model = Host
    extra = 0
    fields = ["name", "address", "status", "labels", "last_heartbeat"]
    readonly_fields = ["last_heartbeat"]


@admin.register(ResourceGroup)
class ResourceGroupAdmin(admin.ModelAdmin):
    list_display = ["name", "kind", "device_model"]
    list_filter = ["kind"]
    search_fields = ["name"]
    filter_horizontal = ["teams"]
    inlines = [HostInline]


class DeviceInline(admin.TabularInline):
    model = Device
    extra = 0


@admin.register(Host)
class HostAdmin(admin.ModelAdmin):
    list_display = ["name", "group", "address", "status", "last_heartbeat"]
    list_filter = ["group", "status"]
    search_fields = ["name", "address"]
    inlines = [DeviceInline]


@admin.register(Device)
class DeviceAdmin(admin.ModelAdmin):
    list_display = ["__str__", "host", "kind", "model", "memory_mb", "healthy"]
    list_filter = ["kind", "healthy", "host__group"]
    search_fields = ["host__name", "model"]


@admin.action(description="Revoke selected tokens")
def revoke_tokens(modeladmin, request, queryset):
    revoked, denied = 0, []
    for token in queryset:
        try:
            revoked += tokens.revoke(token, actor=request.user)
        except tokens.RevokeDenied:  # its owner outranks this admin in the token's team: left as it is
            denied.append(token.prefix)
    modeladmin.message_user(request, f"Revoked {revoked} token(s).")
    if denied:
        modeladmin.message_user(
            request,
            f"Not revoked, their owners outrank you in their teams: {', '.join(denied)}.",
            level=messages.WARNING,
        )


@admin.register(APIToken)
class APITokenAdmin(admin.ModelAdmin):
    list_display = ["name", "prefix", "user", "team", "created_at", "expires_at", "revoked_at", "last_used_at"]
    list_filter = ["team"]
    search_fields = ["name", "prefix", "user__username"]
    readonly_fields = [
        "user",
        "team",
        "name",
        "prefix",
        "token_hash",
        "created_at",
        "expires_at",
        "revoked_at",
        "last_used_at",
    ]
    actions = [revoke_tokens]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False  # revoke instead, so the audit trail keeps the token


@admin.register(AuditLog)
class AuditLogAdmin(admin.ModelAdmin):
    list_display = ["created_at", "actor_name", "action", "target_type", "target_repr", "team"]
    list_filter = ["action", "team"]
    search_fields = ["actor_name", "target_repr", "action"]
    readonly_fields = [f.name for f in AuditLog._meta.fields]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
