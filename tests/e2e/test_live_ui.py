"""The live UI in a real headless Chromium against a real ASGI server (see conftest.py).

Given personas and runs made through the domain modules, when a user acts in the browser (or the
runtime reports through the ingest API, or completes a command through jobs.commands), then the
page shows it without a reload, and the database says the same.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import expect

# Chromium is the one thing a fresh machine may lack (make test installs it: scripts/install_browser.sh).
NO_CHROMIUM = pytest.mark.skipif(
    not Path("/usr/bin/chromium").exists(), reason="/usr/bin/chromium is absent (apt-get install chromium)"
)
pytestmark = [pytest.mark.e2e, NO_CHROMIUM, pytest.mark.django_db(transaction=True)]

REWARD_CHART = '.chart[data-title="Reward"]'


def _running(run):
    from jobs import handler
    from jobs.states import RunState

    for state in (RunState.STARTING, RunState.RUNNING):
        handler.transition(run, state)
    run.refresh_from_db()
    return run


def _token(run) -> str:
    from jobs.ingest.tokens import mint_run_token

    return mint_run_token(run, 0)


def _ingest(server: str, token: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"{server}/api/ingest/{path}",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
        return json.loads(response.read())


def _points(steps, reward=lambda s: 0.1 * s) -> dict:
    now = time.time()
    return {
        "role": "trainer",
        "points": [
            {"step": s, "time": now + s, "metrics": {"reward/mean": reward(s), "loss/policy": 1.0 / s}} for s in steps
        ],
    }


def _chart_points(page, selector: str, attr: str = "points") -> str:
    return page.locator(selector).get_attribute(f"data-{attr}")


def _wait_live(page):
    expect(page.locator("#stream-status")).to_have_attribute("data-status", "live")


def test_login_and_submit_a_run_with_a_field_error_first(browser, server, in_thread, team_a, experiment, shot):
    from django.contrib.auth.hashers import PBKDF2PasswordHasher
    from django.contrib.auth.models import User

    from jobs.models import Run
    from rlplatform.models import Membership

    # The server checks passwords with the default hashers; the test settings' fast MD5 is not one of them.
    hashed = PBKDF2PasswordHasher().encode("alice-pass-123", "e2esalt0123456", iterations=1000)
    alice = User.objects.create(username="alice", password=hashed)
    Membership.objects.create(team=team_a, user=alice, role="editor")

    context = browser.new_context(base_url=server, viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.goto("/login/")
    shot(page, "login")
    page.fill("#id_username", "alice")
    page.fill("#id_password", "alice-pass-123")
    page.click("button[type=submit], input[type=submit]")
    expect(page).to_have_url(f"{server}/")
    expect(page.locator("main")).to_contain_text("exp-a")

    page.goto("/submit/")
    page.select_option("#spec-example", "grpo-sync.yaml")
    expect(page.locator("#id_spec")).to_have_value(re.compile(r"^# GRPO, lock-step baseline"))
    page.fill("#id_spec", "name: t\npipeline:\n  mode: turbo\n")
    page.click("form.stacked button[type=submit]")
    error = page.locator('#spec-errors li[data-field="pipeline.mode"]')
    expect(error).to_contain_text("Input should be 'sync', 'async' or 'colocated'")
    expect(error).to_contain_text("(line 3)")  # marked at the line of the field in the editor
    expect(page.locator("#id_spec")).to_have_value("name: t\npipeline:\n  mode: turbo\n")
    shot(page, "submit-field-error")
    assert Run.objects.count() == 0

    page.fill("#id_spec", "name: from-the-browser\n")
    page.click("form.stacked button[type=submit]")
    expect(page).to_have_url(re.compile(r"/runs/\d+/$"))
    run = Run.objects.get()
    assert (run.name, run.created_by_id, run.experiment_id) == ("from-the-browser", alice.pk, experiment.pk)
    expect(page.locator("#run-state")).to_have_text(run.state)
    context.close()


def test_reward_chart_receives_points_while_live(server, login_as, in_thread, editor, experiment, submit, shot):
    run = in_thread(lambda: _running(submit(experiment)))
    token = in_thread(_token, run)
    _ingest(server, token, "metrics", _points(range(1, 4)))  # before the page opens: the snapshot has them

    page = login_as(editor)
    page.goto(f"/runs/{run.pk}/")
    _wait_live(page)
    expect(page.locator(REWARD_CHART)).to_have_attribute("data-points", "3")

    _ingest(server, token, "metrics", _points(range(4, 9)))
    expect(page.locator(REWARD_CHART)).to_have_attribute("data-points", "8")
    expect(page.locator('.chart[data-title="Policy / value loss"]')).to_have_attribute("data-points", "8")
    # Hover shows the values (uPlot's legend follows the cursor).
    legend = page.locator(f"{REWARD_CHART} .u-legend .u-series")
    expect(legend.nth(1)).to_contain_text("reward/mean")
    expect(legend.nth(1).locator(".u-value")).to_have_text("--")  # no cursor, no value
    over = page.locator(f"{REWARD_CHART} .u-over")
    box = over.bounding_box()
    over.hover(position={"x": box["width"] - 2, "y": box["height"] / 2})  # the right edge: step 8
    expect(legend.nth(0).locator(".u-value")).to_have_text("8")
    expect(legend.nth(1).locator(".u-value")).to_have_text("0.8")

    # A dropped connection resumes from the last seq: nothing missed, nothing twice.
    page.evaluate("window.tandemStream.drop()")
    _ingest(server, token, "metrics", _points(range(9, 11)))
    _wait_live(page)
    expect(page.locator(REWARD_CHART)).to_have_attribute("data-points", "10")
    page.select_option("#x-mode", "relative")
    page.check("#log-scale")
    page.fill("#smoothing", "0.6")
    expect(page.locator(f"{REWARD_CHART} .u-legend")).to_contain_text("reward/mean (EMA)")
    expect(page.locator(REWARD_CHART)).to_have_attribute("data-points", "10")
    shot(page, "run-live")

    # The experiment's comparison overlays the run's series and keeps it live too.
    compare = page.context.new_page()
    compare.goto(f"/experiments/{experiment.pk}/compare/?runs={run.pk}&key=reward/mean")
    expect(compare.locator("#compare-chart")).to_have_attribute("data-points", "10")
    _ingest(server, token, "metrics", _points([11]))
    expect(compare.locator("#compare-chart")).to_have_attribute("data-points", "11")
    expect(page.locator(REWARD_CHART)).to_have_attribute("data-points", "11")
    compare.close()

    # The experiment's runs table keeps each run's key metrics live.
    listing = page.context.new_page()
    listing.goto(f"/experiments/{experiment.pk}/")
    _wait_live(listing)
    cell = listing.locator(f'tr[data-run-id="{run.pk}"] .key-metrics')
    expect(cell).to_have_text("reward/mean 1.100")
    _ingest(server, token, "metrics", _points([12]))
    expect(cell).to_have_text("reward/mean 1.200")
    listing.close()
    page.locator("#controls").scroll_into_view_if_needed()
    shot(page, "run-controls", full=False)
    shot(page, "run-charts", page.locator(".chart-group").first)


def test_pause_and_resume_reflect_the_completed_commands(server, login_as, in_thread, editor, experiment, submit):
    from jobs import commands
    from jobs.models import Command

    run = in_thread(lambda: _running(submit(experiment)))
    page = login_as(editor)
    page.goto(f"/runs/{run.pk}/")
    _wait_live(page)
    expect(page.locator("[data-command=resume]")).to_be_disabled()

    page.click("[data-command=pause]")
    row = page.locator("#commands tbody tr").first
    expect(row).to_contain_text("pause")
    expect(row.locator(".cmd-state")).to_have_text("pending")
    pause = in_thread(lambda: Command.objects.get(run=run, kind="pause"))
    assert (pause.state, pause.created_by_id) == ("pending", editor.pk)
    expect(page.locator("#run-state")).to_have_text("RUNNING")  # not before the runtime says so

    in_thread(commands.complete, run.pk, pause.pk, "done", "paused at step 3")
    expect(page.locator("#run-state")).to_have_text("PAUSED")
    expect(row.locator(".cmd-state")).to_have_text("done")
    expect(page.locator("[data-command=pause]")).to_be_disabled()

    page.click("[data-command=resume]")
    expect(page.locator("#commands tbody tr").first).to_contain_text("resume")
    resume = in_thread(lambda: Command.objects.get(run=run, kind="resume"))
    in_thread(commands.complete, run.pk, resume.pk, "done")
    expect(page.locator("#run-state")).to_have_text("RUNNING")
    expect(page.locator("#run-state-badge")).to_have_class("state state-RUNNING")


def test_viewer_sees_no_controls_and_the_server_refuses_them(server, login_as, in_thread, viewer, experiment, submit):
    from jobs.models import Command

    run = in_thread(lambda: _running(submit(experiment)))
    page = login_as(viewer)
    page.goto(f"/runs/{run.pk}/")
    _wait_live(page)
    expect(page.locator("#controls")).to_have_count(0)
    status = page.evaluate(
        """async (id) => (await fetch(`/api/runs/${id}/commands/`, {method: "POST",
            headers: {"Content-Type": "application/json",
                      "X-CSRFToken": document.querySelector("input[name=csrfmiddlewaretoken]").value},
            body: JSON.stringify({kind: "pause"})})).status""",
        run.pk,
    )
    assert status == 403
    assert in_thread(lambda: Command.objects.filter(run=run).count()) == 0


def test_rollback_with_confirmation_then_the_run_continues_and_a_file_downloads(
    server, login_as, in_thread, editor, experiment, submit, checkpoint_root, shot
):
    from jobs import commands
    from jobs.models import Command, MetricPoint

    run = in_thread(lambda: _running(submit(experiment)))
    token = in_thread(_token, run)
    ckpt = checkpoint_root / f"run-{run.pk}" / "step-5"
    ckpt.mkdir(parents=True)
    weights = bytes(range(256)) * 64
    (ckpt / "model.safetensors").write_bytes(weights)
    _ingest(server, token, "metrics", _points(range(1, 9)))
    reply = _ingest(
        server,
        token,
        "checkpoints",
        {
            "step": 5,
            "path": f"run-{run.pk}/step-5",
            "weight_version": 5,
            "size": len(weights),
            "metrics": {"reward/mean": 0.5},
        },
    )
    checkpoint_id = reply["checkpoint"]

    page = login_as(editor)
    page.goto(f"/runs/{run.pk}/")
    _wait_live(page)
    expect(page.locator(REWARD_CHART)).to_have_attribute("data-points", "8")
    page.select_option("#rollback-checkpoint", str(checkpoint_id))

    # Dismissing the confirmation sends nothing.
    page.once("dialog", lambda dialog: dialog.dismiss())
    page.click("[data-command=rollback]")
    page.wait_for_timeout(300)
    assert in_thread(lambda: Command.objects.filter(run=run).count()) == 0

    messages = []
    page.once("dialog", lambda dialog: (messages.append(dialog.message), dialog.accept()))
    page.click("[data-command=rollback]")
    expect(page.locator("#commands tbody tr").first).to_contain_text("rollback")
    assert messages == [f"Roll run {run.pk} back to step 5 · v5? Later metric points become rewound."]
    rollback = in_thread(lambda: Command.objects.get(run=run, kind="rollback"))
    assert rollback.args["checkpoint"] == checkpoint_id and rollback.args["step"] == 5

    in_thread(commands.complete, run.pk, rollback.pk, "done")
    expect(page.locator(REWARD_CHART)).to_have_attribute("data-rewound", "3")  # steps 6, 7, 8 drawn apart
    expect(page.locator(REWARD_CHART)).to_have_attribute("data-points", "5")
    # The runtime continues from step 5: the new steps 6 and 7 are live again.
    _ingest(server, token, "metrics", _points(range(6, 8), reward=lambda s: 1.0 + s))
    expect(page.locator(REWARD_CHART)).to_have_attribute("data-points", "7")
    expect(page.locator(REWARD_CHART)).to_have_attribute("data-rewound", "3")
    assert in_thread(lambda: MetricPoint.objects.filter(run=run, rewound=True).count()) == 3
    shot(page, "run-after-rollback")
    shot(page, "run-rewound", page.locator(REWARD_CHART))

    page.goto(f"/runs/{run.pk}/checkpoints/")
    row = page.locator(f'#checkpoints tr[data-checkpoint-id="{checkpoint_id}"]')
    expect(row).to_contain_text("16.0 KiB")
    with page.expect_download() as info:
        row.locator("a", has_text="model.safetensors").click()
    download = info.value
    assert download.suggested_filename == "model.safetensors"
    with open(download.path(), "rb") as f:
        assert f.read() == weights
    row.locator("button.pin").click()
    expect(row.locator(".pinned")).to_have_text("pinned")
    expect(row.locator("button.delete")).to_be_disabled()
    shot(page, "checkpoints")


def test_admin_raises_a_quota_and_the_waiting_run_is_admitted_live(
    server, login_as, in_thread, editor, superuser, make_experiment, team_a, cpu_group, submit, shot
):
    from rlplatform.models import AuditLog, Quota

    exp = make_experiment(team_a, cpu_group, "narrow", max_concurrent_runs=1)
    first = in_thread(submit, exp)
    waiting = in_thread(submit, exp)
    assert (first.state, waiting.state) == ("ADMITTED", "QUEUED")

    watcher = login_as(editor)
    watcher.goto("/cluster/")
    _wait_live(watcher)
    row = watcher.locator(f'tr[data-run-id="{waiting.pk}"]')
    expect(row.locator(".run-state")).to_have_text("QUEUED")
    expect(row.locator(".run-position")).to_contain_text(waiting.reason)
    shot(watcher, "cluster")

    admin = login_as(superuser)
    admin.goto("/quotas/")
    form = admin.locator(f"#quota-{exp.quota_id} form")
    form.locator(f"#id_q{exp.quota_id}-max_concurrent_runs").fill("-1")
    form.locator("button[type=submit]").click()
    expect(admin.locator(f'#quota-{exp.quota_id} .field-error[data-field="max_concurrent_runs"]')).to_be_visible()
    assert in_thread(lambda: Quota.objects.get(pk=exp.quota_id).max_concurrent_runs) == 1
    expect(row.locator(".run-state")).to_have_text("QUEUED")

    form = admin.locator(f"#quota-{exp.quota_id} form")
    form.locator(f"#id_q{exp.quota_id}-max_concurrent_runs").fill("2")
    form.locator("button[type=submit]").click()
    expect(admin.locator(".messages")).to_contain_text("saved")
    shot(admin, "quotas")

    expect(row.locator(".run-state")).to_have_text("ADMITTED")
    assert in_thread(lambda: Quota.objects.get(pk=exp.quota_id).max_concurrent_runs) == 2
    audit = in_thread(
        lambda: list(AuditLog.objects.filter(action="quota.update").values("actor_id", "before", "after"))
    )
    assert len(audit) == 1 and audit[0]["actor_id"] == superuser.pk
    assert (audit[0]["before"]["max_concurrent_runs"], audit[0]["after"]["max_concurrent_runs"]) == (1, 2)


def test_live_params_and_fork_are_validated_by_the_server(
    server, login_as, in_thread, editor, experiment, submit, checkpoint_root
):
    from jobs.models import ConfigVersion, Run

    run = in_thread(lambda: _running(submit(experiment)))
    token = in_thread(_token, run)
    reply = _ingest(server, token, "checkpoints", {"step": 2, "path": f"run-{run.pk}/step-2", "weight_version": 2})
    page = login_as(editor)
    page.goto(f"/runs/{run.pk}/")
    _wait_live(page)

    page.click("summary:has-text('Change parameters live')")
    page.fill('[data-param="trainer.lr"]', "0.00001")
    page.click("[data-command=set_params]")
    row = page.locator("#configs tbody tr").first
    expect(row).to_contain_text("v1")
    expect(row.locator(".diff")).to_contain_text("trainer.lr")
    expect(row.locator("ins")).to_have_text("0.00001")
    assert in_thread(lambda: list(ConfigVersion.objects.filter(run=run).values_list("params", flat=True))) == [
        {"trainer.lr": 1e-5}
    ]

    page.click("summary:has-text('Fork with an edited spec')")
    page.select_option("#fork-checkpoint", str(reply["checkpoint"]))
    page.fill("#fork-spec", "name: x\npipeline:\n  mode: turbo\n")
    page.click("[data-command=fork]")
    expect(page.locator("#control-error")).to_contain_text("args.spec.pipeline.mode")
    assert in_thread(Run.objects.count) == 1  # nothing submitted

    page.fill("#fork-spec", "name: x\n")
    page.fill("#fork-name", "tiny-fork")
    page.click("[data-command=fork]")
    expect(page.locator("#control-error")).to_be_hidden()
    link = page.locator("#control-info a")
    expect(link).to_have_text(re.compile(r"run \d+"))
    child = in_thread(lambda: Run.objects.exclude(pk=run.pk).get())
    assert (child.name, child.parent_checkpoint) == ("tiny-fork", f"run-{run.pk}/step-2")
    link.click()
    expect(page).to_have_url(f"{server}/runs/{child.pk}/")
