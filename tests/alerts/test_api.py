"""The alerts REST API: team-scoped rules and webhooks (a run's own, an experiment's default), a 400 naming
the field that changes nothing, viewers read only, another team's run or experiment is a 404; and the
banners on the run and runs-list pages, the default webhook's form on the experiment page."""

from __future__ import annotations

from jobs.alerts import kinds
from jobs.models import AlertRule, AlertWebhook, ExperimentAlertWebhook
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
    own = "https://hooks.example.com/x"
    assert client.get(f"{url}webhook/").json() == {"url": own, "off": False, "experiment_url": "", "effective": own}
    for bad, field in (({"off": "yes"}, "off"), ({"off": True, "url": own}, "off"), ({}, "url"), ({"URL": own}, "URL")):
        assert _errors(client.put(f"{url}webhook/", bad, format="json")) == {field}, bad
    assert client.put(f"{url}webhook/", {"url": ""}, format="json").json()["url"] == ""
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


def test_editors_set_an_experiments_default_webhook_and_viewers_only_read_it(experiment, api_as, editor, viewer):
    url = f"/api/experiments/{experiment.pk}/alerts/webhook/"
    client = api_as(editor)
    assert client.get(url).json() == {"url": ""}
    reply = client.put(url, {"url": "https://hooks.example.com/exp"}, format="json")
    assert reply.status_code == 200, reply.content
    assert reply.json() == {"url": "https://hooks.example.com/exp"}
    assert ExperimentAlertWebhook.objects.get(experiment=experiment).url == "https://hooks.example.com/exp"
    reader = api_as(viewer)
    assert reader.get(url).json() == {"url": "https://hooks.example.com/exp"}
    refused = reader.put(url, {"url": "https://evil.example.com/"}, format="json")
    assert refused.status_code == 403 and "viewers" in refused.json()["detail"]
    assert reader.put(url, {"url": ""}, format="json").status_code == 403
    assert client.get(url).json() == {"url": "https://hooks.example.com/exp"}
    assert client.put(url, {"url": ""}, format="json").json() == {"url": ""}
    assert not ExperimentAlertWebhook.objects.filter(experiment=experiment).exists()


def test_a_bad_experiment_webhook_is_a_400_naming_the_field_and_changes_nothing(experiment, api_as, editor):
    url = f"/api/experiments/{experiment.pk}/alerts/webhook/"
    client = api_as(editor)
    assert client.put(url, {"url": "https://hooks.example.com/exp"}, format="json").status_code == 200
    for bad in ("ftp://example.com/x", "not a url", "http://", "javascript:alert(1)", 5, "https://x/" + "a" * 500):
        assert _errors(client.put(url, {"url": bad}, format="json")) == {"url"}, bad
    assert _errors(client.put(url, {}, format="json")) == {"url"}
    assert _errors(client.put(url, {"url": "https://a.example.com/", "off": True}, format="json")) == {"off"}
    assert _errors(client.put(url, ["https://a.example.com/"], format="json")) == {"body"}
    assert client.get(url).json() == {"url": "https://hooks.example.com/exp"}


def test_another_teams_experiment_webhook_is_a_404(experiment, experiment_b, api_as, outsider, editor):
    other = api_as(outsider)
    url = f"/api/experiments/{experiment.pk}/alerts/webhook/"
    assert other.get(url).status_code == 404
    assert other.put(url, {"url": "https://evil.example.com/"}, format="json").status_code == 404
    assert not ExperimentAlertWebhook.objects.exists()
    assert api_as(editor).get(f"/api/experiments/{experiment_b.pk}/alerts/webhook/").status_code == 404
    assert api_as(editor).get("/api/experiments/999999/alerts/webhook/").status_code == 404


def test_a_run_uses_the_experiments_default_unless_it_has_its_own_or_opts_out(run, api_as, editor):
    ExperimentAlertWebhook.objects.create(experiment=run.experiment, url="https://hooks.example.com/exp")
    client = api_as(editor)
    url = f"/api/runs/{run.pk}/alerts/webhook/"
    default = {"url": "", "off": False, "experiment_url": "https://hooks.example.com/exp"}
    assert client.get(url).json() == {**default, "effective": "https://hooks.example.com/exp"}
    own = client.put(url, {"url": "https://hooks.example.com/run"}, format="json").json()
    assert own == {**default, "url": "https://hooks.example.com/run", "effective": "https://hooks.example.com/run"}
    off = client.put(url, {"off": True}, format="json").json()
    assert off == {**default, "off": True, "effective": ""}
    assert AlertWebhook.objects.filter(run=run).values("url", "off").get() == {"url": "", "off": True}
    assert client.put(url, {"url": "", "off": True}, format="json").json() == off
    back = client.put(url, {"url": ""}, format="json").json()  # "": the run's own setting goes, the default applies
    assert back == {**default, "effective": "https://hooks.example.com/exp"}
    assert not AlertWebhook.objects.filter(run=run).exists()
    assert client.put(url, {"url": "", "off": False}, format="json").json() == back
    assert _errors(client.put(url, {"off": False}, format="json")) == {"url"}  # url is required unless off


def test_the_experiment_page_shows_its_default_webhook_to_editors_only(experiment, client, editor, viewer):
    ExperimentAlertWebhook.objects.create(experiment=experiment, url="https://hooks.example.com/exp")
    client.force_login(editor)
    page = client.get(f"/experiments/{experiment.pk}/").content.decode()
    assert (
        'id="experiment-webhook-url" type="url" size="48" placeholder="https://..." value="https://hooks.example.com/exp"'
        in page
    )
    assert "js/experiment_alerts.js" in page
    client.force_login(viewer)
    page = client.get(f"/experiments/{experiment.pk}/").content.decode()
    assert "experiment-webhook" not in page and "hooks.example.com" not in page


def test_a_firing_alert_is_a_banner_on_the_run_page_and_the_runs_list(run, ingest, client, owner):
    client.force_login(owner)
    assert 'id="alert-banner" role="alert" hidden' in client.get(f"/runs/{run.pk}/").content.decode()
    ingest(batch([1], lambda s: {M.REWARD_MEAN: None}))
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert 'id="alert-banner" role="alert">' in page and "<code>non_finite</code>" in page
    runs_list = client.get(f"/experiments/{run.experiment_id}/").content.decode()
    assert "Alert firing" in runs_list and f'data-run-id="{run.pk}"' in runs_list


def test_alert_rules_may_watch_a_trainer_ranks_communication_time():
    assert kinds.known_metric(M.comm_metric(1, M.COMM_GRAD_WAIT))
    assert not kinds.known_metric("comm/rank1/nonsense")
