"""The host agent in a real ``celery -A rlplatform worker`` process (Redis broker, PostgreSQL).

Plus the agent's configuration from the environment, which needs no worker.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import pytest
import redis
from django.core.exceptions import ImproperlyConfigured
from django.db import connection

from rlplatform.agent import config_from_env, parse_labels
from rlplatform.models import Device, Host, ResourceGroup

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 25.0  # ceiling for the worker to start and report, on a loaded 2-core machine
# The worker gets a Redis database of its own, so the admission pass its agent queues on "default"
# is read back here and never reaches another engineer's worker on the shared server.
AGENT_REDIS_DB = 13


def test_config_from_env(monkeypatch):
    monkeypatch.delenv("TANDEM_HOST_NAME", raising=False)
    assert config_from_env() is None  # a plain worker: no agent
    monkeypatch.setenv("TANDEM_HOST_NAME", "npu-01")
    monkeypatch.delenv("TANDEM_HOST_GROUP", raising=False)
    with pytest.raises(ImproperlyConfigured, match="TANDEM_HOST_GROUP is required when TANDEM_HOST_NAME is set"):
        config_from_env()
    monkeypatch.setenv("TANDEM_HOST_GROUP", "ascend")
    monkeypatch.setenv("TANDEM_HOST_LABELS", "rack=r1, switch = s2")
    monkeypatch.setenv("TANDEM_HOST_ADDRESS", "10.1.2.3")
    monkeypatch.setenv("TANDEM_HOST_DEVICE_KIND", "npu")
    config = config_from_env()
    assert (config.host_name, config.group_name, config.address, config.kind, config.queue) == (
        "npu-01",
        "ascend",
        "10.1.2.3",
        "npu",
        "host.npu-01",
    )
    assert config.labels == {"rack": "r1", "switch": "s2"}
    monkeypatch.setenv("TANDEM_HOST_DEVICE_KIND", "tpu")
    with pytest.raises(ImproperlyConfigured, match="TANDEM_HOST_DEVICE_KIND='tpu' is not one of npu, gpu, cpu"):
        config_from_env()


def test_bad_labels_name_the_variable():
    assert parse_labels("") == {}
    with pytest.raises(ImproperlyConfigured, match="TANDEM_HOST_LABELS: 'switch' is not key=value"):
        parse_labels("rack=r1,switch")


def _test_database_url() -> str:
    db = connection.settings_dict  # pytest-django points this at the test database (test_<name>)
    auth = f"{quote(db['USER'])}:{quote(db['PASSWORD'])}@" if db["USER"] else ""
    return f"postgres://{auth}{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


def _agent_redis_url() -> str:
    parts = urlsplit(os.environ["REDIS_URL"])
    return urlunsplit(parts._replace(path=f"/{AGENT_REDIS_DB}"))


def _queued_task_names(client, queue: str) -> list[str]:
    return [json.loads(message)["headers"]["task"] for message in client.lrange(queue, 0, -1)]


def _wait_for(condition, what: str, log: Path):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"the worker did not {what} within {WAIT_S:g} s; its log:\n{log.read_text()[-4000:]}")


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs the Redis broker: set REDIS_URL")
@pytest.mark.django_db(transaction=True)
def test_worker_registers_its_host_and_heartbeats(tmp_path):
    if connection.vendor != "postgresql":
        pytest.skip("a worker process cannot share an SQLite test database; set DATABASE_URL to PostgreSQL")
    name = f"agent-{uuid.uuid4().hex[:8]}"  # its own queue, so no other worker on this broker takes its work
    env = {
        **os.environ,
        "DATABASE_URL": _test_database_url(),
        "REDIS_URL": _agent_redis_url(),
        "SECRET_KEY": "agent-test",
        "TANDEM_HOST_NAME": name,
        "TANDEM_HOST_GROUP": "agent-test",
        "TANDEM_HOST_ADDRESS": "192.0.2.7",
        "TANDEM_HOST_LABELS": "rack=r9,switch=sw9",
        "TANDEM_HOST_DEVICE_KIND": "cpu",
        "TANDEM_CPU_DEVICES": "3",
        "TANDEM_HEARTBEAT_S": "0.5",
    }
    broker = redis.Redis.from_url(_agent_redis_url())
    broker.delete("default")
    log = tmp_path / "worker.log"
    command = [sys.executable, "-m", "celery", "-A", "rlplatform", "worker", "--pool", "solo", "-n", f"{name}@%h"]
    # -Q names only a queue nobody uses: the agent itself must add host.<name>.
    command += ["-Q", f"idle.{name}", "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO"]
    with log.open("w") as out:
        worker = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        # Started before its group exists: the agent keeps retrying instead of giving up.
        _wait_for(lambda: "registration refused: group: no resource group named" in log.read_text(), "try", log)
        ResourceGroup.objects.create(name="agent-test", kind="cpu")
        host = _wait_for(lambda: Host.objects.filter(name=name).first(), "register its host", log)
        assert (host.group.name, host.address, host.queue, host.status) == (
            "agent-test",
            "192.0.2.7",
            f"host.{name}",
            "online",
        )
        assert host.labels == {"rack": "r9", "switch": "sw9"}
        assert list(Device.objects.filter(host=host).values_list("index", "kind", "healthy")) == [
            (0, "cpu", True),
            (1, "cpu", True),
            (2, "cpu", True),
        ]
        # A new host is new capacity: its agent queued an admission pass for the platform's workers.
        assert _wait_for(lambda: _queued_task_names(broker, "default"), "queue admission", log) == [
            "jobs.tasks.admit_pending"
        ]
        first = host.last_heartbeat
        later = _wait_for(
            lambda: (
                Host.objects.filter(name=name, last_heartbeat__gt=first)
                .values_list("last_heartbeat", flat=True)
                .first()
            ),
            "heartbeat",
            log,
        )
        _wait_for(
            lambda: Host.objects.filter(name=name, last_heartbeat__gt=later).exists(), "heartbeat a second time", log
        )
        # The agent added its host queue to those the worker consumes (the start-up banner lists them).
        assert f".> host.{name} " in log.read_text()
    finally:
        worker.send_signal(signal.SIGTERM)  # warm shutdown: the agent marks its host offline
        try:
            worker.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        broker.delete("default")
    assert worker.returncode == 0, log.read_text()[-4000:]
    assert Host.objects.get(name=name).status == "offline"


def test_misconfigured_agent_stops_the_worker(tmp_path):
    env = {**os.environ, "TANDEM_VAR_DIR": str(tmp_path), "SECRET_KEY": "agent-test", "TANDEM_HOST_NAME": "n1"}
    env.pop("TANDEM_HOST_GROUP", None)
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "rlplatform",
        "worker",
        "--pool",
        "solo",
        "-Q",
        "idle.misconfigured",
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "host agent: environment variable TANDEM_HOST_GROUP is required when TANDEM_HOST_NAME is set" in done.stderr


# --- the agent's heartbeat step, in this process -------------------------------------------


def _agent(**overrides):
    from rlplatform.agent import AgentConfig, HostAgent

    values = {"host_name": "n1", "group_name": "agent-test", "address": "10.0.0.9", "kind": "cpu", "cpu_devices": 2}
    values.update(overrides)
    return HostAgent(AgentConfig(**values))


def _indices(name):
    return list(Device.objects.filter(host__name=name).order_by("index").values_list("index", "healthy"))


@pytest.mark.django_db
def test_agent_registers_first_then_heartbeats():
    agent = _agent()
    agent.beat()  # no group yet: refused, logged, retried on the next beat
    assert (agent.registered, Host.objects.filter(name="n1").exists()) == (False, False)
    ResourceGroup.objects.create(name="agent-test", kind="cpu")
    agent.beat()
    assert agent.registered is True
    assert _indices("n1") == [(0, True), (1, True)]
    Host.objects.filter(name="n1").update(last_heartbeat=None)
    agent.beat()
    assert Host.objects.get(name="n1").last_heartbeat is not None


@pytest.mark.django_db
def test_agent_registers_again_when_forgotten_or_a_device_appears():
    ResourceGroup.objects.create(name="agent-test", kind="cpu")
    agent = _agent()
    agent.beat()
    Host.objects.filter(name="n1").delete()  # an operator removed the host
    agent.beat()
    assert _indices("n1") == [(0, True), (1, True)]
    grown = _agent(cpu_devices=3)
    grown.registered = True
    grown.beat()  # the heartbeat reports index 2, which the platform does not know: register it
    assert _indices("n1") == [(0, True), (1, True), (2, True)]


@pytest.mark.django_db
def test_agent_probe_failure_reports_liveness_and_keeps_health(tmp_path, monkeypatch):
    ResourceGroup.objects.create(name="agent-gpu", kind="gpu")
    tool = tmp_path / "nvidia-smi"
    tool.write_text(
        '#!/bin/sh\necho "0, GPU-a, NVIDIA L4, 23034, 0, 0, No"\necho "1, GPU-b, NVIDIA L4, 23034, 0, 0, No"\n'
    )
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    agent = _agent(group_name="agent-gpu", kind=None, cpu_devices=None)
    agent.beat()
    assert (agent.kind, _indices("n1")) == ("gpu", [(0, True), (1, True)])
    Host.objects.filter(name="n1").update(last_heartbeat=None)
    tool.write_text('#!/bin/sh\necho "NVIDIA-SMI has failed" >&2\nexit 9\n')
    agent.beat()
    # Alive, and the devices' health is untouched: a hung tool is not a failed GPU.
    assert Host.objects.get(name="n1").last_heartbeat is not None
    assert _indices("n1") == [(0, True), (1, True)]
    tool.write_text('#!/bin/sh\necho "0, GPU-a, NVIDIA L4, 23034, 0, 3, No"\n')
    agent.beat()  # GPU 0 has ECC errors, GPU 1 fell off the bus
    assert _indices("n1") == [(0, False), (1, False)]
