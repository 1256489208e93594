"""Authentication and visibility: 401 without credentials, token scope, expiry, revocation, 404 across teams."""

from __future__ import annotations

import datetime
import re

import pytest
from django.utils import timezone

from jobs.models import Run
from rlplatform.models import APIToken, Membership

pytestmark = pytest.mark.django_db

# Every route of the API, with a method it accepts. Ids need not exist: auth comes first.
ENDPOINTS = [
    ("get", "/api/teams/"),
    ("get", "/api/teams/1/"),
    ("get", "/api/resource-groups/"),
    ("post", "/api/resource-groups/"),
    ("get", "/api/resource-groups/1/"),
    ("patch", "/api/resource-groups/1/"),
    ("delete", "/api/resource-groups/1/"),
    ("get", "/api/hosts/"),
    ("post", "/api/hosts/"),
    ("get", "/api/hosts/1/"),
    ("get", "/api/devices/"),
    ("post", "/api/devices/"),
    ("get", "/api/devices/1/"),
    ("get", "/api/tokens/"),
    ("post", "/api/tokens/"),
    ("get", "/api/tokens/1/"),
    ("delete", "/api/tokens/1/"),
    ("post", "/api/tokens/1/revoke/"),
    ("get", "/api/audit/"),
    ("get", "/api/audit/1/"),
    ("get", "/api/experiments/"),
    ("post", "/api/experiments/"),
    ("get", "/api/experiments/1/"),
    ("get", "/api/quotas/"),
    ("post", "/api/quotas/"),
    ("get", "/api/quotas/1/"),
    ("patch", "/api/quotas/1/"),
    ("put", "/api/quotas/1/"),
    ("get", "/api/runs/"),
    ("post", "/api/runs/"),
    ("get", "/api/runs/1/"),
    ("post", "/api/runs/1/cancel/"),
    ("get", "/api/runs/1/wait/"),
    ("post", "/api/runs/plan/"),
    ("get", "/api/runs/1/start-estimate/"),
    # The live UI's routes (jobs.api.live)
    ("get", "/api/runs/1/metrics/"),
    ("get", "/api/runs/1/metrics/keys/"),
    ("get", "/api/runs/1/commands/"),
    ("post", "/api/runs/1/commands/"),
    ("get", "/api/runs/1/checkpoints/"),
    ("get", "/api/runs/1/roles/"),
    ("get", "/api/runs/1/events/"),
    ("get", "/api/runs/1/config-versions/"),
    ("get", "/api/checkpoints/1/"),
    ("delete", "/api/checkpoints/1/"),
    ("get", "/api/checkpoints/1/files/model.safetensors/"),
    ("post", "/api/checkpoints/1/pin/"),
    ("post", "/api/checkpoints/1/unpin/"),
    ("get", "/api/runs/1/alerts/"),
    ("post", "/api/runs/1/alerts/"),
    ("patch", "/api/runs/1/alerts/1/"),
    ("delete", "/api/runs/1/alerts/1/"),
    ("get", "/api/runs/1/alerts/webhook/"),
    ("put", "/api/runs/1/alerts/webhook/"),
    ("get", "/api/runs/1/alerts/deliveries/"),
    ("get", "/api/experiments/1/alerts/webhook/"),
    ("put", "/api/experiments/1/alerts/webhook/"),
]


def test_the_endpoint_list_covers_every_route_of_the_user_api():
    from rlplatform.urls import router

    routes = {str(pattern.pattern) for pattern in router.urls}
    assert len(routes) == 39
    listed = [path.lstrip("/") for _m, path in ENDPOINTS]
    for route in routes:
        regex = re.compile(route.replace("^", "^api/"))
        assert any(regex.match(path) for path in listed), route


@pytest.mark.parametrize("method,path", ENDPOINTS)
def test_every_endpoint_answers_401_without_credentials(api, method, path):
    response = getattr(api, method)(path, {}, format="json")
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == 'Bearer realm="api"'


