"""The live UI's pages on the server side (no browser): who may see them, what they render, the quota form."""

from __future__ import annotations

import json

import pytest

from jobs.models import Run
from jobs.states import RunState
from rlplatform.models import AuditLog, Quota

pytestmark = pytest.mark.django_db


def test_new_pages_need_a_login(client, experiment, submit):
    run = submit(experiment)
    for path in ["/cluster/", "/quotas/", f"/runs/{run.pk}/checkpoints/", f"/experiments/{experiment.pk}/compare/"]:
        response = client.get(path)
        assert (response.status_code, response["Location"]) == (302, f"/login/?next={path}"), path


def test_another_teams_run_pages_are_404(client, outsider, experiment, submit):
    run = submit(experiment)
    client.force_login(outsider)
    assert client.get(f"/runs/{run.pk}/checkpoints/").status_code == 404
    assert client.get(f"/experiments/{experiment.pk}/compare/").status_code == 404


def test_run_page_embeds_what_its_script_needs(client, editor, viewer, experiment, submit):
    run = submit(experiment)
    client.force_login(editor)
    html = client.get(f"/runs/{run.pk}/").content.decode()
    live = json.loads(html.split('<script id="run-live" type="application/json">')[1].split("</script>")[0])
    assert live["run"] == run.pk and live["state"] == "ADMITTED" and live["can_edit"] is True
    assert live["allowed"]["pause"] == ["RUNNING"] and live["allowed"]["resume"] == ["PAUSED"]
    assert live["stream_seq"] >= 1  # the submit's state change is in the stream already
    assert [g["title"] for g in live["groups"]] == [
        "Reward & accuracy",
        "Losses",
        "Pipeline",
        "Throughput & time split",
        "Communication",
        "Consistency",
    ]
    assert 'data-keys="reward/mean,reward/std"' in html and 'data-command="pause"' in html
    assert '<script type="module" src="/static/js/run_page.js">' in html
    client.force_login(viewer)
    html = client.get(f"/runs/{run.pk}/").content.decode()
    assert 'data-command="pause"' not in html and 'id="controls"' not in html


def test_run_page_sends_events_as_json_and_the_checkpoints_page_its_headlines(client, editor, experiment, submit):
    from jobs.lifecycle.events import record_event

    run = submit(experiment)
    record_event(run.pk, "role_started", {"role": "trainer-0", "host": "h1", "attempt": 0})
    client.force_login(editor)
    html = client.get(f"/runs/{run.pk}/").content.decode()
    live = json.loads(html.split('<script id="run-live" type="application/json">')[1].split("</script>")[0])
    assert [(e["kind"], e["payload"], e["role"]) for e in live["events"]] == [
        ("role_started", {"role": "trainer-0", "host": "h1", "attempt": 0}, "platform")
    ]
    assert "{&#x27;role&#x27;" not in html and "No events yet." not in html  # rows are run_page.js's, from JSON
    html = client.get(f"/runs/{run.pk}/checkpoints/").content.decode()
    headlines = json.loads(html.split('<script id="headlines" type="application/json">')[1].split("</script>")[0])
    assert headlines == [
        {"label": "Reward", "keys": ["reward/mean"]},
        {"label": "Held-out accuracy", "keys": ["eval/accuracy"]},
        {"label": "Loss", "keys": ["loss/policy"]},
    ]


def test_a_gym_run_page_charts_returns_and_its_learner_not_tokens(client, editor, owner, experiment):
    from jobs import handler

    run, _ = handler.submit_run(owner, experiment, "name: cartpole\nworkload: gym\nenv:\n  id: CartPole-v1\n")
    client.force_login(editor)
    html = client.get(f"/runs/{run.pk}/").content.decode()
    live = json.loads(html.split('<script id="run-live" type="application/json">')[1].split("</script>")[0])
    assert [g["title"] for g in live["groups"]] == ["Returns", "Learner", "Pipeline", "Throughput & time split"]
    assert 'data-keys="episode/return_mean,episode/return_min,episode/return_max"' in html
    assert 'data-keys="target/sync_events"' in html and 'data-keys="staleness/mean,staleness/max"' in html
    assert "gen_tokens_per_s" not in html and "Response length" not in html


def test_cluster_page_shows_the_queue_with_position_and_reason(
    client, viewer, make_experiment, team_a, cpu_group, submit
):
    exp = make_experiment(team_a, cpu_group, "narrow", max_concurrent_runs=1)
    submit(exp)
    waiting = submit(exp)
    assert waiting.state == RunState.QUEUED
    client.force_login(viewer)
    html = client.get("/cluster/").content.decode()
    assert f'<tr data-run-id="{waiting.pk}"><td class="num">1</td>' in html
    assert waiting.reason in html
    assert '<dd data-usage="queued_runs">1</dd>' in html
    # Per host: devices, used, free, unhealthy (a device never allocated is not "used").
    cells = '<td class="num">{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td>'
    assert "<td>cpu-local-h1</td><td>online</td>" + cells.format(4, 1, 3, 0) in html
    assert "<td>cpu-local-h2</td><td>online</td>" + cells.format(4, 0, 4, 0) in html


