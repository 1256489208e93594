"""Pages a person can read, in a real headless Chromium against a real ASGI server (see conftest.py):
chart ticks that keep small values apart, event details as labelled fields, checkpoint rows with
headline metrics and the rest folded, and a run page with section links and foldable sections.

Given a run whose runtime reports through the ingest API (as test_live_ui.py does), when a user
opens its pages, then what the page shows is what a person reads, not what a program printed.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from playwright.sync_api import expect

from runtime.contract import METRICS
from tests.e2e.test_live_ui import _ingest, _running, _token, _wait_live

NO_CHROMIUM = pytest.mark.skipif(
    not Path("/usr/bin/chromium").exists(), reason="/usr/bin/chromium is absent (apt-get install chromium)"
)
pytestmark = [pytest.mark.e2e, NO_CHROMIUM, pytest.mark.django_db(transaction=True)]

SCIENTIFIC = re.compile(r"^(0|-?\d(\.\d+)?e-?\d+)$")
# Forty of the runtime's own metric names, as a checkpoint records them (the last step's metrics).
FORTY = {name: round(0.01 * (i + 1), 4) for i, name in enumerate(list(METRICS)[:40])}


def _ticks(page, title: str) -> list[str]:
    return page.locator(f'.chart[data-title="{title}"]').get_attribute("data-y-ticks").split(" ")


def _report(server, token, steps, metrics) -> None:
    now = time.time()
    points = [{"step": s, "time": now + s, "metrics": metrics(s)} for s in steps]
    _ingest(server, token, "metrics", {"role": "trainer", "points": points})


def test_tick_labels_keep_tiny_and_small_values_apart(server, login_as, in_thread, editor, experiment, submit, shot):
    run = in_thread(lambda: _running(submit(experiment)))
    token = in_thread(_token, run)
    _report(
        server,
        token,
        range(1, 6),
        lambda s: {
            "lr": 1e-4 * s,  # 0.0001 .. 0.0005: uPlot's default labelled these "0" and "0.001"
            "consistency/logprob_diff_mean": 1e-7 * s,  # ~1e-7: every default label read "0"
            "consistency/logprob_diff_max": 1.5e-7 * s,
            "reward/mean": 0.1 * s,
        },
    )
    page = login_as(editor)
    page.goto(f"/runs/{run.pk}/")
    _wait_live(page)

    # The formatter itself, imported from the served module.
    got = page.evaluate(
        """async () => {
            const { formatTicks } = await import("/static/js/ticks.js");
            return [
                [0, 1e-7, 2e-7, 3e-7], [0, 2.5e-7, 5e-7, 7.5e-7], [0, 0.0001, 0.0002, 0.00030000000000000003],
                [0, 0.25, 0.5, 0.75, 1], [0, 100, 200, 300, 400, 500], [1e6, 2e6, 3e6],
                [0.001, 0.01, 0.1, 1, 10], [1e-9, 1e-8], [0.00029, 0.0003, 0.00031], [-0.5, 0, 0.5],
            ].map(formatTicks);
        }"""
    )
    assert got == [
        ["0", "1e-7", "2e-7", "3e-7"],
        ["0", "2.5e-7", "5e-7", "7.5e-7"],
        ["0", "0.0001", "0.0002", "0.0003"],
        ["0", "0.25", "0.5", "0.75", "1"],
        ["0", "100", "200", "300", "400", "500"],
        ["1e6", "2e6", "3e6"],
        ["0.001", "0.01", "0.1", "1", "10"],
        ["1e-9", "1e-8"],
        ["0.00029", "0.0003", "0.00031"],
        ["-0.5", "0", "0.5"],
    ]

    # The charts draw with it: the labels they drew, then their value axis' own formatter.
    gap = '.chart[data-title="Engine vs trainer log-prob gap"]'
    expect(page.locator(gap)).to_have_attribute("data-points", "10")
    expect(page.locator(gap)).to_have_attribute("data-y-ticks", re.compile(r"e-7"))
    for title, scientific in [("Engine vs trainer log-prob gap", True), ("Learning rate", None), ("Reward", False)]:
        labels = _ticks(page, title)
        values = [float(v) for v in labels]
        assert len(labels) >= 2 and values == sorted(set(values)), (title, labels)  # distinct, in order
        if scientific is not None:
            assert all(bool(SCIENTIFIC.match(v)) == scientific or v == "0" for v in labels), (title, labels)
    lr = [float(v) for v in _ticks(page, "Learning rate")]
    assert max(lr) < 0.001 and sum(0 < v < 0.001 for v in lr) >= 2, lr  # small ticks shown as themselves
    shot(page, "chart-small-ticks", page.locator("#charts-consistency"))
    axis = page.evaluate(
        """() => {
            const plot = window.tandemCharts.find((c) => c.title === "Learning rate").plot;
            return plot.axes[1].values(plot, [0, 0.0005, 0.001], 1, 30, 0.0005);
        }"""
    )
    assert axis == ["0", "0.0005", "0.001"]
    # and the legend's value under the cursor keeps the same notation (uPlot's default shows 1e-7 as "0")
    hover = page.evaluate(
        """() => {
            const plot = window.tandemCharts.find((c) => c.title === "Engine vs trainer log-prob gap").plot;
            return [1.5e-7, 0.0005, null].map((v) => plot.series[1].value(plot, v, 1, 0));
        }"""
    )
    assert hover == ["1.5e-7", "0.0005", "--"]


def test_event_details_are_labelled_fields_and_long_ones_fold(
    server, login_as, in_thread, editor, experiment, submit, shot
):
    from jobs.lifecycle.events import record_event

    run = in_thread(lambda: _running(submit(experiment)))
    token = in_thread(_token, run)
    in_thread(record_event, run.pk, "role_started", {"role": "trainer-0", "host": "cpu-local-h1", "attempt": 0})
    page = login_as(editor)
    page.goto(f"/runs/{run.pk}/")
    _wait_live(page)

    started = page.locator("#events tbody tr", has_text="role_started")
    expect(started.locator("dt")).to_have_text(["attempt", "host", "role"])  # sorted: jsonb keeps no order
    expect(started.locator("dd")).to_have_text(["0", "cpu-local-h1", "trainer-0"])

    # A checkpoint event arrives live: its 40 metrics fold; the other fields stay in view.
    payload = {"step": 5, "path": f"run-{run.pk}/step-5", "weight_version": 5, "size": 16384, "metrics": FORTY}
    event = {"seq": 1, "kind": "checkpoint", "time": time.time(), "payload": payload}
    _ingest(server, token, "metrics", {"role": "trainer", "events": [event]})
    for reloaded in (False, True):  # live from the stream, then as the server renders the page
        if reloaded:
            page.reload()
            _wait_live(page)
        row = page.locator("#events tbody tr", has_text="checkpoint")
        expect(row.locator(".event-details > dl > dt")).to_have_text(
            ["metrics", "path", "size", "step", "weight_version"]
        )
        expect(row.locator(".event-details > dl > dd").nth(1)).to_have_text(f"run-{run.pk}/step-5")
        expect(row.locator(".event-details > dl > dd").nth(3)).to_have_text("5")
        fold = row.locator("details.fields-fold")
        expect(fold.locator("summary")).to_have_text("40 fields")
        expect(fold.locator("dt").first).to_be_hidden()
        fold.locator("summary").click()
        expect(fold.locator("dt", has_text="reward/mean")).to_be_visible()
        expect(fold.locator("dt")).to_have_count(40)
        text = page.locator("#events").inner_text()
        assert "{" not in text and "'" not in text  # no dict repr, no JSON
    shot(page, "run-events", page.locator("#section-events"))


def test_checkpoint_rows_show_headline_metrics_and_fold_the_rest(
    server, login_as, in_thread, editor, experiment, submit, shot
):
    run = in_thread(lambda: _running(submit(experiment)))
    token = in_thread(_token, run)
    for step in range(10, 70, 10):
        metrics = {**FORTY, "reward/mean": step / 100, "loss/policy": 0.0123, "eval/accuracy": 0.75}
        if step == 10:
            del metrics["eval/accuracy"]  # not an evaluation step
        body = {"step": step, "path": f"run-{run.pk}/step-{step}", "weight_version": step, "size": 16384}
        _ingest(server, token, "checkpoints", {**body, "metrics": metrics})

    page = login_as(editor)
    page.goto(f"/runs/{run.pk}/checkpoints/")
    rows = page.locator("#checkpoints tbody tr")
    expect(rows).to_have_count(6)
    expect(page.locator("#checkpoints thead th")).to_have_text(
        ["Step", "Weights", "Reward", "Held-out accuracy", "Loss", "Size", "More metrics", "Files", "Pinned", ""]
    )
    newest, oldest = rows.first, rows.last
    expect(newest.locator("td.headline")).to_have_text(["0.6", "0.75", "0.0123"])
    expect(newest.locator("td.weights")).to_have_text("60")
    expect(newest.locator("td.size")).to_have_text("16.0 KiB")
    expect(oldest.locator("td.headline")).to_have_text(["0.1", "—", "0.0123"])
    others = len({*FORTY, "reward/mean", "loss/policy", "eval/accuracy"}) - 3
    expect(newest.locator("details.more-metrics > summary")).to_have_text(f"{others} more")
    expect(newest.locator("details.more-metrics dt").first).to_be_hidden()
    # Six checkpoints of ~40 metrics each: one line per row (it was 5,600 px).
    assert page.locator("#checkpoints").bounding_box()["height"] < 600
    shot(page, "checkpoints-headlines")

    newest.locator("details.more-metrics > summary").click()
    entropy = newest.locator("details.more-metrics dt", has_text="entropy")
    expect(entropy).to_be_visible()
    expect(newest.locator("details.more-metrics dt", has_text="reward/mean")).to_have_count(0)  # shown already

    # A new checkpoint reloads the rows live: the one unfolded stays unfolded.
    _ingest(server, token, "checkpoints", {"step": 70, "path": f"run-{run.pk}/step-70", "metrics": FORTY})
    expect(rows).to_have_count(7)
    expect(rows.first.locator("td.headline")).to_have_text(["0.01", "0.04", "0.05"])  # FORTY's own values
    expect(page.locator("tr[data-checkpoint-id] details[open] dt", has_text="entropy")).to_be_visible()


def test_run_page_sections_have_links_and_remember_being_folded(
    server, login_as, in_thread, editor, experiment, submit, shot
):
    run = in_thread(lambda: _running(submit(experiment)))
    token = in_thread(_token, run)
    _report(server, token, range(1, 4), lambda s: {"reward/mean": 0.1 * s, "lr": 1e-5})
    page = login_as(editor)
    page.goto(f"/runs/{run.pk}/")
    _wait_live(page)

    links = page.locator("#section-nav a")
    hrefs = links.evaluate_all("links => links.map((a) => a.getAttribute('href'))")
    assert hrefs == [
        "#section-controls",
        "#section-commands",
        "#section-metrics",
        "#charts-reward-accuracy",
        "#charts-losses",
        "#charts-pipeline",
        "#charts-throughput-time-split",
        "#charts-communication",
        "#charts-consistency",
        "#section-roles",
        "#section-events",
        "#section-alerts",
        "#section-configs",
        "#section-spec",
    ]
    for href in hrefs:  # every link leads to a foldable section, open at first
        expect(page.locator(f"details[data-section]{href}[open]")).to_have_count(1)
    shot(page, "run-sections", page.locator("#section-nav"))

    # Fold the roles and the loss charts; the page remembers it on the next visit.
    page.locator("#section-roles > summary").click()
    page.locator("#charts-losses > summary").click()
    expect(page.locator("#roles")).to_be_hidden()
    expect(page.locator('.chart[data-title="Learning rate"]')).to_be_hidden()
    page.reload()
    _wait_live(page)
    expect(page.locator("#roles")).to_be_hidden()
    expect(page.locator('.chart[data-title="Learning rate"]')).to_be_hidden()
    expect(page.locator("#events")).to_be_visible()
    expect(page.locator('.chart[data-title="Reward"]')).to_have_attribute("data-points", "3")
    stored = page.evaluate("() => ['roles', 'charts-losses'].map((s) => localStorage.getItem(`tandem.section.${s}`))")
    assert stored == ["closed", "closed"]

    # A section link opens the folded section it leads to; its charts fill the width they get.
    page.click('#section-nav a[href="#section-roles"]')
    expect(page.locator("#roles")).to_be_visible()
    expect(page).to_have_url(re.compile(r"#section-roles$"))
    page.click('#section-nav a[href="#charts-losses"]')
    chart = page.locator('.chart[data-title="Learning rate"]')
    expect(chart).to_be_visible()
    page.wait_for_function(
        """() => {
            const chart = window.tandemCharts.find((c) => c.title === "Learning rate");
            return chart.plot && chart.plot.width === chart.container.clientWidth;
        }"""
    )
    assert page.evaluate("() => localStorage.getItem('tandem.section.charts-losses')") == "open"
