"""Fixtures of the /metrics tests: scrape tokens, and real uvicorn servers sharing a multiprocess directory.

The servers are subprocesses on the pytest-django test database (tests using them need
``transactional_db``: data must be committed to be seen there), each started with
``PROMETHEUS_MULTIPROC_DIR`` set to one fresh directory of this module, as two uvicorn workers of one
web server share theirs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.launch.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def make_scrape_token(db, make_user):
    """make_scrape_token(name="prometheus") -> the plaintext of a new scrape token minted by a staff user."""
    from rlplatform import scrape_tokens

    staff = make_user("metrics-staff", is_staff=True)

    def make(name: str = "prometheus") -> str:
        return scrape_tokens.mint(name, created_by=staff)[1]

    return make


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _database_url(settings_dict: dict) -> str:
    return (
        f"postgres://{settings_dict['USER']}:{settings_dict['PASSWORD']}@{settings_dict['HOST'] or '127.0.0.1'}"
        f":{settings_dict['PORT'] or 5432}/{settings_dict['NAME']}"
    )


def _up(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/login/", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def metrics_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("prometheus-multiproc")


@pytest.fixture(scope="module")
def start_server(django_db_setup, metrics_dir, tmp_path_factory):
    """start_server(name) -> base URL of a new uvicorn on rlplatform.asgi, the test database and ``metrics_dir``."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.fail("the /metrics server tests need PostgreSQL (DATABASE_URL=postgres://...)")
    started: list[tuple[subprocess.Popen, object]] = []
    logs = tmp_path_factory.mktemp("server-logs")

    def start(name: str) -> str:
        port = free_port()
        env = {
            **os.environ,
            "DATABASE_URL": _database_url(connection.settings_dict),
            "DEBUG": "false",
            "SECRET_KEY": "metrics-test-server",
            "ALLOWED_HOSTS": "127.0.0.1",
            "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
            "DJANGO_SETTINGS_MODULE": "rlplatform.settings",
        }
        log_path = logs / f"{name}.log"
        log = open(log_path, "w")
        cmd = [sys.executable, "-m", "uvicorn", "rlplatform.asgi:application", "--host", "127.0.0.1"]
        proc = subprocess.Popen(
            [*cmd, "--port", str(port), "--no-access-log"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        started.append((proc, log))
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _up(base) or proc.poll() is not None, f"uvicorn {name} to start", 60, [log_path])
        if proc.poll() is not None:
            pytest.fail(f"uvicorn {name} exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        return base

    yield start
    for proc, log in started:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
