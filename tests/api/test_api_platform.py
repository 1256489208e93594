"""Resource groups, hosts, devices, quotas, tokens and the audit log over the REST API."""

from __future__ import annotations

import pytest

from jobs.api.views import QUOTA_STAFF_ONLY
from jobs.models import Run
from jobs.states import RunState
from rlplatform.models import APIToken, AuditLog, Device, Host, Quota, ResourceGroup

pytestmark = pytest.mark.django_db


def _errors(response):
    return [(e["field"], e["message"]) for e in response.json()["errors"]]


# --- resource groups, hosts, devices -------------------------------------------------------------------


def test_member_sees_device_usage_of_granted_groups(as_user, viewer, team_a, experiment, submit, make_group):
    make_group("b-only", hosts=[("h1", 2, None)])  # granted to nobody
    submit(experiment, 3)
    body = as_user(viewer, team_a).get("/api/resource-groups/").json()
    assert [g["name"] for g in body["results"]] == ["cpu-local"]
    group = body["results"][0]
    assert (group["devices_total"], group["devices_healthy"], group["devices_used"], group["devices_free"]) == (
        8,
        8,
        3,
        5,
    )
    devices = as_user(viewer, team_a).get(f"/api/devices/?group={group['id']}&page_size=100").json()
    assert devices["count"] == 8
    assert sum(d["in_use"] for d in devices["results"]) == 3


def test_unhealthy_devices_are_not_free(as_user, viewer, team_a, cpu_group):
    Device.objects.filter(host__name="cpu-local-h2").update(healthy=False)
    group = as_user(viewer, team_a).get(f"/api/resource-groups/{cpu_group.pk}/").json()
    assert (group["devices_total"], group["devices_healthy"], group["devices_free"]) == (8, 4, 4)


def test_groups_not_granted_to_the_team_are_404(as_user, outsider, team_b, make_group, team_a):
    private = make_group("a-private", hosts=[("h1", 2, "s1")], teams=[team_a])
    host = Host.objects.get(group=private)
    client = as_user(outsider, team_b)
    assert client.get(f"/api/resource-groups/{private.pk}/").status_code == 404
    assert client.get(f"/api/hosts/{host.pk}/").status_code == 404
    assert client.get(f"/api/devices/{host.devices.first().pk}/").status_code == 404


def test_team_admin_cannot_change_groups_but_platform_staff_can(as_user, owner, team_a, cpu_group, superuser, api):
    response = as_user(owner, team_a).patch(
        f"/api/resource-groups/{cpu_group.pk}/", {"description": "x"}, format="json"
    )
    assert response.status_code == 403
    cpu_group.refresh_from_db()
    assert cpu_group.description == ""
    api.force_login(superuser)
    response = api.post(
        "/api/resource-groups/",
        {"name": "npu-910b", "kind": "npu", "device_model": "Ascend 910B", "teams": [team_a.pk]},
        format="json",
    )
    assert response.status_code == 201
    group = ResourceGroup.objects.get(name="npu-910b")
    assert list(group.teams.all()) == [team_a]
    response = api.post(
        "/api/hosts/",
        {"group": group.pk, "name": "npu-host-1", "address": "10.0.0.5", "labels": {"rack": "r1", "switch": "s7"}},
        format="json",
    )
    assert response.status_code == 201
    assert response.json()["queue"] == "host.npu-host-1"
    host = Host.objects.get(name="npu-host-1")
    response = api.post(
        "/api/devices/",
        {"host": host.pk, "index": 0, "kind": "npu", "model": "910B", "memory_mb": 65536},
        format="json",
    )
    assert response.status_code == 201
    wrong_kind = api.post("/api/devices/", {"host": host.pk, "index": 1, "kind": "gpu"}, format="json")
    assert wrong_kind.status_code == 400
    assert _errors(wrong_kind) == [("kind", "host npu-host-1 is in a npu group")]
    duplicate = api.post("/api/devices/", {"host": host.pk, "index": 0, "kind": "npu"}, format="json")
    assert duplicate.status_code == 400
    assert duplicate.json()["errors"][0]["field"] == "request"
    assert Device.objects.filter(host=host).count() == 1


def test_bad_host_labels_are_400(api, superuser, cpu_group):
    api.force_login(superuser)
    response = api.post("/api/hosts/", {"group": cpu_group.pk, "name": "h9", "labels": ["rack"]}, format="json")
    assert response.status_code == 400
    assert _errors(response) == [("labels", 'must be an object of string labels, e.g. {"rack": "r1", "switch": "s1"}')]
    assert not Host.objects.filter(name="h9").exists()


def test_deleting_a_group_in_use_is_409(api, superuser, cpu_group, experiment):
    api.force_login(superuser)
    response = api.delete(f"/api/resource-groups/{cpu_group.pk}/")
    assert response.status_code == 409
    assert ResourceGroup.objects.filter(pk=cpu_group.pk).exists()


# --- quotas -------------------------------------------------------------------------------------------------


