"""The run page's Devices charts in a browser: a device's telemetry arriving while the page is open is charted
live, and a reload lays the same charts out from the server."""

from __future__ import annotations

import time

import pytest
from playwright.sync_api import expect

from tests.e2e.test_live_ui import NO_CHROMIUM, _ingest, _running, _token, _wait_live

pytestmark = [pytest.mark.e2e, NO_CHROMIUM, pytest.mark.django_db(transaction=True)]

UTIL = '.chart[data-title="trainer-0 · cpu: utilisation (%)"]'
MEMORY = '.chart[data-title="trainer-0 · cpu: memory (bytes)"]'


def _device_points(steps) -> dict:
    now = time.time()
    return {
        "role": "trainer-0",
        "points": [
            {
                "step": s,
                "time": now + s,
                "metrics": {
                    "reward/mean": 0.1 * s,
                    "device/trainer-0/cpu/util": 10.0 * s,
                    "device/trainer-0/cpu/mem_used_bytes": 1e9 + s,
                    "device/trainer-0/cpu/mem_peak_bytes": 2e9,
                },
            }
            for s in steps
        ],
    }


def test_device_telemetry_is_charted_live_and_after_a_reload(
    server, login_as, in_thread, editor, experiment, submit, shot
):
    run = in_thread(lambda: _running(submit(experiment)))
    token = in_thread(_token, run)
    page = login_as(editor)
    page.goto(f"/runs/{run.pk}/")
    _wait_live(page)
    expect(page.locator("#charts-devices")).to_have_count(0)  # no telemetry yet: no Devices group

    _ingest(server, token, "metrics", _device_points([1, 2]))
    expect(page.locator(f"#charts-devices {UTIL}")).to_have_attribute("data-points", "2")
    expect(page.locator(f"#charts-devices {MEMORY}")).to_have_attribute("data-points", "4")  # two series
    _ingest(server, token, "metrics", _device_points([3]))
    expect(page.locator(UTIL)).to_have_attribute("data-points", "3")
    expect(page.locator(UTIL)).to_have_count(1)  # charted once, not once per point

    page.reload()
    _wait_live(page)
    expect(page.locator(f"#charts-devices {UTIL}")).to_have_attribute("data-points", "3")
    expect(page.locator(f"#charts-devices {MEMORY}")).to_have_attribute("data-points", "6")
    shot(page, "device-charts", page.locator("#charts-devices"))
