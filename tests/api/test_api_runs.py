"""Runs and experiments over the REST API: submit, idempotency, bad input, roles, cancel, list, wait."""

from __future__ import annotations

import pytest

from jobs import handler
from jobs.models import Allocation, Experiment, Run
from jobs.states import RunState
from rlplatform.models import AuditLog, Quota

pytestmark = pytest.mark.django_db

SPEC = "name: tiny\nresources:\n  device: cpu\n  trainer_devices: 2\n"


def _nothing_written():
    return Run.objects.count() == 0 and Allocation.objects.count() == 0


def _errors(response):
    return [(e["field"], e["message"]) for e in response.json()["errors"]]


# --- submit ----------------------------------------------------------------------------------------


def test_submit_creates_and_admits_a_run(as_user, editor, team_a, experiment):
    client = as_user(editor, team_a)
    response = client.post("/api/runs/", {"experiment": "exp-a", "spec": SPEC, "submission_id": "ci-1"}, format="json")
    assert response.status_code == 201
    body = response.json()
    run = Run.objects.get()
    assert body["id"] == run.pk
    assert (body["state"], body["reason"], body["terminal"], body["queue_position"]) == ("ADMITTED", "", False, None)
    assert (body["experiment"], body["experiment_name"], body["team"]) == (experiment.pk, "exp-a", team_a.pk)
    assert (body["submission_id"], body["devices_requested"], body["created_by"]) == ("ci-1", 2, "editor")
    assert body["spec"] == SPEC
    assert body["resolved_spec"]["resources"]["trainer_devices"] == 2
    assert sorted(body["devices"]) == ["cpu-local-h1:0", "cpu-local-h1:1"]


def test_submit_accepts_experiment_id_and_a_spec_object(as_user, editor, team_a, experiment):
    client = as_user(editor, team_a)
    spec = {"name": "obj", "resources": {"device": "cpu", "trainer_devices": 1}}
    response = client.post("/api/runs/", {"experiment": str(experiment.pk), "spec": spec}, format="json")
    assert response.status_code == 201
    assert (response.json()["name"], response.json()["devices_requested"]) == ("obj", 1)


def test_resubmit_with_same_submission_id_returns_the_same_run(as_user, editor, team_a, experiment):
    client = as_user(editor, team_a)
    body = {"experiment": "exp-a", "spec": SPEC, "submission_id": "pipeline-77"}
    first = client.post("/api/runs/", body, format="json")
    second = client.post("/api/runs/", body, format="json")
    assert (first.status_code, second.status_code) == (201, 200)
    assert first.json()["id"] == second.json()["id"]
    assert Run.objects.count() == 1


def test_same_submission_id_with_another_spec_is_409_and_writes_nothing(as_user, editor, team_a, experiment):
    client = as_user(editor, team_a)
    client.post("/api/runs/", {"experiment": "exp-a", "spec": SPEC, "submission_id": "x1"}, format="json")
    other = SPEC.replace("trainer_devices: 2", "trainer_devices: 3")
    response = client.post("/api/runs/", {"experiment": "exp-a", "spec": other, "submission_id": "x1"}, format="json")
    assert response.status_code == 409
    assert "already used" in response.json()["detail"]
    assert Run.objects.count() == 1


@pytest.mark.parametrize(
    "body,expected",
    [
        (
            {"spec": "resources: [unclosed"},
            [("spec", "malformed YAML at line 1, column 21: expected ',' or ']', but got '<stream end>'")],
        ),
        ({"spec": "resources:\n  trainer_devics: 2\n"}, [("resources.trainer_devics", "unknown field")]),
        (
            {"spec": "resources:\n  trainer_devices: lots\n"},
            [
                (
                    "resources.trainer_devices",
                    "Input should be a valid integer",
                )
            ],
        ),
        (
            {"spec": "resources:\n  trainer_devices: -1\n"},
            [("resources.trainer_devices", "Input should be greater than or equal to 1")],
        ),
        (
            {"spec": "resources:\n  trainer_devices: 100000\n"},
            [("resources.trainer_devices", "Input should be less than or equal to 4096")],
        ),
        (
            {"spec": "resources:\n  trainer_devices: 9\n"},
            [("resources", "request exceeds the whole group: needs 9 devices, group cpu-local has 8")],
        ),
        ({"spec": "pipeline:\n  mode: turbo\n"}, [("pipeline.mode", "Input should be 'sync', 'async' or 'colocated'")]),
        ({"experiment": "no-such-exp"}, [("experiment", "no experiment 'no-such-exp' in your teams")]),
        ({"submision_id": "typo"}, [("submision_id", "unknown field")]),
        ({"priority": "high"}, [("priority", "A valid integer is required.")]),
        ({"priority": 5000}, [("priority", "must be an integer from -1000 to 1000")]),
        (
            {"submission_id": "has space"},
            [
                (
                    "submission_id",
                    "1-128 characters: letters, digits and . _ : @ / + - (first alphanumeric)",
                )
            ],
        ),
        ({"spec": None}, [("spec", "This field may not be null.")]),
        ({"experiment": None}, [("experiment", "This field may not be null.")]),
    ],
)
def test_bad_submit_is_400_naming_the_field_and_writes_nothing(as_user, editor, team_a, experiment, body, expected):
    client = as_user(editor, team_a)
    request = {"experiment": "exp-a", "spec": SPEC, **body}
    response = client.post("/api/runs/", request, format="json")
    assert response.status_code == 400
    assert _errors(response) == expected
    assert _nothing_written()