def test_unknown_and_malformed_tokens_are_401(api, owner, experiment):
    for header in ("Bearer tdm_deadbeef_nope", "Bearer garbage", "Bearer", "Bearer a b"):
        api.credentials(HTTP_AUTHORIZATION=header)
        response = api.get("/api/runs/")
        assert response.status_code == 401, header


def test_expired_token_is_401(api, owner, team_a, experiment, mint_token):
    raw = mint_token(owner, team_a)
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert api.get("/api/runs/").status_code == 200
    APIToken.objects.filter(user=owner).update(expires_at=timezone.now() - datetime.timedelta(seconds=1))
    response = api.get("/api/runs/")
    assert response.status_code == 401
    message = "invalid, expired or revoked token"
    assert response.json() == {"detail": message, "errors": [{"field": "request", "message": message}]}


def test_revoked_token_is_401(api, owner, team_a, experiment, mint_token):
    raw = mint_token(owner, team_a)
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    token_id = APIToken.objects.get(user=owner).pk
    assert api.post(f"/api/tokens/{token_id}/revoke/").status_code == 200
    assert api.get("/api/runs/").status_code == 401


def test_token_of_a_removed_member_is_401(api, editor, team_a, experiment, mint_token):
    raw = mint_token(editor, team_a)
    Membership.objects.filter(user=editor, team=team_a).delete()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert api.get("/api/runs/").status_code == 401


def test_token_acts_only_within_its_team(api, owner, team_a, team_b, experiment, make_experiment, cpu_group, submit):
    # Given the owner is also an editor of team B, with runs in both teams
    Membership.objects.create(team=team_b, user=owner, role="editor")
    exp_b = make_experiment(team_b, cpu_group, "exp-b")
    run_a = submit(experiment)
    run_b = submit(exp_b, actor=owner)
    from rlplatform import tokens

    _t, raw_b = tokens.mint(owner, team_b, "ci-b")
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {raw_b}")
    # When the team-B token reads team A's run, then it does not exist for it
    assert api.get(f"/api/runs/{run_a.pk}/").status_code == 404
    assert api.post(f"/api/runs/{run_a.pk}/cancel/").status_code == 404
    assert [r["id"] for r in api.get("/api/runs/").json()["results"]] == [run_b.pk]
    assert [t["name"] for t in api.get("/api/teams/").json()["results"]] == ["team-b"]
    # and submitting to team A's experiment by name finds no such experiment
    response = api.post("/api/runs/", {"experiment": "exp-a", "spec": "name: x\n"}, format="json")
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "experiment"
    run_a.refresh_from_db()
    assert run_a.state == "ADMITTED"
    # A session login of the same user sees both
    api.credentials()
    api.force_login(owner)
    assert {r["id"] for r in api.get("/api/runs/").json()["results"]} == {run_a.pk, run_b.pk}


def test_session_login_works_for_reads(api, viewer, experiment, submit):
    run = submit(experiment)
    api.force_login(viewer)
    response = api.get(f"/api/runs/{run.pk}/")
    assert response.status_code == 200
    assert response.json()["id"] == run.pk


def test_outsider_gets_404_for_every_team_a_object_and_nothing_changes(
    as_user, outsider, team_b, experiment, submit, owner
):
    run = submit(experiment)
    quota = experiment.quota
    before = (run.state, quota.max_devices, Run.objects.count())
    client = as_user(outsider, team_b)
    assert client.get(f"/api/runs/{run.pk}/").status_code == 404
    assert client.get(f"/api/runs/{run.pk}/wait/?timeout=0").status_code == 404
    assert client.post(f"/api/runs/{run.pk}/cancel/").status_code == 404
    assert client.get(f"/api/experiments/{experiment.pk}/").status_code == 404
    assert client.get(f"/api/quotas/{quota.pk}/").status_code == 404
    assert client.patch(f"/api/quotas/{quota.pk}/", {"max_devices": 1}, format="json").status_code == 404
    assert client.get("/api/runs/").json()["count"] == 0
    assert client.get("/api/experiments/").json()["count"] == 0
    run.refresh_from_db()
    quota.refresh_from_db()
    assert (run.state, quota.max_devices, Run.objects.count()) == before
