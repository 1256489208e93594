"""A host agent (a real ``celery -A rlplatform worker`` with its role supervisor: prefork pool, Redis broker,
PostgreSQL, as deployed) ends on SIGTERM, and on a second SIGTERM during its warm shutdown, within 10 s, by
itself (rlplatform.shutdown's exit guard never had to end it), with its host offline; also when the signals
reach its pool processes too (a process-group kill, a service manager). `make demo`'s worker, on the
embedded defaults: tests/platform/test_demo_shutdown.py."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from django.db import connection

from rlplatform import shutdown
from rlplatform.models import Host, ResourceGroup
from tests.platform.test_agent_worker import _test_database_url
from tests.platform.worker_sigterm import ROOT, sigterm_worker

EXIT_S = 10.0  # the bound the issue sets on a host agent's shutdown
AGENT_REDIS_DB = 12  # a database of its own: nothing queued here reaches another test's worker

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs the Redis broker: set REDIS_URL"),
    pytest.mark.django_db(transaction=True),
]


def _redis_url() -> str:
    return urlunsplit(urlsplit(os.environ["REDIS_URL"])._replace(path=f"/{AGENT_REDIS_DB}"))


@pytest.mark.parametrize(
    ("to_group", "sigterms"),
    [(False, 1), (False, 2), (True, 2)],
    ids=["one SIGTERM", "two SIGTERMs", "two SIGTERMs to its process group"],
)
def test_the_host_agent_ends_within_seconds_on_sigterm_and_marks_its_host_offline(tmp_path, to_group, sigterms):
    if connection.vendor != "postgresql":
        pytest.skip("a worker process cannot share an SQLite test database; set DATABASE_URL to PostgreSQL")
    name = f"stop-{uuid.uuid4().hex[:8]}"
    ResourceGroup.objects.create(name="stop-test", kind="cpu")
    env = {
        **os.environ,
        "DATABASE_URL": _test_database_url(),
        "REDIS_URL": _redis_url(),
        "SECRET_KEY": "agent-test",
        "TANDEM_HOST_NAME": name,
        "TANDEM_HOST_GROUP": "stop-test",
        "TANDEM_HOST_DEVICE_KIND": "cpu",
        "TANDEM_CPU_DEVICES": "2",
        "TANDEM_HEARTBEAT_S": "0.5",
        "TANDEM_SUPERVISE_S": "0.3",
        "TANDEM_CHECKPOINT_ROOT": str(tmp_path / "runs"),
    }
    log = tmp_path / "worker.log"
    command = [sys.executable, "-m", "celery", "-A", "rlplatform", "worker", "--concurrency", "2"]
    command += ["-n", f"{name}@%h", "-Q", f"idle.{name}", "--without-gossip", "--without-mingle", "-l", "INFO"]
    try:
        worker = sigterm_worker(
            command,
            env,
            log,
            lambda: Host.objects.filter(name=name, status="online").exists(),
            to_group=to_group,
            sigterms=sigterms,
            exit_s=EXIT_S,
        )
    finally:
        redis.Redis.from_url(_redis_url()).flushdb()
    text = log.read_text()
    assert worker.returncode == 0, text[-4000:]
    assert f"host agent {name}: host marked offline" in text
    assert "threads left" not in text, text[-4000:]  # it exited by itself, not by the exit guard
    assert Host.objects.get(name=name).status == "offline"


@pytest.mark.django_db(transaction=False)
def test_the_exit_guard_ends_a_process_whose_exit_a_stuck_thread_holds_and_names_the_thread():
    code = (
        "import logging, threading; logging.basicConfig();"
        "from rlplatform import shutdown;"
        "threading.Thread(target=threading.Event().wait, name='stuck-reader').start();"
        "shutdown.arm_exit_guard()"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "rlplatform.settings", "SECRET_KEY": "guard-test"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert "threads left: stuck-reader (non-daemon)" in done.stderr


@pytest.mark.django_db(transaction=False)
def test_bounded_gives_up_on_a_call_that_hangs_and_returns_what_a_quick_one_returns():
    hang = threading.Event()
    assert shutdown.bounded(hang.wait, 0.2, "hang") is None
    hang.set()
    assert shutdown.bounded(lambda: "marked", 5.0, "quick") == "marked"