def test_missing_fields_are_named(as_user, editor, team_a, experiment):
    response = as_user(editor, team_a).post("/api/runs/", {}, format="json")
    assert response.status_code == 400
    assert _errors(response) == [("experiment", "This field is required."), ("spec", "This field is required.")]
    assert _nothing_written()


def test_viewer_cannot_submit_or_cancel(as_user, viewer, team_a, experiment, submit):
    run = submit(experiment)
    client = as_user(viewer, team_a)
    response = client.post("/api/runs/", {"experiment": "exp-a", "spec": SPEC}, format="json")
    assert response.status_code == 403
    message = "viewers of team team-a cannot submit runs"
    assert response.json() == {"detail": message, "errors": [{"field": "request", "message": message}]}
    assert client.post(f"/api/runs/{run.pk}/cancel/").status_code == 403
    run.refresh_from_db()
    assert run.state == RunState.ADMITTED
    assert Run.objects.count() == 1
    assert not AuditLog.objects.filter(action="run.cancel").exists()
    # but it reads
    assert client.get(f"/api/runs/{run.pk}/").json()["state"] == "ADMITTED"


# --- cancel ------------------------------------------------------------------------------------------


def test_cancel_frees_devices_audits_and_a_second_cancel_is_409(as_user, editor, team_a, experiment, submit):
    run = submit(experiment, 2)
    client = as_user(editor, team_a)
    response = client.post(f"/api/runs/{run.pk}/cancel/", {"reason": "wrong lr"}, format="json")
    assert response.status_code == 200
    assert (response.json()["state"], response.json()["reason"], response.json()["terminal"]) == (
        "CANCELLED",
        "wrong lr",
        True,
    )
    assert Allocation.objects.active().count() == 0
    entry = AuditLog.objects.get(action="run.cancel")
    assert (entry.actor, entry.target_id, entry.before, entry.after) == (
        editor,
        str(run.pk),
        {"state": "ADMITTED"},
        {"state": "CANCELLED", "reason": "wrong lr"},
    )
    again = client.post(f"/api/runs/{run.pk}/cancel/")
    assert again.status_code == 409
    message = f"run {run.pk} cannot move from CANCELLED to CANCELLED"
    assert again.json() == {"detail": message, "errors": [{"field": "request", "message": message}]}
    assert AuditLog.objects.filter(action="run.cancel").count() == 1


# --- list, filters, pagination, queue ---------------------------------------------------------------------


def test_list_filters_by_state_and_experiment_and_paginates(
    as_user, owner, team_a, experiment, make_experiment, cpu_group, submit
):
    other = make_experiment(team_a, cpu_group, "exp-other")
    admitted = [submit(experiment, 2) for _ in range(4)]  # 8 devices: the group is full
    queued = submit(experiment, 1)
    elsewhere = submit(other, 1)
    client = as_user(owner, team_a)

    page = client.get("/api/runs/?state=QUEUED").json()
    assert [r["id"] for r in page["results"]] == [elsewhere.pk, queued.pk]
    page = client.get("/api/runs/?state=queued&experiment=exp-a").json()
    assert [r["id"] for r in page["results"]] == [queued.pk]
    page = client.get(f"/api/runs/?experiment={other.pk}").json()
    assert [r["id"] for r in page["results"]] == [elsewhere.pk]

    first = client.get("/api/runs/?experiment=exp-a&page_size=2").json()
    assert first["count"] == 5
    assert [r["id"] for r in first["results"]] == [queued.pk, admitted[3].pk]
    assert first["next"].endswith("page=2&page_size=2") or "page=2" in first["next"]
    third = client.get("/api/runs/?experiment=exp-a&page_size=2&page=3").json()
    assert [r["id"] for r in third["results"]] == [admitted[0].pk]
    assert third["next"] is None

    bad = client.get("/api/runs/?state=SLEEPING")
    assert bad.status_code == 400
    assert _errors(bad)[0][0] == "state"


