"""The run page's Communication charts in a browser: weight sync for every LLM run, and with two trainer ranks
each rank's gradient communication (runtime.contract.COMM_METRICS) as a series of its own, live and after a
reload."""

from __future__ import annotations

import time

import pytest
from playwright.sync_api import expect

from runtime.contract import COMM_GRAD, COMM_GRAD_WAIT, TIME_WEIGHT_SYNC, comm_metric
from tests.e2e.test_live_ui import NO_CHROMIUM, _ingest, _running, _token, _wait_live

pytestmark = [pytest.mark.e2e, NO_CHROMIUM, pytest.mark.django_db(transaction=True)]

GROUP = "#charts-communication"
SYNC = '.chart[data-title="Weight sync (s)"]'
GRAD = '.chart[data-title="Gradient communication per rank (s)"]'
WAIT = '.chart[data-title="Gradient wait per rank (s)"]'


def _points(steps) -> dict:
    now = time.time()
    metrics = lambda s: {  # noqa: E731
        TIME_WEIGHT_SYNC: 0.01 * s,
        **{comm_metric(r, COMM_GRAD): 0.1 * s + r for r in range(2)},
        **{comm_metric(r, COMM_GRAD_WAIT): 0.05 * s for r in range(2)},
    }
    return {"role": "trainer-0", "points": [{"step": s, "time": now + s, "metrics": metrics(s)} for s in steps]}


def test_two_ranks_gradient_communication_is_charted_per_rank(
    server, login_as, in_thread, editor, experiment, submit, shot
):
    run = in_thread(lambda: _running(submit(experiment, devices=2)))
    token = in_thread(_token, run)
    page = login_as(editor)
    page.goto(f"/runs/{run.pk}/")
    _wait_live(page)
    expect(page.locator(f'#section-nav a[href="{GROUP}"]')).to_have_count(1)
    expect(page.locator(f"{GROUP} {GRAD}")).to_have_attribute(
        "data-keys", ",".join(comm_metric(r, COMM_GRAD) for r in range(2))
    )

    _ingest(server, token, "metrics", _points([1, 2]))
    expect(page.locator(f"{GROUP} {SYNC}")).to_have_attribute("data-points", "2")
    expect(page.locator(f"{GROUP} {GRAD}")).to_have_attribute("data-points", "4")  # a series per rank
    expect(page.locator(f"{GROUP} {WAIT}")).to_have_attribute("data-points", "4")
    shot(page, "communication-charts", page.locator(GROUP))

    page.reload()
    _wait_live(page)
    expect(page.locator(f"{GROUP} {GRAD}")).to_have_attribute("data-points", "4")
    expect(page.locator(f"{GROUP} {SYNC}")).to_have_attribute("data-points", "2")


def test_one_rank_charts_weight_sync_only(server, login_as, in_thread, editor, experiment, submit):
    run = in_thread(lambda: _running(submit(experiment)))
    page = login_as(editor)
    page.goto(f"/runs/{run.pk}/")
    _wait_live(page)
    expect(page.locator(f"{GROUP} {SYNC}")).to_have_count(1)
    expect(page.locator(f"{GROUP} {GRAD}")).to_have_count(0)
