"""Who may read /metrics: a scrape token (scope metrics:read) only; and a scrape token reads nothing else."""

from __future__ import annotations

import datetime

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from rlplatform import scrape_tokens, tokens
from rlplatform.models import AuditLog, ScrapeToken


def _get(client, authorization: str | None = None):
    headers = {"HTTP_AUTHORIZATION": authorization} if authorization is not None else {}
    return client.get("/metrics", **headers)


def test_without_a_credential_it_is_401_with_a_bearer_challenge(client, db):
    response = _get(client)
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == 'Bearer realm="metrics"'
    assert "scrape token" in response.json()["detail"]


@pytest.mark.parametrize(
    "authorization",
    ["Bearer", "Bearer a b", "Basic dXNlcjpwYXNz", "Bearer tdp_00000000_nope", "Bearer tdr_00000000_x"],
)
def test_a_malformed_or_unknown_credential_is_401(client, db, authorization):
    response = _get(client, authorization)
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == 'Bearer realm="metrics"'


def test_an_api_token_is_authenticated_but_lacks_the_scope_403(client, owner, team_a):
    _token, raw = tokens.mint(owner, team_a, "ci")
    response = _get(client, f"Bearer {raw}")
    assert response.status_code == 403
    assert "metrics:read" in response.json()["detail"]


def test_a_scrape_token_reads_the_exposition(client, make_scrape_token):
    response = _get(client, f"Bearer {make_scrape_token()}")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    assert b"# TYPE tandem_queue_depth gauge" in response.content


def test_openmetrics_when_the_scraper_asks_for_it(client, make_scrape_token):
    response = client.get(
        "/metrics",
        HTTP_AUTHORIZATION=f"Bearer {make_scrape_token()}",
        HTTP_ACCEPT="application/openmetrics-text;version=1.0.0",
    )
    assert response.status_code == 200
    assert response["Content-Type"].startswith("application/openmetrics-text")
    assert response.content.endswith(b"# EOF\n")


def test_a_revoked_or_expired_scrape_token_is_401(client, make_scrape_token):
    revoked, expired = make_scrape_token("revoked"), make_scrape_token("expired")
    assert scrape_tokens.revoke(ScrapeToken.objects.get(name="revoked"))
    ScrapeToken.objects.filter(name="expired").update(expires_at=timezone.now() - datetime.timedelta(seconds=1))
    assert _get(client, f"Bearer {revoked}").status_code == 401
    assert _get(client, f"Bearer {expired}").status_code == 401


def test_a_scrape_token_opens_no_api_endpoint(client, make_scrape_token):
    response = client.get("/api/runs/", HTTP_AUTHORIZATION=f"Bearer {make_scrape_token()}")
    assert response.status_code == 401


def test_a_post_is_refused_405(client, make_scrape_token):
    response = client.post("/metrics", HTTP_AUTHORIZATION=f"Bearer {make_scrape_token()}")
    assert response.status_code == 405


def test_the_command_mints_for_staff_only_and_audits(capsys, make_user, client):
    make_user("plain")
    staff = make_user("ops", is_staff=True)
    with pytest.raises(CommandError, match="not active platform staff"):
        call_command("scrape_token", "mint", "prometheus", "--by", "plain")
    call_command("scrape_token", "mint", "prometheus", "--by", "ops")
    raw = capsys.readouterr().out.strip()
    assert raw.startswith(scrape_tokens.TOKEN_PREFIX)
    assert _get(client, f"Bearer {raw}").status_code == 200
    token = ScrapeToken.objects.get()
    assert token.token_hash != raw and token.created_by == staff  # only the hash is kept
    call_command("scrape_token", "revoke", token.prefix, "--by", "ops")
    assert _get(client, f"Bearer {raw}").status_code == 401
    actions = set(AuditLog.objects.filter(target_id=str(token.pk)).values_list("action", flat=True))
    assert actions == {"scrape_token.create", "scrape_token.revoke"}