def test_queued_run_shows_position_and_reason(as_user, owner, team_a, experiment, submit):
    for _ in range(4):
        submit(experiment, 2)
    first = submit(experiment, 1)
    second = submit(experiment, 1)
    client = as_user(owner, team_a)
    body = client.get(f"/api/runs/{second.pk}/").json()
    first.refresh_from_db()
    assert (body["state"], body["queue_position"]) == ("QUEUED", 2)
    assert body["reason"] == Run.objects.get(pk=second.pk).reason
    assert body["reason"] != ""
    assert client.get(f"/api/runs/{first.pk}/").json()["queue_position"] == 1


def test_run_status_by_token_costs_two_queries_three_when_it_holds_devices_or_waits(
    as_user, owner, team_a, experiment, submit, django_assert_max_num_queries
):
    # CI polls this endpoint: one query authenticates (token, user, team, membership), one reads
    # the run with its experiment, creator and allocations; a queued run reads its place (derived, not stored).
    held = submit(experiment, 2)
    for _ in range(3):
        submit(experiment, 2)
    waiting = submit(experiment, 1)
    client = as_user(owner, team_a)
    client.get(f"/api/runs/{waiting.pk}/")  # first use writes last_used_at (at most once a minute)
    with django_assert_max_num_queries(3):
        body = client.get(f"/api/runs/{waiting.pk}/").json()
    assert (body["id"], body["state"], body["queue_position"], body["experiment_name"], body["created_by"]) == (
        waiting.pk,
        "QUEUED",
        1,
        "exp-a",
        "owner",
    )
    assert body["devices"] == []
    with django_assert_max_num_queries(3):
        body = client.get(f"/api/runs/{held.pk}/").json()
    assert (body["state"], body["devices"]) == ("ADMITTED", ["cpu-local-h1:0", "cpu-local-h1:1"])


def test_every_list_is_paginated(as_user, owner, team_a, experiment, submit):
    submit(experiment)
    client = as_user(owner, team_a)
    for path in (
        "/api/teams/",
        "/api/resource-groups/",
        "/api/hosts/",
        "/api/devices/",
        "/api/tokens/",
        "/api/audit/",
        "/api/experiments/",
        "/api/quotas/",
        "/api/runs/",
    ):
        body = client.get(path + "?page_size=1").json()
        assert set(body) == {"count", "next", "previous", "results"}, path
        assert len(body["results"]) <= 1, path


# --- wait --------------------------------------------------------------------------------------------


def test_wait_returns_at_once_for_a_terminal_run(as_user, owner, team_a, experiment, submit):
    run = submit(experiment)
    handler.finish_run(run, RunState.FAILED, "trainer exited with code 1")
    body = as_user(owner, team_a).get(f"/api/runs/{run.pk}/wait/?timeout=300").json()
    assert (body["state"], body["terminal"], body["reason"]) == ("FAILED", True, "trainer exited with code 1")


def test_wait_returns_when_the_timeout_passes(as_user, owner, team_a, experiment, submit):
    run = submit(experiment)
    body = as_user(owner, team_a).get(f"/api/runs/{run.pk}/wait/?timeout=0.2").json()
    assert (body["id"], body["state"], body["terminal"]) == (run.pk, "ADMITTED", False)


@pytest.mark.parametrize(
    "timeout,message",
    [
        ("soon", "must be a number of seconds"),
        ("301", "must be between 0 and 300 seconds"),
        ("-1", "must be between 0 and 300 seconds"),
    ],
)
def test_wait_rejects_bad_timeouts(as_user, owner, team_a, experiment, submit, timeout, message):
    run = submit(experiment)
    response = as_user(owner, team_a).get(f"/api/runs/{run.pk}/wait/?timeout={timeout}")
    assert response.status_code == 400
    assert _errors(response) == [("timeout", message)]


