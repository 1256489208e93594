"""Counts made in one web process reach the /metrics of another: prometheus_client's multiprocess mode.

Two uvicorn servers share one PROMETHEUS_MULTIPROC_DIR, as the workers of one web server do. The
ingest API and the command acknowledgements are posted to the ``ingest`` server only; /metrics is read
from the ``scrape`` server only, and read with prometheus_client's parser.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from jobs import commands
from jobs.ingest.tokens import mint_run_token
from jobs.models import CommandKind
from runtime.contract import COMMAND_RESULT_PATH, METRICS_PATH
from tests.metrics_export.helpers import parse, value


@pytest.fixture(scope="module")
def servers(start_server):
    return start_server("scrape"), start_server("ingest")


def _post(url: str, token: str, body: dict) -> int:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _scrape(base: str, token: str):
    request = urllib.request.Request(f"{base}/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return parse(response.read().decode())


@pytest.fixture
def running(transactional_db, experiment, submit, start):
    """A RUNNING run of team A and a run token of its attempt 0."""
    run = start(submit(experiment))
    return run, mint_run_token(run, 0)


def test_ingest_in_another_process_is_counted(servers, running, make_scrape_token):
    scrape_base, ingest_base = servers
    run, run_token = running
    scrape_token = make_scrape_token()
    before = _scrape(scrape_base, scrape_token)

    def points(name: str) -> float:
        return value(_scrape(scrape_base, scrape_token), "tandem_ingest_points_total", outcome=name) - value(
            before, "tandem_ingest_points_total", outcome=name
        )

    batch = {"run": run.pk, "attempt": 0, "role": "trainer-0", "points": []}
    batch["points"] = [{"step": step, "metrics": {"loss": 1.0 / step}} for step in (1, 2, 3)]
    assert _post(f"{ingest_base}{METRICS_PATH}", run_token, batch) == 200
    assert [points("inserted"), points("merged"), points("unchanged")] == [3, 0, 0]
    assert _post(f"{ingest_base}{METRICS_PATH}", run_token, batch) == 200  # a replay
    assert [points("inserted"), points("merged"), points("unchanged")] == [3, 0, 3]

    def rejected(status: str) -> float:
        now = value(_scrape(scrape_base, scrape_token), "tandem_ingest_rejected_batches_total", 0.0, status=status)
        return now - value(before, "tandem_ingest_rejected_batches_total", 0.0, status=status)

    bad = {**batch, "points": [{"step": "one", "metrics": {}}]}
    assert _post(f"{ingest_base}{METRICS_PATH}", run_token, bad) == 400
    assert _post(f"{ingest_base}{METRICS_PATH}", "tdr_00000000_unknown", batch) == 401
    assert [rejected("400"), rejected("401")] == [1, 1]


def test_a_command_acknowledged_in_another_process_is_timed(servers, running, make_scrape_token, owner):
    scrape_base, ingest_base = servers
    run, run_token = running
    scrape_token = make_scrape_token()
    labels = {"kind": "pause", "result": "done"}
    before = value(_scrape(scrape_base, scrape_token), "tandem_command_ack_seconds_count", 0.0, **labels)
    command = commands.create(owner, run, CommandKind.PAUSE)
    ack = {"run": run.pk, "attempt": 0, "command": command.pk, "state": "done"}
    assert _post(f"{ingest_base}{COMMAND_RESULT_PATH}", run_token, ack) == 200
    assert _post(f"{ingest_base}{COMMAND_RESULT_PATH}", run_token, ack) == 200  # a retried ack: counted once
    samples = _scrape(scrape_base, scrape_token)
    assert value(samples, "tandem_command_ack_seconds_count", **labels) == before + 1
    assert value(samples, "tandem_command_ack_seconds_bucket", **labels, le="+Inf") >= before + 1
    assert 0 <= value(samples, "tandem_command_ack_seconds_sum", **labels) < 60