def test_quotas_page_is_for_platform_staff_only(client, owner, experiment):
    client.force_login(owner)  # a team admin is not platform staff
    assert client.get("/quotas/").status_code == 403
    response = client.post("/quotas/", {"quota": experiment.quota_id, f"q{experiment.quota_id}-max_devices": "99"})
    assert response.status_code == 403
    assert Quota.objects.get(pk=experiment.quota_id).max_devices == 8


def _quota_post(quota, **values):
    base = {"max_devices": 8, "max_concurrent_runs": 4, "max_rollout_workers": 64, "priority": 0}
    base.update(values)
    return {"quota": quota.pk, **{f"q{quota.pk}-{k}": ("" if v is None else v) for k, v in base.items()}}


def test_staff_change_a_quota_audited_and_the_queue_moves(
    client, superuser, make_experiment, team_a, cpu_group, submit
):
    exp = make_experiment(team_a, cpu_group, "narrow", max_concurrent_runs=1)
    submit(exp)
    waiting = submit(exp)
    client.force_login(superuser)
    assert "narrow" in client.get("/quotas/").content.decode()
    response = client.post("/quotas/", _quota_post(exp.quota, max_concurrent_runs=2, device_hour_budget=12.5))
    assert (response.status_code, response["Location"]) == (302, "/quotas/")
    quota = Quota.objects.get(pk=exp.quota_id)
    assert (quota.max_concurrent_runs, quota.device_hour_budget) == (2, 12.5)
    waiting.refresh_from_db()
    assert waiting.state == RunState.ADMITTED
    entry = AuditLog.objects.get(action="quota.update")
    assert (entry.actor, entry.before["max_concurrent_runs"], entry.after["max_concurrent_runs"]) == (superuser, 1, 2)


def test_a_bad_quota_value_is_shown_at_the_field_and_changes_nothing(client, superuser, experiment):
    client.force_login(superuser)
    response = client.post("/quotas/", _quota_post(experiment.quota, max_devices=-3, priority=5000))
    assert response.status_code == 400
    html = response.content.decode()
    assert '<div class="field-error" data-field="max_devices">' in html
    # The form accepts any integer priority; the handler's range check lands at the field too.
    response = client.post("/quotas/", _quota_post(experiment.quota, priority=5000))
    assert response.status_code == 400
    assert '<div class="field-error" data-field="priority">must be an integer from -1000 to 1000</div>' in (
        response.content.decode()
    )
    assert client.post("/quotas/", {"quota": "abc"}).status_code == 404
    quota = Quota.objects.get(pk=experiment.quota_id)
    assert (quota.max_devices, quota.priority) == (8, 0)
    assert not AuditLog.objects.filter(action="quota.update").exists()


def test_submit_page_offers_the_examples(client, editor, experiment):
    client.force_login(editor)
    html = client.get("/submit/").content.decode()
    assert '<option value="grpo-sync.yaml">grpo-sync.yaml</option>' in html
    examples = json.loads(html.split('<script id="spec-examples" type="application/json">')[1].split("</script>")[0])
    assert examples["grpo-sync.yaml"].startswith("# GRPO, lock-step baseline")
    assert Run.objects.count() == 0


def test_compare_page_defaults_to_the_newest_runs(client, viewer, experiment, submit):
    runs = [submit(experiment) for _ in range(4)]
    client.force_login(viewer)
    html = client.get(f"/experiments/{experiment.pk}/compare/").content.decode()
    live = json.loads(html.split('<script id="compare-live" type="application/json">')[1].split("</script>")[0])
    assert [r["id"] for r in live["runs"]] == [runs[3].pk, runs[2].pk, runs[1].pk]
    assert live["key"] == "reward/mean"
    html = client.get(f"/experiments/{experiment.pk}/compare/?runs={runs[0].pk}&key=loss/policy").content.decode()
    live = json.loads(html.split('<script id="compare-live" type="application/json">')[1].split("</script>")[0])
    assert ([r["id"] for r in live["runs"]], live["key"]) == ([runs[0].pk], "loss/policy")


def test_experiment_page_shows_each_runs_latest_key_metrics(client, viewer, experiment, submit):
    from django.utils import timezone

    from jobs.models import MetricPoint

    run, quiet = submit(experiment), submit(experiment)
    now = timezone.now()
    MetricPoint.objects.create(run=run, attempt=0, step=1, time=now, metrics={"reward/mean": 0.25, "accuracy": 0.5})
    MetricPoint.objects.create(run=run, attempt=0, step=2, time=now, metrics={"reward/mean": 0.75, "accuracy": None})
    MetricPoint.objects.create(run=run, attempt=0, step=3, time=now, metrics={"reward/mean": 9.0}, rewound=True)
    client.force_login(viewer)
    html = client.get(f"/experiments/{experiment.pk}/").content.decode()
    row = html.split(f'<tr data-run-id="{run.pk}">')[1].split("</tr>")[0]
    assert '<td class="key-metrics"><div><code>reward/mean</code> 0.750</div></td>' in row
    row = html.split(f'<tr data-run-id="{quiet.pk}">')[1].split("</tr>")[0]
    assert '<td class="key-metrics"><span class="muted">—</span></td>' in row