# --- experiments ----------------------------------------------------------------------------------------


def test_editor_creates_an_experiment_with_its_own_quota(as_user, editor, team_a, cpu_group):
    response = as_user(editor, team_a).post(
        "/api/experiments/", {"name": "grpo-sweep", "group": "cpu-local"}, format="json"
    )
    assert response.status_code == 201
    exp = Experiment.objects.get(name="grpo-sweep")
    assert (response.json()["id"], exp.team, exp.group, exp.quota.name) == (exp.pk, team_a, cpu_group, "grpo-sweep")


@pytest.mark.parametrize(
    "body,expected",
    [
        ({"name": "exp-a", "group": "cpu-local"}, [("name", "team team-a already has an experiment 'exp-a'")]),
        ({"name": "bad name!", "group": "cpu-local"}, [("name", "1-100 letters, digits, '.', '_' or '-'")]),
        (
            {"name": "new", "group": "no-such-group"},
            [("group", "no resource group 'no-such-group' available to your teams")],
        ),
        ({"name": "new", "group": "cpu-local", "quota": 999999}, [("quota", "team team-a has no quota 999999")]),
        ({"group": "cpu-local"}, [("name", "This field is required.")]),
    ],
)
def test_bad_experiment_input_is_400_and_writes_nothing(as_user, editor, team_a, experiment, body, expected):
    before = (Experiment.objects.count(), Quota.objects.count())
    response = as_user(editor, team_a).post("/api/experiments/", body, format="json")
    assert response.status_code == 400
    assert _errors(response) == expected
    assert (Experiment.objects.count(), Quota.objects.count()) == before


def test_viewer_cannot_create_experiments(as_user, viewer, team_a, cpu_group):
    response = as_user(viewer, team_a).post("/api/experiments/", {"name": "n", "group": "cpu-local"}, format="json")
    assert response.status_code == 403
    assert Experiment.objects.count() == 0


def test_wait_without_the_trailing_slash_redirects_keeping_the_timeout(as_user, owner, team_a, experiment, submit):
    run = submit(experiment)
    response = as_user(owner, team_a).get(f"/api/runs/{run.pk}/wait?timeout=0")
    assert (response.status_code, response["Location"]) == (301, f"/api/runs/{run.pk}/wait/?timeout=0")


# --- the lean run-status read ------------------------------------------------------------------------


def _serializer_reply(run):
    """What RunDetailSerializer renders for ``run``: the reference the status read must equal."""
    import json

    from rest_framework.renderers import JSONRenderer

    from jobs.api.serializers import RunDetailSerializer

    run = Run.objects.select_related("experiment", "created_by").get(pk=run.pk)
    return json.loads(JSONRenderer().render(RunDetailSerializer(run).data))


def test_run_status_equals_the_detail_serializer_in_every_kind_of_state(
    as_user, owner, team_a, experiment, submit, django_assert_max_num_queries
):
    held = submit(experiment, 2, priority=7)  # admitted: holds two devices
    for _ in range(3):
        submit(experiment, 2)
    queued = submit(experiment, 1, submission_id="ci-queued")
    ended = submit(experiment, 1)  # queued behind, then cancelled: terminal
    handler.cancel_run(owner, ended, "done with it")
    Run.objects.filter(pk=ended.pk).update(created_by=None)  # its creator's account was deleted
    Run.objects.filter(pk=held.pk).update(parent_checkpoint="/ckpt/step-10")
    client = as_user(owner, team_a)
    client.get(f"/api/runs/{held.pk}/")  # first use writes last_used_at (at most once a minute)
    for run, state, queries in ((held, "ADMITTED", 2), (queued, "QUEUED", 3), (ended, "CANCELLED", 2)):
        with django_assert_max_num_queries(queries):  # a queued run also reads its place in the queue
            response = client.get(f"/api/runs/{run.pk}/")
        assert response.status_code == 200
        body = response.json()
        assert body["state"] == state
        expected = _serializer_reply(run)
        assert body == expected
        assert list(body) == list(expected)  # same key order too
    assert client.get(f"/api/runs/{held.pk}/").json()["devices"] == ["cpu-local-h1:0", "cpu-local-h1:1"]
    assert client.get(f"/api/runs/{ended.pk}/").json()["created_by"] is None


def test_run_status_by_session_login_is_the_same_reply(api, owner, experiment, submit):
    run = submit(experiment, 2)
    api.force_login(owner)
    response = api.get(f"/api/runs/{run.pk}/")
    assert response.status_code == 200
    assert response.json() == _serializer_reply(run)


