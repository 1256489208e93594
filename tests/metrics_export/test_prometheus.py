"""A real Prometheus server (Debian's ``prometheus`` package) scrapes /metrics of a real uvicorn.

One job scrapes with a scrape token (its ``authorization`` setting, as README shows), another with an
API token: Prometheus must store the queue depth the database holds from the first, and report the
second target down with the server's 403. Skipped only where /usr/bin/prometheus is absent
(``apt-get install prometheus``); test_platform_state.py checks the same figures through
prometheus_client's parser.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request

import pytest

from rlplatform import tokens
from tests.launch.helpers import wait_for
from tests.metrics_export.conftest import free_port

PROMETHEUS = shutil.which("prometheus")

CONFIG = """
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: tandem
    metrics_path: /metrics
    authorization:
      type: Bearer
      credentials_file: {scrape_token_file}
    static_configs:
      - targets: ["{target}"]
  - job_name: tandem-api-token
    metrics_path: /metrics
    authorization:
      type: Bearer
      credentials: {api_token}
    static_configs:
      - targets: ["{target}"]
"""


@pytest.fixture
def prometheus(tmp_path):
    """start(config text) -> the base URL of a Prometheus server on a free port."""
    if PROMETHEUS is None:
        pytest.skip("no prometheus binary: apt-get install prometheus")
    procs: list[subprocess.Popen] = []

    def start(config: str) -> str:
        (tmp_path / "prometheus.yml").write_text(config)
        port = free_port()
        log_path = tmp_path / "prometheus.log"
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log_path.open("w"),
            stderr=subprocess.STDOUT,
        )
        procs.append(proc)
        base = f"http://127.0.0.1:{port}"
        wait_for(
            lambda: _get_json(f"{base}/-/ready", raw=True) or proc.poll() is not None, "Prometheus", 60, [log_path]
        )
        assert proc.poll() is None, log_path.read_text()[-3000:]
        return base

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _get_json(url: str, raw: bool = False):
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            body = response.read()
    except OSError:
        return None
    return True if raw else json.loads(body)


def _query(base: str, promql: str) -> list[dict]:
    reply = _get_json(f"{base}/api/v1/query?{urllib.parse.urlencode({'query': promql})}")
    return reply["data"]["result"] if reply and reply.get("status") == "success" else []


def test_prometheus_scrapes_the_queue_depth_with_a_scrape_token(
    transactional_db,
    start_server,
    prometheus,
    make_scrape_token,
    make_group,
    make_experiment,
    team_a,
    owner,
    submit,
    tmp_path,
):
    group = make_group("prom-a", hosts=[("h1", 2, "sw1")], teams=[team_a])
    experiment = make_experiment(team_a, group, "exp-prom")
    runs = [submit(experiment, devices=2) for _ in range(4)]  # one admitted, three waiting for its devices
    assert sum(run.state == "QUEUED" for run in runs) == 3
    server = start_server("prometheus-target")
    (tmp_path / "scrape-token").write_text(make_scrape_token())
    _api_token, api_raw = tokens.mint(owner, team_a, "not-for-metrics")
    config = CONFIG.format(
        scrape_token_file=tmp_path / "scrape-token", api_token=api_raw, target=server.removeprefix("http://")
    )
    base = prometheus(config)

    depth = wait_for(
        lambda: _query(base, 'tandem_queue_depth{job="tandem",group="prom-a"}'), "a scraped queue depth", 60
    )
    assert float(depth[0]["value"][1]) == 3
    allocated = _query(base, 'tandem_devices{job="tandem",group="prom-a",status="allocated"}')
    assert float(allocated[0]["value"][1]) == 2

    def refused_target():
        targets = (_get_json(f"{base}/api/v1/targets") or {}).get("data", {}).get("activeTargets", [])
        return [t for t in targets if t["labels"]["job"] == "tandem-api-token" and t["health"] == "down"]

    target = wait_for(refused_target, "the API-token job to be refused", 60)[0]
    assert "403" in target["lastError"]
