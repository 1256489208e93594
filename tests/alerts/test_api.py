"""The alerts REST API: team-scoped rules and webhook, a 400 naming the field that changes nothing, viewers
read only, another team's run is a 404; and the banners on the run and runs-list pages."""

from __future__ import annotations

from jobs.alerts import kinds
from jobs.models import AlertRule, AlertWebhook
from runtime import contract as M
from tests.alerts.helpers import alert_events, batch


def _rules(run):
    return sorted(AlertRule.objects.filter(run=run).values_list("kind", "metric", "threshold", "enabled"))


def test_editors_add_change_and_delete_rules(run, api_as, editor):
    client = api_as(editor)
    reply = client.post(f"/api/runs/{run.pk}/alerts/", {"kind": "bubble", "threshold": 0.4}, format="json")
    assert reply.status_code == 201, reply.content
    rule = reply.json()
    assert (rule["kind"], rule["metric"], rule["threshold"], rule["firing"]) == ("bubble", M.BUBBLE_TRAINER, 0.4, False)
    reply = client.patch(
        f"/api/runs/{run.pk}/alerts/{rule['id']}/", {"threshold": 0.5, "enabled": False}, format="json"
    )
    assert reply.status_code == 200, reply.content
    assert (reply.json()["threshold"], reply.json()["enabled"]) == (0.5, False)
    listed = client.get(f"/api/runs/{run.pk}/alerts/").json()
    assert [r["kind"] for r in listed] == ["non_finite", "no_step", "restarts", "bubble"]
    assert client.delete(f"/api/runs/{run.pk}/alerts/{rule['id']}/").status_code == 204
    assert not AlertRule.objects.filter(pk=rule["id"]).exists()


def test_changing_a_firing_rule_resolves_it(run, api_as, editor, ingest):
    ingest(batch([1], lambda s: {M.LOSS_POLICY: None}))
    rule = AlertRule.objects.get(run=run, kind=kinds.NON_FINITE)
    assert rule.firing
    reply = api_as(editor).patch(f"/api/runs/{run.pk}/alerts/{rule.pk}/", {"enabled": False}, format="json")
    assert reply.status_code == 200 and not reply.json()["firing"]
    assert [p["state"] for _k, p in alert_events(run)] == ["firing", "resolved"]


def _errors(reply):
    assert reply.status_code == 400, reply.content
    return {e["field"] for e in reply.json()["errors"]}


def test_bad_rules_and_webhooks_are_400s_naming_the_field_and_change_nothing(run, api_as, editor):
    client = api_as(editor)
    before = _rules(run)
    url = f"/api/runs/{run.pk}/alerts/"
    assert _errors(client.post(url, {"kind": "bubble", "metric": "no/such", "threshold": 0.5}, format="json")) == {
        "metric"
    }
    assert _errors(client.post(url, {"kind": "bubble", "threshold": "high"}, format="json")) == {"threshold"}
    assert _errors(client.post(url, {"kind": "bubble", "threshold": 7}, format="json")) == {"threshold"}
    assert _errors(client.post(url, {"kind": "staleness", "threshold": 2.5}, format="json")) == {"threshold"}
    assert _errors(client.post(url, {"kind": "volcano", "threshold": 1}, format="json")) == {"kind"}
    assert _errors(client.post(url, {"kind": "no_step", "threshold": 600}, format="json")) == {"kind"}  # has one
    rule = AlertRule.objects.get(run=run, kind=kinds.NO_STEP)
    assert _errors(client.patch(f"{url}{rule.pk}/", {"threshold": None, "enabled": True}, format="json")) == {
        "threshold"
    }
    assert _errors(client.patch(f"{url}{rule.pk}/", {"kind": "bubble"}, format="json")) == {"kind"}
    assert _rules(run) == before
    assert client.put(f"{url}webhook/", {"url": "https://hooks.example.com/x"}, format="json").status_code == 200
    for bad in ("ftp://example.com/x", "not a url", "http://", "javascript:alert(1)", 5):
        assert _errors(client.put(f"{url}webhook/", {"url": bad}, format="json")) == {"url"}, bad
    assert AlertWebhook.objects.get(run=run).url == "https://hooks.example.com/x"
    assert client.get(f"{url}webhook/").json() == {"url": "https://hooks.example.com/x"}
    assert client.put(f"{url}webhook/", {"url": ""}, format="json").json() == {"url": ""}
    assert not AlertWebhook.objects.filter(run=run).exists()


def test_teams_see_only_their_own_runs_alerts_and_viewers_only_read(run, api_as, outsider, viewer):
    url = f"/api/runs/{run.pk}/alerts/"
    rule = AlertRule.objects.filter(run=run).first()
    other = api_as(outsider)
    assert other.get(url).status_code == 404
    assert other.post(url, {"kind": "bubble", "threshold": 0.5}, format="json").status_code == 404
    assert other.patch(f"{url}{rule.pk}/", {"threshold": 9}, format="json").status_code == 404
    assert other.put(f"{url}webhook/", {"url": "https://evil.example.com/"}, format="json").status_code == 404
    reader = api_as(viewer)
    assert reader.get(url).status_code == 200
    assert reader.post(url, {"kind": "bubble", "threshold": 0.5}, format="json").status_code == 403
    assert reader.delete(f"{url}{rule.pk}/").status_code == 403
    assert not AlertWebhook.objects.filter(run=run).exists()
    assert AlertRule.objects.filter(run=run).count() == 3


def test_a_firing_alert_is_a_banner_on_the_run_page_and_the_runs_list(run, ingest, client, owner):
    client.force_login(owner)
    assert 'id="alert-banner" role="alert" hidden' in client.get(f"/runs/{run.pk}/").content.decode()
    ingest(batch([1], lambda s: {M.REWARD_MEAN: None}))
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert 'id="alert-banner" role="alert">' in page and "<code>non_finite</code>" in page
    runs_list = client.get(f"/experiments/{run.experiment_id}/").content.decode()
    assert "Alert firing" in runs_list and f'data-run-id="{run.pk}"' in runs_list