@pytest.mark.parametrize("path", ["{pk}", "{missing}", "abc"])
def test_run_status_of_another_team_a_missing_or_a_malformed_id_is_404(
    api, as_user, outsider, team_b, experiment, submit, path
):
    run = submit(experiment, 1)
    before = _serializer_reply(run)
    url = f"/api/runs/{path.format(pk=run.pk, missing=run.pk + 1000)}/"
    by_token = as_user(outsider, team_b).get(url)
    not_found = {"detail": "Not found.", "errors": [{"field": "request", "message": "Not found."}]}
    assert (by_token.status_code, by_token.json()) == (404, not_found)
    api.force_login(outsider)
    assert api.get(url).status_code == 404
    assert _serializer_reply(run) == before  # nothing changed


def test_run_status_without_credentials_is_401(api, experiment, submit):
    run = submit(experiment, 1)
    assert api.get(f"/api/runs/{run.pk}/").status_code == 401


# --- the token check of the hot path agrees with rlplatform.tokens ---------------------------------------


def _token_cases(owner, editor, superuser, team_a, mint_token):
    """(name, raw token) for every kind of token the check must tell apart; applies the changes it names."""
    import datetime

    from django.utils import timezone

    from rlplatform import tokens
    from rlplatform.models import APIToken, Membership

    valid = mint_token(owner, team_a, "valid")
    expired = mint_token(owner, team_a, "expired")
    APIToken.objects.filter(name="expired").update(expires_at=timezone.now() - datetime.timedelta(seconds=1))
    revoked = mint_token(owner, team_a, "revoked")
    tokens.revoke(APIToken.objects.get(name="revoked"))
    removed = mint_token(editor, team_a, "removed")
    Membership.objects.filter(user=editor).delete()
    inactive = mint_token(superuser, team_a, "inactive")  # staff may mint in any team; then deactivated
    staff = mint_token(superuser, team_a, "staff")
    return [
        ("valid", valid),
        ("wrong secret", valid[:-4] + ("AAAA" if not valid.endswith("AAAA") else "BBBB")),
        ("unknown prefix", "tdm_00000000_" + valid.split("_", 2)[2]),
        ("malformed", "tdm_short"),
        ("not ours", "Basic abc"),
        ("expired", expired),
        ("revoked", revoked),
        ("user left the team", removed),
        ("superuser outside the team", staff),
        ("inactive user", inactive),
    ]


def test_hot_path_token_check_agrees_with_rlplatform_tokens(owner, editor, superuser, team_a, mint_token):
    from django.contrib.auth import get_user_model

    from rlplatform import api_auth, tokens
    from rlplatform.models import APIToken

    cases = _token_cases(owner, editor, superuser, team_a, mint_token)
    get_user_model().objects.filter(pk=superuser.pk).update(is_active=True)
    verdicts = {}
    for name, raw in cases:
        if name == "inactive user":
            get_user_model().objects.filter(pk=superuser.pk).update(is_active=False)
        lean, reference = api_auth.authenticate_token(raw), tokens.authenticate_token(raw)
        assert (lean is None) == (reference is None), name
        verdicts[name] = lean is not None
        if lean is not None:
            assert (lean.pk, lean.team_id, lean.user.pk, lean.user.get_username()) == (
                reference.pk,
                reference.team_id,
                reference.user.pk,
                reference.user.get_username(),
            )
    assert verdicts == {
        "valid": True,
        "wrong secret": False,
        "unknown prefix": False,
        "malformed": False,
        "not ours": False,
        "expired": False,
        "revoked": False,
        "user left the team": False,
        "superuser outside the team": True,
        "inactive user": False,
    }
    assert APIToken.objects.get(name="valid").last_used_at is not None  # use is recorded, as by tokens


# --- the run-status fast path (jobs.api.fast_status.RunStatusFastPath) ------------------------------------


async def asgi_get(app, path, headers, query=b""):
    """(status, headers, body) of one GET through the ASGI application ``app``, awaited."""
    import asyncio

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
    }
    pending = [{"type": "http.request", "body": b"", "more_body": False}]
    sent = []

    async def receive():
        if pending:
            return pending.pop()
        await asyncio.Event().wait()  # no disconnect: the request simply stays open

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], sorted((k.lower(), v) for k, v in start["headers"]), body


