"""The whole platform for the run end-to-end tests: a real uvicorn (REST + ingest), a real Celery
worker that is this machine's host agent (Redis broker, embedded beat), real runtime processes.

Both subprocesses use the pytest-django test database (tests are ``transactional_db``: data must be
committed to be seen) and a Redis database of their own, so their tasks never meet another suite's
worker. The test process itself only writes rows and reads them back.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import pytest

from tests.launch.helpers import ROOT, wait_for

E2E_REDIS_DB = 11
GROUP = "e2e-cpu"
START_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _database_url(db: dict) -> str:
    auth = f"{quote(db['USER'])}:{quote(db['PASSWORD'])}@" if db["USER"] else ""
    return f"postgres://{auth}{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


def _redis_url() -> str:
    return urlunsplit(urlsplit(os.environ["REDIS_URL"])._replace(path=f"/{E2E_REDIS_DB}"))


class Platform:
    """The server and the worker; ``stop_server``/``start_server`` take the web process away for a while."""

    def __init__(self, tmp: Path, env: dict[str, str]):
        self.tmp = tmp
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.host_name = f"e2e-{uuid.uuid4().hex[:6]}"
        self.env = {**env, "TANDEM_PLATFORM_URL": self.url}
        self.server_log = tmp / "server.log"
        self.worker_log = tmp / "worker.log"
        self.server: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None

    @property
    def logs(self) -> list[Path]:
        return [self.server_log, self.worker_log]

    def start_server(self) -> None:
        cmd = [sys.executable, "-m", "uvicorn", "rlplatform.asgi:application", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--log-level", "warning"]
        with self.server_log.open("a") as out:
            self.server = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        wait_for(self._serving, "uvicorn to serve", START_S, self.logs)

    def _serving(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/login/", timeout=2) as response:
                return response.status == 200
        except OSError:
            if self.server.poll() is not None:
                pytest.fail(f"uvicorn exited with {self.server.returncode}:\n{self.server_log.read_text()[-3000:]}")
            return False

    def stop_server(self) -> None:
        _stop(self.server)
        self.server = None

    def start_worker(self) -> None:
        env = {
            **self.env,
            "TANDEM_HOST_NAME": self.host_name,
            "TANDEM_HOST_GROUP": GROUP,
            "TANDEM_HOST_DEVICE_KIND": "cpu",
            "TANDEM_CPU_DEVICES": "2",
        }
        cmd = [sys.executable, "-m", "celery", "-A", "rlplatform", "worker", "-B", "-s", str(self.tmp / "beat")]
        cmd += ["--pool", "threads", "--concurrency", "4", "-Q", "default", "-n", f"{self.host_name}@%h"]
        cmd += ["--without-gossip", "--without-mingle", "-l", "INFO"]
        with self.worker_log.open("a") as out:
            self.worker = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def stop_worker(self) -> None:
        _stop(self.worker)
        self.worker = None

    def close(self) -> None:
        _stop(self.worker)
        _stop(self.server)


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def platform(django_db_setup, django_db_blocker, tmp_path_factory):
    from django.conf import settings
    from django.db import connection

    if not os.environ.get("REDIS_URL"):
        pytest.fail("the run end-to-end tests need REDIS_URL (the Celery broker)")
    if connection.vendor != "postgresql":
        pytest.fail("the run end-to-end tests need PostgreSQL (DATABASE_URL=postgres://...)")
    tmp = tmp_path_factory.mktemp("platform")
    import redis

    redis.Redis.from_url(_redis_url()).flushdb()  # no task of an earlier session may reach this worker
    env = {
        **os.environ,
        "DATABASE_URL": _database_url(connection.settings_dict),
        "REDIS_URL": _redis_url(),
        "SECRET_KEY": settings.SECRET_KEY,
        "DEBUG": "false",
        "ALLOWED_HOSTS": "127.0.0.1",
        "TANDEM_CHECKPOINT_ROOT": str(tmp / "runs"),
        "TANDEM_HEARTBEAT_S": "0.5",
        "TANDEM_HOST_GRACE_S": "30",
        "TANDEM_SUPERVISE_S": "0.3",
        "TANDEM_ROLE_HEARTBEAT_S": "0.3",
        "TANDEM_ADMISSION_INTERVAL_S": "1",
        "TANDEM_WATCH_ROLES_S": "1",
        "TANDEM_LAUNCH_TIMEOUT_S": "20",
        "TANDEM_COMMAND_REDELIVER_S": "5",
        "DJANGO_SETTINGS_MODULE": "rlplatform.settings",
    }
    platform = Platform(tmp, env)
    try:
        platform.start_server()
        platform.start_worker()
        yield platform
    finally:
        platform.close()


@pytest.fixture
def cluster(platform, transactional_db, make_user):
    """This machine as a 2-device CPU host (registered by the worker's agent), a team, an experiment,
    and an API token of its owner."""
    from jobs.models import Experiment
    from rlplatform import tokens
    from rlplatform.models import Host, Membership, Quota, ResourceGroup, Role, Team

    team = Team.objects.create(name="e2e")
    owner = make_user("e2e-owner")
    Membership.objects.create(team=team, user=owner, role=Role.ADMIN)
    group = ResourceGroup.objects.create(name=GROUP, kind="cpu")
    group.teams.add(team)
    quota = Quota.objects.create(team=team, group=group, name="e2e", max_devices=2, max_concurrent_runs=2, priority=0)
    experiment = Experiment.objects.create(team=team, name="e2e", group=group, quota=quota, created_by=owner)
    wait_for(
        lambda: Host.objects.filter(name=platform.host_name, status="online", devices__isnull=False).exists(),
        "the worker's agent to register this host",
        START_S,
        platform.logs,
    )
    _token, raw = tokens.mint(owner, team, "e2e")
    yield {"team": team, "owner": owner, "group": group, "experiment": experiment, "token": raw}
    _kill_leftover_roles()


def _kill_leftover_roles() -> None:
    """The tables are emptied after each test: a role still running would be nobody's to stop."""
    from jobs.models import RunRole

    for pid in RunRole.objects.exclude(pid=None).values_list("pid", flat=True):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.fixture
def second_host(platform, cluster, tmp_path):
    """Another host agent on this machine: a worker of its own (queue ``host.<name>``, one CPU device, no
    beat), registered in the cluster's group next to the platform fixture's two-device host."""
    from rlplatform.models import Host

    name = f"{platform.host_name}-b"
    log = tmp_path / "worker-b.log"
    env = {
        **platform.env,
        "TANDEM_HOST_NAME": name,
        "TANDEM_HOST_GROUP": GROUP,
        "TANDEM_HOST_DEVICE_KIND": "cpu",
        "TANDEM_CPU_DEVICES": "1",
        "TANDEM_HOST_ADDRESS": "127.0.0.1",
    }
    cmd = [sys.executable, "-m", "celery", "-A", "rlplatform", "worker", "--pool", "threads", "--concurrency", "2"]
    cmd += ["-Q", f"host.{name}", "-n", f"{name}@%h", "--without-gossip", "--without-mingle", "-l", "INFO"]
    with log.open("a") as out:
        worker = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(
            lambda: Host.objects.filter(name=name, status="online", devices__isnull=False).exists(),
            "the second worker's agent to register its host",
            START_S,
            [*platform.logs, log],
        )
        yield {"name": name, "log": log}
    finally:
        _stop(worker)
