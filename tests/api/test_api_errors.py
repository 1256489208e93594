"""Every error reply of the API has one shape: ``{"errors": [{"field", "message"}]}``.

A 400 names the fields at fault; any other error (401, 403, 404, 405, 409)
names the request as a whole and repeats its message as ``detail``.
"""

from __future__ import annotations

import pytest

from jobs.models import Run
from jobs.states import RunState

SPEC = "name: tiny\nresources:\n  device: cpu\n  trainer_devices: 1\n"


def _refusal(message: str) -> dict:
    return {"detail": message, "errors": [{"field": "request", "message": message}]}


def test_401_without_credentials(api, experiment):
    response = api.get("/api/runs/")
    assert response.status_code == 401
    assert response.json() == _refusal("Authentication credentials were not provided.")
    assert response.headers["WWW-Authenticate"].startswith("Bearer")


def test_401_with_a_wrong_ingest_token(api, run):
    api.credentials(HTTP_AUTHORIZATION="Bearer tdr_deadbeef_wrong")
    response = api.post("/api/ingest/heartbeat", {"role": "trainer-0"}, format="json")
    assert response.status_code == 401
    assert response.json() == _refusal("invalid, expired or revoked run token")


def test_403_for_a_role_that_may_not(as_user, viewer, team_a, experiment):
    response = as_user(viewer, team_a).post("/api/runs/", {"experiment": "exp-a", "spec": SPEC}, format="json")
    assert response.status_code == 403
    assert response.json() == _refusal("viewers of team team-a cannot submit runs")
    assert Run.objects.count() == 0


def test_403_from_the_exception_table(as_user, owner, team_a):
    # rlplatform.api's own 403s go through the table too: a token cannot mint tokens
    response = as_user(owner, team_a).post("/api/tokens/", {"name": "more", "team": team_a.pk}, format="json")
    assert response.status_code == 403
    assert response.json() == _refusal("log in with a session to create tokens")


@pytest.mark.parametrize(
    ("method", "path", "message"),
    [
        ("get", "/api/runs/{pk}/", "Not found."),
        ("post", "/api/runs/{pk}/cancel/", "No Run matches the given query."),  # (DRF's get_object)
        ("get", "/api/experiments/{exp}/", "No Experiment matches the given query."),
        ("post", "/api/runs/{pk}/commands/", "Not found."),
    ],
)
def test_404_for_another_teams_object(as_user, outsider, team_b, experiment, submit, method, path, message):
    run = submit(experiment)
    url = path.format(pk=run.pk, exp=experiment.pk)
    response = getattr(as_user(outsider, team_b), method)(url)
    assert response.status_code == 404
    assert response.json() == _refusal(message)
    run.refresh_from_db()
    assert run.state == RunState.ADMITTED


def test_405_keeps_the_allow_header(as_user, owner, team_a, experiment, submit):
    run = submit(experiment)
    response = as_user(owner, team_a).delete(f"/api/runs/{run.pk}/")
    assert response.status_code == 405
    assert response.json() == _refusal('Method "DELETE" not allowed.')
    assert response.headers["Allow"] == "GET, HEAD, OPTIONS"
    assert Run.objects.filter(pk=run.pk).exists()


def test_409_from_the_jobs_table(as_user, owner, team_a, experiment, submit):
    run = submit(experiment)
    client = as_user(owner, team_a)
    assert client.post(f"/api/runs/{run.pk}/cancel/").status_code == 200
    response = client.post(f"/api/runs/{run.pk}/cancel/")
    assert response.status_code == 409
    assert response.json() == _refusal(f"run {run.pk} cannot move from CANCELLED to CANCELLED")


def test_400_names_the_fields_and_has_no_detail(as_user, owner, team_a, experiment):
    response = as_user(owner, team_a).post("/api/runs/", {"experiment": "exp-a"}, format="json")
    assert response.status_code == 400
    assert response.json() == {"errors": [{"field": "spec", "message": "This field is required."}]}
