"""The Cluster page's device rows and the runs page's alert banner, live in a real Chromium (see conftest.py).

Given a running run, when its host agent heartbeats (rlplatform.hosts.heartbeat, the agent's own call) or
the runtime's ingest batch fires then resolves an alert rule (POST /api/ingest/metrics), then the open page
shows it without a reload: to the run's team with a link to the run, to another team by number only. And an
editor sets an experiment's default alert webhook on its page (a bad URL: the server's 400 shown).
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import expect

NO_CHROMIUM = pytest.mark.skipif(
    not Path("/usr/bin/chromium").exists(), reason="/usr/bin/chromium is absent (apt-get install chromium)"
)
pytestmark = [pytest.mark.e2e, NO_CHROMIUM, pytest.mark.django_db(transaction=True)]


def _running(submit, experiment):
    from jobs import handler
    from jobs.states import RunState

    run = submit(experiment)
    for state in (RunState.STARTING, RunState.RUNNING):
        handler.transition(run, state)
    run.refresh_from_db()
    return run


def _held(run) -> tuple[str, int]:
    allocation = run.allocations.active().select_related("device__host").get()
    return allocation.device.host.name, allocation.device.index


def _ingest(server: str, token: str, step: int, bubble: float) -> None:
    body = {"role": "trainer", "points": [{"step": step, "time": time.time(), "metrics": {"bubble/trainer": bubble}}]}
    request = urllib.request.Request(
        f"{server}/api/ingest/metrics",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def _wait_live(page):
    expect(page.locator("#stream-status")).to_have_attribute("data-status", "live")


def test_the_cluster_page_shows_each_heartbeat_without_a_reload(
    server, login_as, in_thread, editor, outsider, experiment, experiment_b, submit, shot
):
    from rlplatform import hosts

    run = in_thread(_running, submit, experiment)
    host, index = in_thread(_held, run)
    mine, theirs = login_as(editor), login_as(outsider)
    for page in (mine, theirs):
        page.goto("/cluster/")
        _wait_live(page)
    rows = [page.locator(f'tr[data-device="{host}:{index}"]') for page in (mine, theirs)]
    for row in rows:
        expect(row.locator(".device-util")).to_have_text("—")  # nothing reported yet
    expect(mine.locator("main")).not_to_contain_text("{#")  # no template comment leaks onto the page

    # When the host's agent reports the device's use, and another of its devices as gone bad
    healthy = {i: i != 3 for i in range(4)}
    in_thread(hosts.heartbeat, host, healthy, {index: {"util_pct": 87.4, "mem_used_mb": 512}})

    for row in rows:
        expect(row.locator(".device-util")).to_have_text("87%")
        expect(row.locator(".device-mem")).to_have_text("512 / 1024 MB")
        expect(row.locator(".device-at")).to_have_text(re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d$"))
    expect(rows[0].locator(".device-holder a")).to_have_attribute("href", f"/runs/{run.pk}/")
    expect(rows[0].locator(".device-holder")).to_have_text(f"run {run.pk}")
    expect(rows[1].locator(".device-holder")).to_have_text(f"run {run.pk}")  # another team: the number only
    expect(rows[1].locator(".device-holder a")).to_have_count(0)
    bad = mine.locator(f'tr[data-device="{host}:3"] .device-name')
    expect(bad).to_contain_text("unhealthy")
    shot(mine, "cluster-devices-live", part=mine.locator("table.devices").first)

    # And a later heartbeat: the newest values replace them
    in_thread(hosts.heartbeat, host, None, {index: {"util_pct": 3, "mem_used_mb": 64}})
    expect(rows[0].locator(".device-util")).to_have_text("3%")
    expect(rows[0].locator(".device-mem")).to_have_text("64 / 1024 MB")


def test_the_runs_page_banner_and_row_marker_follow_an_alert_firing_and_resolving(
    server, login_as, in_thread, editor, experiment, submit, shot
):
    from jobs.ingest.tokens import mint_run_token
    from tests.alerts.helpers import add_rule

    run = in_thread(_running, submit, experiment)
    in_thread(add_rule, run, "bubble", 0.5)
    token = in_thread(mint_run_token, run, 0)
    page = login_as(editor)
    page.goto(f"/experiments/{experiment.pk}/")
    _wait_live(page)
    banner = page.locator("#alert-banner")
    marker = page.locator(f'tr[data-run-id="{run.pk}"] .alert-marker')
    expect(banner).to_be_hidden()
    expect(marker).to_be_hidden()
    expect(page.locator("main")).not_to_contain_text("{#")  # no template comment leaks onto the page

    # When the runtime reports a trainer bubble above the rule's threshold
    _ingest(server, token, 1, 0.9)
    expect(banner).to_be_visible()
    expect(banner.locator(f'.alert-run[data-run-id="{run.pk}"]')).to_contain_text(f"Alert firing on run {run.pk}")
    expect(banner.locator('.alert-rule[data-kind="bubble"]')).to_have_text(
        "bubble bubble/trainer = 0.900 (threshold 0.500)"
    )
    expect(marker).to_be_visible()
    shot(page, "runs-alert-banner-live")

    # And then one below it: the alert resolves
    _ingest(server, token, 2, 0.1)
    expect(banner).to_be_hidden()
    expect(marker).to_be_hidden()


def test_an_editor_sets_the_experiments_default_webhook_on_its_page(
    server, login_as, in_thread, editor, experiment, submit, shot
):
    from jobs.alerts.rules import experiment_webhook_url
    from jobs.models import AlertWebhook

    run = in_thread(_running, submit, experiment)

    page = login_as(editor)
    page.goto(f"/experiments/{experiment.pk}/")
    form = page.locator("#experiment-webhook")
    url = form.locator("#experiment-webhook-url")
    expect(url).to_have_value("")

    # When the editor saves a URL that is not http(s), the server's 400 names the field and nothing is saved
    url.fill("ftp://hooks.example.com/x")
    form.get_by_role("button", name="Save default webhook").click()
    expect(form.locator("#experiment-webhook-error")).to_contain_text("url: must be an http or https URL")
    assert in_thread(experiment_webhook_url, experiment.pk) == ""

    # And then an https URL: saved, and shown again on the next visit
    url.fill("https://hooks.example.com/tandem")
    form.get_by_role("button", name="Save default webhook").click()
    expect(form.locator("#experiment-webhook-status")).to_contain_text("saved: every run without a webhook")
    expect(form.locator("#experiment-webhook-error")).to_be_hidden()
    assert in_thread(experiment_webhook_url, experiment.pk) == "https://hooks.example.com/tandem"
    shot(page, "experiment-default-webhook", part=page.locator("main .card").first)
    page.reload()
    expect(url).to_have_value("https://hooks.example.com/tandem")

    # And on a run of the experiment without a webhook of its own: the default applies, until the run opts out
    page.goto(f"/runs/{run.pk}/")
    own = page.locator("#alert-webhook")
    note = page.locator("#alert-webhook-effective")
    expect(own).to_have_value("")
    expect(own).to_have_attribute("placeholder", "experiment default: https://hooks.example.com/tandem")
    expect(note).to_have_text("alerts go to the experiment's default webhook")
    page.locator("#alert-webhook-off").check()
    page.locator("#alert-webhook-save").click()
    expect(note).to_have_text("alerts go to no webhook")
    assert in_thread(lambda: list(AlertWebhook.objects.filter(run=run).values_list("off", flat=True))) == [True]