@pytest.fixture
def staff(make_user):
    """Platform staff (is_staff, not superuser), in no team."""
    return make_user("ops", is_staff=True)


@pytest.fixture
def staff_api(api, staff):
    api.force_login(staff)
    return api


def test_platform_staff_change_a_quota_and_it_is_audited(staff_api, staff, experiment):
    quota = experiment.quota
    response = staff_api.patch(f"/api/quotas/{quota.pk}/", {"max_devices": 4, "priority": 5}, format="json")
    assert response.status_code == 200
    assert (response.json()["max_devices"], response.json()["priority"]) == (4, 5)
    quota.refresh_from_db()
    assert (quota.max_devices, quota.priority) == (4, 5)
    entry = AuditLog.objects.get(action="quota.update")
    assert (entry.actor, entry.target_id) == (staff, str(quota.pk))
    assert (entry.before["max_devices"], entry.after["max_devices"]) == (8, 4)
    assert (entry.before["priority"], entry.after["priority"]) == (0, 5)


def test_lowering_a_quota_below_use_keeps_running_runs_and_queues_new_ones(staff_api, experiment, submit):
    running = submit(experiment, 4)
    assert staff_api.patch(f"/api/quotas/{experiment.quota.pk}/", {"max_devices": 2}, format="json").status_code == 200
    running.refresh_from_db()
    assert running.state == RunState.ADMITTED
    waiting = submit(experiment, 1)
    assert waiting.state == RunState.QUEUED
    assert waiting.reason == "quota: 4/2 devices in use, run needs 1"


@pytest.mark.parametrize(
    "body,expected",
    [
        ({"max_devices": -1}, [("max_devices", "must be an integer from 0 to 1000000")]),
        ({"max_devices": "many"}, [("max_devices", "A valid integer is required.")]),
        ({"device_hour_budget": -5}, [("device_hour_budget", "must be a number of hours >= 0, or null for unlimited")]),
        ({"max_gpus": 3}, [("max_gpus", "unknown field")]),
    ],
)
def test_bad_quota_values_are_400_and_change_nothing(staff_api, experiment, body, expected):
    quota = experiment.quota
    response = staff_api.patch(f"/api/quotas/{quota.pk}/", body, format="json")
    assert response.status_code == 400
    assert _errors(response) == expected
    quota.refresh_from_db()
    assert (quota.max_devices, quota.device_hour_budget) == (8, None)
    assert not AuditLog.objects.filter(action="quota.update").exists()


@pytest.mark.parametrize("persona", ["owner", "editor", "superuser"])
def test_team_members_and_tokens_cannot_change_quotas(request, as_user, team_a, experiment, persona):
    # A team admin raising its own cap or priority would take devices from the teams sharing the
    # group; a superuser's API token acts only inside its team, like every token.
    client = as_user(request.getfixturevalue(persona), team_a)
    response = client.patch(f"/api/quotas/{experiment.quota.pk}/", {"max_devices": 99, "priority": 9}, format="json")
    assert response.status_code == 403
    assert response.json()["detail"] == QUOTA_STAFF_ONLY
    experiment.quota.refresh_from_db()
    assert (experiment.quota.max_devices, experiment.quota.priority) == (8, 0)
    assert not AuditLog.objects.filter(action="quota.update").exists()


def test_team_admin_signed_in_cannot_change_quotas(api, owner, experiment):
    api.force_login(owner)
    response = api.put(f"/api/quotas/{experiment.quota.pk}/", {"max_devices": 99}, format="json")
    assert response.status_code == 403
    experiment.quota.refresh_from_db()
    assert experiment.quota.max_devices == 8
    assert not AuditLog.objects.filter(action="quota.update").exists()


def test_team_admin_still_reads_the_teams_quotas(as_user, owner, team_a, experiment, experiment_b):
    body = as_user(owner, team_a).get("/api/quotas/").json()
    assert [(q["id"], q["max_devices"], q["team_name"]) for q in body["results"]] == [
        (experiment.quota.pk, 8, "team-a")
    ]
    assert as_user(owner, team_a).get(f"/api/quotas/{experiment_b.quota.pk}/").status_code == 404


def test_platform_staff_see_and_create_quotas_of_any_team(staff_api, team_a, cpu_group, experiment, experiment_b):
    listed = staff_api.get("/api/quotas/").json()["results"]
    assert sorted(q["id"] for q in listed) == sorted([experiment.quota.pk, experiment_b.quota.pk])
    response = staff_api.post(
        "/api/quotas/",
        {"name": "shared", "team": team_a.pk, "group": cpu_group.pk, "max_devices": 2, "device_hour_budget": 10},
        format="json",
    )
    assert response.status_code == 201
    quota = Quota.objects.get(name="shared")
    assert (quota.team, quota.group, quota.max_devices, quota.device_hour_budget) == (team_a, cpu_group, 2, 10.0)
    assert AuditLog.objects.filter(action="quota.create", target_id=str(quota.pk)).count() == 1