def _asgi_get(app, path, headers, query=b""):
    """asgi_get from synchronous code."""
    from asgiref.sync import async_to_sync

    return async_to_sync(asgi_get)(app, path, headers, query)


class _CountingApp:
    """The wrapped application, counting what reaches it (what the fast path did not answer)."""

    def __init__(self, app):
        self.app, self.calls = app, 0

    async def __call__(self, scope, receive, send):
        self.calls += 1
        await self.app(scope, receive, send)


@pytest.fixture
def asgi_apps(settings):
    from jobs.api.fast_status import RunStatusFastPath
    from rlplatform.asgi import django_asgi_app

    settings.ALLOWED_HOSTS = ["ci.example.org"]
    inner = _CountingApp(django_asgi_app)
    return RunStatusFastPath(inner), inner, django_asgi_app


@pytest.mark.django_db(transaction=True)  # the fast path reads in a thread of its own: data must be committed
def test_fast_path_answers_exactly_what_django_answers(asgi_apps, owner, team_a, experiment, submit, mint_token):
    fast, inner, django_app = asgi_apps
    assert fast.enabled
    held = submit(experiment, 2)
    raw = mint_token(owner, team_a)
    headers = [(b"host", b"ci.example.org"), (b"authorization", f"Bearer {raw}".encode())]
    for accept in ([], [(b"accept", b"application/json")], [(b"accept", b"*/*")]):
        reply = _asgi_get(fast, f"/api/runs/{held.pk}/", headers + accept)
        assert reply == _asgi_get(django_app, f"/api/runs/{held.pk}/", headers + accept)
    assert inner.calls == 0  # all three answered by the fast path
    status, _headers, body = reply
    assert status == 200
    import json

    assert json.loads(body)["devices"] == ["cpu-local-h1:0", "cpu-local-h1:1"]


@pytest.mark.django_db(transaction=True)
def test_fast_path_hands_everything_else_to_django(
    asgi_apps, owner, outsider, team_a, team_b, experiment, submit, mint_token
):
    fast, inner, django_app = asgi_apps
    run = submit(experiment, 1)
    mine, theirs = mint_token(owner, team_a), mint_token(outsider, team_b)
    host = (b"host", b"ci.example.org")
    path = f"/api/runs/{run.pk}/"
    cases = [
        ("another team's run", path, [host, (b"authorization", f"Bearer {theirs}".encode())], b"", 404),
        ("a bad token", path, [host, (b"authorization", f"Bearer {mine}x".encode())], b"", 401),
        ("no credentials", path, [host], b"", 401),
        (
            "a disallowed host",
            path,
            [(b"host", b"evil.example"), (b"authorization", f"Bearer {mine}".encode())],
            b"",
            400,
        ),
        ("a query string", path, [host, (b"authorization", f"Bearer {mine}".encode())], b"format=json", 200),
        (
            "HTML wanted",
            path,
            [host, (b"authorization", f"Bearer {mine}".encode()), (b"accept", b"text/html")],
            b"",
            200,
        ),
        (
            "another path",
            f"/api/runs/{run.pk}/wait/",
            [host, (b"authorization", f"Bearer {mine}".encode())],
            b"timeout=0",
            200,
        ),
    ]
    for name, url, headers, query, expected in cases:
        before = inner.calls
        reply = _asgi_get(fast, url, headers, query)
        assert reply[0] == expected, name
        assert inner.calls == before + 1, f"{name}: Django must answer"
        if name != "HTML wanted":  # the browsable page sets a fresh CSRF cookie each time
            assert reply == _asgi_get(django_app, url, headers, query), name


@pytest.mark.django_db(transaction=True)
def test_fast_path_is_off_when_a_middleware_it_does_not_mirror_is_installed(asgi_apps, settings):
    from jobs.api.fast_status import RunStatusFastPath
    from rlplatform.middleware_stack import MIDDLEWARE

    assert RunStatusFastPath(asgi_apps[1]).enabled is True  # the installed list is the one it mirrors
    settings.MIDDLEWARE = [*MIDDLEWARE, "django.middleware.gzip.GZipMiddleware"]
    assert RunStatusFastPath(asgi_apps[1]).enabled is False
    settings.MIDDLEWARE = list(MIDDLEWARE)
    assert RunStatusFastPath(asgi_apps[1]).enabled is True
    settings.SECURE_HSTS_SECONDS = 3600
    assert RunStatusFastPath(asgi_apps[1]).enabled is False
