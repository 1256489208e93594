"""The planner in the browser: the submit page's Plan table, and a queued run's estimated start on its page
(see conftest.py for the real server and Chromium).

The server is a subprocess: it reads its calibration from TANDEM_CAPACITY_CALIBRATIONS, set here before
the module's server starts to a calibration file this module writes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from playwright.sync_api import expect

from tests.platform.capacity_costs import write_calibration

NO_CHROMIUM = pytest.mark.skipif(
    not Path("/usr/bin/chromium").exists(), reason="/usr/bin/chromium is absent (apt-get install chromium)"
)
pytestmark = [pytest.mark.e2e, NO_CHROMIUM, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="module", autouse=True)
def server_calibration(tmp_path_factory):
    """The calibration of the CPU group, in this process's settings and in the server's environment
    (autouse and module-scoped: set before the module's server starts)."""
    from django.conf import settings

    path = write_calibration(tmp_path_factory.mktemp("calibrations"), "e2e-cpu", "written by tests/e2e/test_plan_ui.py")
    before_env = os.environ.get("TANDEM_CAPACITY_CALIBRATIONS")
    before_setting = settings.TANDEM_CAPACITY_CALIBRATIONS
    os.environ["TANDEM_CAPACITY_CALIBRATIONS"] = f"cpu={path}"
    settings.TANDEM_CAPACITY_CALIBRATIONS = {"cpu": str(path)}
    yield path
    settings.TANDEM_CAPACITY_CALIBRATIONS = before_setting
    if before_env is None:
        os.environ.pop("TANDEM_CAPACITY_CALIBRATIONS", None)
    else:
        os.environ["TANDEM_CAPACITY_CALIBRATIONS"] = before_env


def test_the_submit_page_plans_the_spec_without_submitting_it(server, login_as, in_thread, editor, experiment, shot):
    from jobs.models import Run

    page = login_as(editor)
    page.goto("/submit/")
    page.fill("#id_spec", "name: planned\nreward:\n  url: http://reward.example/score\n")
    page.click("#plan-button")
    rows = page.locator("#plan-modes tbody tr")
    expect(rows).to_have_count(5)
    expect(rows.nth(0).locator("td").first).to_have_text("sync")
    expect(page.locator('#plan-modes tr[data-mode="async (lag 1)"]')).to_be_visible()
    expect(page.locator("#plan-modes tr.recommended")).to_have_count(1)
    expect(page.locator("#plan-recommended")).to_contain_text("Recommended: ")
    expect(page.locator("#plan-recommended")).to_contain_text("bottleneck ")
    expect(page.locator("#plan-calibration")).to_contain_text("Calibration: e2e-cpu (measured)")
    expect(page.locator("#plan-note")).to_contain_text("An estimate")
    expect(page.locator('#plan-not-modelled li[data-field="reward.url"]')).to_contain_text("not modelled")
    shot(page, "submit-plan")

    page.fill("#id_spec", "name: t\npipeline:\n  mode: turbo\n")
    page.click("#plan-button")
    error = page.locator('#plan-errors li[data-field="pipeline.mode"]')
    expect(error).to_contain_text("Input should be 'sync', 'async' or 'colocated'")
    expect(page.locator("#plan-modes")).to_have_count(0)

    page.fill("#id_spec", "name: cartpole\nworkload: gym\nenv:\n  id: CartPole-v1\n")
    page.click("#plan-button")
    expect(page.locator("#plan-reason")).to_contain_text("Not simulated: workload 'gym'")
    expect(page.locator('#plan-not-modelled li[data-field="workload"]')).to_be_visible()
    assert in_thread(Run.objects.count) == 0  # planning submits nothing


def test_a_queued_run_shows_its_estimated_start_until_it_is_admitted(
    server, login_as, in_thread, editor, owner, experiment, submit, start
):
    from jobs import handler

    holder = in_thread(lambda: start(submit(experiment, 8)))  # the whole group
    waiting = in_thread(submit, experiment)
    assert waiting.state == "QUEUED"

    page = login_as(editor)
    page.goto(f"/runs/{waiting.pk}/")
    expect(page.locator("#stream-status")).to_have_attribute("data-status", "live")
    estimate = page.locator("#estimated-start")
    expect(estimate).to_contain_text("UTC, an estimate from calibration e2e-cpu")

    in_thread(handler.cancel_run, owner, holder)  # its devices go to the waiting run
    expect(page.locator("#run-state")).to_have_text("ADMITTED")
    expect(estimate).to_be_hidden()
