"""Hardening (issue 13): a Content-Security-Policy on every reply, and login throttling.

Given a user with a known password, when wrong passwords are tried over and over, then logging in is
locked (the right password too) with a message that says so; a policy header is on pages, API replies,
errors, static files and the run-status fast path alike. The browser side of the policy (no violation on
any page) is tests/e2e/test_csp.py.
"""

from __future__ import annotations

import pytest
from django.test import Client

from jobs.api.fast_status import RunStatusFastPath
from rlplatform import login_throttle
from rlplatform.asgi import django_asgi_app
from rlplatform.security_headers import CONTENT_SECURITY_POLICY, CSP_HEADER
from tests.api.test_api_runs import _asgi_get, _CountingApp  # the fast-path tests' ASGI helpers

pytestmark = pytest.mark.django_db

PASSWORD = "editor-pass-123"  # tests/conftest.py make_user
ADDRESSES = [f"198.51.100.{i}" for i in range(1, 80)]  # documentation addresses: no other test uses them


@pytest.fixture(autouse=True)
def _forget_counts(settings):
    """The counts live in the shared Redis cache: leave none behind for other tests."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    yield
    for address in ADDRESSES:
        login_throttle.clear(address=address)
    for username in ("editor", "viewer", "root", "nobody"):
        login_throttle.clear(username=username)


def _login(username: str, password: str, address: str = ADDRESSES[0], path: str = "/login/"):
    client = Client(REMOTE_ADDR=address)
    response = client.post(path, {"username": username, "password": password})
    return response, client


def _form_errors(response) -> list[str]:
    return list(response.context["form"].non_field_errors())


LOCKED = (
    "Too many failed logins for this account or from this address: logging in is locked for 15 minutes."
    " Try again later."
)


def test_sixty_wrong_passwords_then_the_right_one_does_not_log_in(editor, settings):
    assert settings.TANDEM_LOGIN_MAX_FAILURES == 5
    for _ in range(60):
        response, _client = _login("editor", "wrong-password")
        assert response.status_code == 200
    response, client = _login("editor", PASSWORD)
    assert response.status_code == 200  # the form again, not the redirect of a login
    assert _form_errors(response) == [LOCKED]
    assert "_auth_user_id" not in client.session
    assert client.get("/").status_code == 302  # still anonymous


def test_the_limit_is_per_username_from_any_address(editor, viewer):
    for address in ADDRESSES[:4]:
        response, _client = _login("editor", "wrong-password", address)
        assert _form_errors(response)[0].startswith("Please enter a correct username and password")
    response, _client = _login("editor", "wrong-password", ADDRESSES[4])  # the fifth failure locks
    assert _form_errors(response) == [LOCKED]
    response, _client = _login("editor", PASSWORD, ADDRESSES[5])
    assert _form_errors(response) == [LOCKED]
    response, client = _login("viewer", "viewer-pass-123", ADDRESSES[6])  # another account is not locked
    assert response.status_code == 302
    assert client.session["_auth_user_id"] == str(viewer.pk)


def test_the_limit_is_per_address_across_usernames(editor, settings):
    settings.TANDEM_LOGIN_MAX_FAILURES_PER_ADDRESS = 3
    for username in ("nobody", "root", "viewer"):
        _login(username, "wrong-password", ADDRESSES[10])
    response, _client = _login("editor", PASSWORD, ADDRESSES[10])
    assert _form_errors(response) == [LOCKED]
    response, client = _login("editor", PASSWORD, ADDRESSES[11])  # the account itself is not locked
    assert response.status_code == 302


def test_a_success_before_the_limit_clears_the_usernames_count(editor):
    for _ in range(4):
        _login("editor", "wrong-password")
    assert _login("editor", PASSWORD)[0].status_code == 302
    for _ in range(4):
        response, _client = _login("editor", "wrong-password", ADDRESSES[1])
    assert _form_errors(response)[0].startswith("Please enter a correct username and password")
    assert _login("editor", PASSWORD, ADDRESSES[1])[0].status_code == 302


def test_the_admin_login_is_throttled_too(superuser):
    for address in ADDRESSES[20:25]:
        _login("root", "wrong-password", address, "/admin/login/")
    response, client = _login("root", "root-pass-123", ADDRESSES[25], "/admin/login/")
    assert response.status_code == 200
    assert "_auth_user_id" not in client.session


def test_clearing_the_count_unlocks_the_account(editor):
    for _ in range(5):
        _login("editor", "wrong-password", ADDRESSES[30])
    assert login_throttle.is_locked("editor", ADDRESSES[31]) is True
    login_throttle.clear(username="editor")
    assert login_throttle.is_locked("editor", ADDRESSES[31]) is False
    assert _login("editor", PASSWORD, ADDRESSES[31])[0].status_code == 302


# --- Content-Security-Policy ---------------------------------------------------------------------------


def test_every_kind_of_reply_carries_the_policy(client, editor, experiment, submit, mint_token):
    run = submit(experiment)
    anonymous = {
        "/login/": 200,
        "/": 302,
        "/api/runs/": 401,
        "/static/css/tandem.css": 200,
        "/no-such-page/": 404,
        "/api/schema/": 200,
    }
    for path, status in anonymous.items():
        response = client.get(path)
        assert (path, response.status_code, response.get(CSP_HEADER)) == (path, status, CONTENT_SECURITY_POLICY)
    api = Client(HTTP_AUTHORIZATION=f"Bearer {mint_token(editor, experiment.team)}")
    for path, status in {f"/api/runs/{run.pk}/": 200, "/api/runs/999999/": 404, "/api/runs/?page=x": 404}.items():
        response = api.get(path)
        assert (path, response.status_code, response.get(CSP_HEADER)) == (path, status, CONTENT_SECURITY_POLICY)
    client.force_login(editor)
    response = client.get(f"/runs/{run.pk}/")
    assert (response.status_code, response.get(CSP_HEADER)) == (200, CONTENT_SECURITY_POLICY)
    assert "<script>" not in response.content.decode()  # inline scripts would be refused by the policy


@pytest.mark.django_db(transaction=True)  # the fast path reads in a thread of its own
def test_the_run_status_fast_path_sends_the_policy(settings, owner, team_a, experiment, submit, mint_token):
    settings.ALLOWED_HOSTS = ["ci.example.org"]
    inner = _CountingApp(django_asgi_app)
    fast = RunStatusFastPath(inner)
    run = submit(experiment)
    headers = [(b"host", b"ci.example.org"), (b"authorization", f"Bearer {mint_token(owner, team_a)}".encode())]
    status, reply_headers, _body = _asgi_get(fast, f"/api/runs/{run.pk}/", headers)
    assert (status, inner.calls) == (200, 0)  # answered by the fast path itself
    assert (CSP_HEADER.lower().encode(), CONTENT_SECURITY_POLICY.encode()) in reply_headers