def test_team_admin_cannot_create_a_quota(as_user, owner, team_a, cpu_group):
    before = Quota.objects.count()
    response = as_user(owner, team_a).post(
        "/api/quotas/", {"name": "mine", "team": team_a.pk, "group": cpu_group.pk, "max_devices": 64}, format="json"
    )
    assert response.status_code == 403
    assert Quota.objects.count() == before
    assert not AuditLog.objects.filter(action="quota.create").exists()


def test_staff_quota_for_an_ungranted_group_or_unknown_team_is_400(staff_api, team_a, make_group):
    lonely = make_group("lonely", hosts=[("h1", 1, None)])  # granted to nobody
    before = Quota.objects.count()
    response = staff_api.post("/api/quotas/", {"name": "q", "team": team_a.pk, "group": lonely.pk}, format="json")
    assert _errors(response) == [("group", "resource group lonely is not granted to team team-a")]
    response = staff_api.post("/api/quotas/", {"name": "q", "team": 999999, "group": lonely.pk}, format="json")
    assert _errors(response) == [("team", "no team 999999")]
    assert Quota.objects.count() == before


# --- tokens -------------------------------------------------------------------------------------------------


def test_session_user_creates_a_token_shown_once_then_uses_it(api, editor, team_a, experiment):
    api.force_login(editor)
    response = api.post("/api/tokens/", {"name": "gitlab-ci", "team": team_a.pk}, format="json")
    assert response.status_code == 201
    raw = response.json()["token"]
    assert raw.startswith("tdm_")
    token = APIToken.objects.get(name="gitlab-ci")
    assert raw not in token.token_hash and token.prefix in raw
    listed = api.get("/api/tokens/").json()["results"]
    assert [t["name"] for t in listed] == ["gitlab-ci"]
    assert "token" not in listed[0]
    api.logout()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert api.get("/api/experiments/").json()["count"] == 1
    assert AuditLog.objects.filter(action="token.create", target_id=str(token.pk)).count() == 1


def test_a_token_cannot_mint_tokens(as_user, editor, team_a):
    response = as_user(editor, team_a).post("/api/tokens/", {"name": "more", "team": team_a.pk}, format="json")
    assert response.status_code == 403
    assert APIToken.objects.count() == 1  # only the one the client authenticates with


def test_token_for_a_team_you_are_not_in_is_400(api, editor, team_b):
    api.force_login(editor)
    response = api.post("/api/tokens/", {"name": "x", "team": team_b.pk}, format="json")
    assert response.status_code == 400
    assert _errors(response) == [("team", "no such team among yours")]
    assert APIToken.objects.count() == 0


def test_revoking_by_delete_keeps_the_row_and_audits(api, editor, team_a, mint_token):
    mint_token(editor, team_a, "old")
    token = APIToken.objects.get(name="old")
    api.force_login(editor)
    response = api.delete(f"/api/tokens/{token.pk}/")
    assert response.status_code == 200
    assert response.json()["valid"] is False
    token.refresh_from_db()
    assert token.revoked_at is not None
    assert AuditLog.objects.filter(action="token.revoke", target_id=str(token.pk)).count() == 1


def test_members_cannot_see_or_revoke_each_others_tokens_but_team_admins_can(
    api, editor, viewer, owner, team_a, mint_token
):
    mint_token(viewer, team_a, "viewer-ci")
    token = APIToken.objects.get(name="viewer-ci")
    api.force_login(editor)
    assert api.get("/api/tokens/").json()["count"] == 0
    assert api.post(f"/api/tokens/{token.pk}/revoke/").status_code == 404
    token.refresh_from_db()
    assert token.revoked_at is None
    api.force_login(owner)
    assert api.post(f"/api/tokens/{token.pk}/revoke/").status_code == 200


# --- audit log ------------------------------------------------------------------------------------------------


def test_audit_log_is_for_team_admins(as_user, owner, viewer, outsider, team_a, team_b, experiment, submit):
    run = submit(experiment)
    as_user(owner, team_a).post(f"/api/runs/{run.pk}/cancel/")
    body = as_user(owner, team_a).get("/api/audit/?action=run.cancel").json()
    assert [(e["action"], e["target_id"], e["actor_name"]) for e in body["results"]] == [
        ("run.cancel", str(run.pk), "owner")
    ]
    assert as_user(viewer, team_a).get("/api/audit/").json()["count"] == 0
    assert as_user(outsider, team_b).get("/api/audit/?action=run.cancel").json()["count"] == 0
    assert Run.objects.get().state == RunState.CANCELLED


def test_token_expiry_in_the_past_is_400(api, editor, team_a):
    api.force_login(editor)
    response = api.post(
        "/api/tokens/", {"name": "x", "team": team_a.pk, "expires_at": "2000-01-01T00:00:00Z"}, format="json"
    )
    assert response.status_code == 400
    assert _errors(response) == [("expires_at", "must be in the future")]
    assert APIToken.objects.count() == 0
