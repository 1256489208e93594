"""Audit rows for every quota, priority, membership and token change and every cancel — admin included."""

import pytest
from django.contrib.admin.sites import site
from django.test import RequestFactory

from jobs import handler
from jobs.states import RunState
from rlplatform import memberships
from rlplatform.models import AuditLog, Membership, Quota

pytestmark = pytest.mark.django_db


def _entries(action):
    return list(AuditLog.objects.filter(action=action).order_by("pk"))


def test_cancel_is_audited_with_before_and_after(experiment, submit, editor, team_a):
    run = submit(experiment, 1)
    handler.cancel_run(editor, run)
    [entry] = _entries("run.cancel")
    assert (entry.actor, entry.actor_name, entry.team, entry.target_type, entry.target_id) == (
        editor,
        "editor",
        team_a,
        "jobs.run",
        str(run.pk),
    )
    assert entry.before == {"state": "ADMITTED"}
    assert entry.after == {"state": "CANCELLED", "reason": "cancelled by editor"}


def test_refused_cancel_writes_no_audit_row(experiment, submit, editor, complete):
    run = complete(submit(experiment, 1))
    with pytest.raises(handler.IllegalTransition):
        handler.cancel_run(editor, run)
    assert _entries("run.cancel") == []
    assert run.state == RunState.COMPLETED


def test_quota_change_is_audited_only_when_something_changed(experiment, owner):
    quota = experiment.quota
    handler.update_quota(owner, quota, max_devices=6, priority=3)
    handler.update_quota(owner, quota, max_devices=6)  # no change: no row
    [entry] = _entries("quota.update")
    assert entry.actor == owner
    assert (entry.before["max_devices"], entry.after["max_devices"]) == (8, 6)
    assert (entry.before["priority"], entry.after["priority"]) == (0, 3)


def test_run_priority_change_is_audited(experiment, submit, owner):
    run = submit(experiment, 1)
    handler.set_priority(owner, run, 7)
    [entry] = _entries("run.priority")
    assert (entry.before, entry.after, entry.target_id) == ({"priority": None}, {"priority": 7}, str(run.pk))


def test_membership_changes_are_audited(owner, make_user, team_a):
    newcomer = make_user("newcomer")
    memberships.set_member(team_a, newcomer, "viewer", actor=owner)
    memberships.set_member(team_a, newcomer, "editor", actor=owner)
    memberships.set_member(team_a, newcomer, "editor", actor=owner)  # unchanged: no row
    memberships.remove_member(team_a, newcomer, actor=owner)
    rows = [
        (e.action, e.before and e.before["role"], e.after and e.after["role"]) for e in AuditLog.objects.order_by("pk")
    ]
    assert rows == [
        ("membership.create", None, "viewer"),
        ("membership.update", "viewer", "editor"),
        ("membership.delete", "editor", None),
    ]
    assert all(e.team == team_a and e.actor == owner for e in AuditLog.objects.all())
    assert not Membership.objects.filter(user=newcomer).exists()


def test_unknown_role_is_refused(owner, make_user, team_a):
    user = make_user("x")
    with pytest.raises(memberships.MembershipError) as info:
        memberships.set_member(team_a, user, "boss", actor=owner)
    assert info.value.field == "role"
    assert not Membership.objects.filter(user=user).exists()
    assert AuditLog.objects.count() == 0


def _admin_request(user):
    request = RequestFactory().post("/admin/")
    request.user = user
    return request


def test_admin_quota_edit_and_delete_are_audited(
    experiment, superuser, team_a, cpu_group, django_capture_on_commit_callbacks
):
    quota_admin = site._registry[Quota]
    quota = Quota.objects.get(pk=experiment.quota.pk)
    quota.max_concurrent_runs = 1
    with django_capture_on_commit_callbacks(execute=True):
        quota_admin.save_model(_admin_request(superuser), quota, form=None, change=True)
    [entry] = _entries("quota.update")
    assert (entry.actor, entry.team) == (superuser, team_a)
    assert (entry.before["max_concurrent_runs"], entry.after["max_concurrent_runs"]) == (4, 1)

    spare = Quota(team=team_a, group=cpu_group, name="spare")
    quota_admin.save_model(_admin_request(superuser), spare, form=None, change=False)
    quota_admin.delete_model(_admin_request(superuser), spare)
    assert [e.action for e in AuditLog.objects.order_by("pk")] == ["quota.update", "quota.create", "quota.delete"]
    assert _entries("quota.delete")[0].before["name"] == "spare"


def test_admin_quota_raise_admits_waiting_runs(experiment, submit, superuser, django_capture_on_commit_callbacks):
    quota = Quota.objects.get(pk=experiment.quota.pk)
    Quota.objects.filter(pk=quota.pk).update(max_concurrent_runs=0)
    run = submit(experiment, 1)
    assert run.state == RunState.QUEUED
    quota.max_concurrent_runs = 1
    with django_capture_on_commit_callbacks(execute=True):
        site._registry[Quota].save_model(_admin_request(superuser), quota, form=None, change=True)
    run.refresh_from_db()
    assert run.state == RunState.ADMITTED


def test_admin_membership_changes_are_audited(superuser, editor, team_a):
    membership_admin = site._registry[Membership]
    membership = Membership.objects.get(user=editor)
    membership.role = "admin"
    membership_admin.save_model(_admin_request(superuser), membership, form=None, change=True)
    membership_admin.delete_queryset(_admin_request(superuser), Membership.objects.filter(pk=membership.pk))
    rows = [(e.action, e.actor, e.before["role"], e.after and e.after["role"]) for e in AuditLog.objects.order_by("pk")]
    assert rows == [
        ("membership.update", superuser, "editor", "admin"),
        ("membership.delete", superuser, "admin", None),
    ]
