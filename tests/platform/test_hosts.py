"""Host registration, heartbeats and the lost-host watchdog, against the real database and admission."""

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from jobs.models import Allocation
from jobs.states import RunState
from rlplatform import hosts, tasks
from rlplatform.inventory import DeviceInfo
from rlplatform.models import Device, Host, HostStatus, ResourceGroup

pytestmark = pytest.mark.django_db
ROOT = Path(__file__).resolve().parents[2]


def cpus(n, *, memory=1024, unhealthy=()):
    return [DeviceInfo(i, "cpu", "x86-64", memory, i not in unhealthy) for i in range(n)]


@pytest.fixture
def group(team_a):
    group = ResourceGroup.objects.create(name="agents", kind="cpu", device_model="x86-64")
    group.teams.set([team_a])
    return group


@pytest.fixture
def eager_celery():
    """Tasks queued by the handlers run in this process (jobs.tasks.admit_pending among them)."""
    import jobs.tasks  # noqa: F401 (registers jobs.tasks.admit_pending with the app)
    from rlplatform.celery import app

    old = app.conf.task_always_eager
    app.conf.task_always_eager = True
    yield app
    app.conf.task_always_eager = old


def _devices(name):
    return list(Device.objects.filter(host__name=name).order_by("index").values_list("index", "memory_mb", "healthy"))


def _age(name, seconds):
    """Pretend the host's last heartbeat was ``seconds`` ago."""
    Host.objects.filter(name=name).update(last_heartbeat=timezone.now() - timedelta(seconds=seconds))


def _state(run):
    run.refresh_from_db()
    return run.state, run.reason


# --- registration -------------------------------------------------------------------


def test_register_creates_host_and_devices(group):
    result = hosts.register_host(
        "n1", "agents", address="10.0.0.1", labels={"switch": "sw1", "rack": 3}, devices=cpus(2)
    )
    host = Host.objects.get(name="n1")
    assert (result.created, result.added, result.updated, result.vanished) == (True, [0, 1], [], [])
    assert (host.group_id, host.address, host.queue, host.status) == (group.pk, "10.0.0.1", "host.n1", "online")
    assert host.labels == {"switch": "sw1", "rack": "3"}
    assert host.last_heartbeat is not None
    assert _devices("n1") == [(0, 1024, True), (1, 1024, True)]


def test_register_again_is_idempotent(group):
    first = hosts.register_host("n1", "agents", devices=cpus(2))
    pks = list(Device.objects.filter(host__name="n1").values_list("pk", flat=True))
    again = hosts.register_host("n1", "agents", devices=[d.as_dict() for d in cpus(2)])
    assert (again.host_id, again.created, again.added, again.updated, again.vanished) == (
        first.host_id,
        False,
        [],
        [],
        [],
    )
    assert list(Device.objects.filter(host__name="n1").values_list("pk", flat=True)) == pks
    assert Host.objects.count() == 1


def test_vanished_devices_are_marked_unhealthy_not_deleted(group, make_experiment, team_a, submit):
    hosts.register_host("n1", "agents", devices=cpus(3))
    exp = make_experiment(team_a, group, "e")
    run = submit(exp, 3)
    assert run.state == RunState.ADMITTED
    # The device at index 2 disappears, index 0 got more memory, index 3 is new.
    result = hosts.register_host("n1", "agents", devices=[*cpus(2, memory=2048)[:1], *cpus(2)[1:], cpus(4)[3]])
    assert (result.added, result.updated, result.vanished) == ([3], [0], [2])
    assert _devices("n1") == [(0, 2048, True), (1, 1024, True), (2, 1024, False), (3, 1024, True)]
    # The running run's allocation still points at the vanished device.
    assert sorted(Allocation.objects.active().filter(run=run).values_list("device__index", flat=True)) == [0, 1, 2]


def test_register_refusals_name_the_field_and_write_nothing(group):
    ResourceGroup.objects.create(name="gpus", kind="gpu")
    hosts.register_host("n1", "agents", devices=cpus(1))
    before = (list(Host.objects.values_list("name", "group_id", "status")), _devices("n1"))
    cases = [
        (("n2", "nope", cpus(1)), "group: no resource group named 'nope'"),
        (
            ("n2", "agents", [DeviceInfo(0, "gpu")]),
            "devices[0].kind: the host reports gpu devices but group agents holds cpu",
        ),
        (("n1", "gpus", []), "group: host n1 belongs to group agents, not gpus"),
        (("n2", "agents", [cpus(1)[0], cpus(1)[0]]), "devices[1].index: index 0 is listed twice"),
        (("n2", "agents", [{"index": "0", "kind": "cpu"}]), "devices[0].index: expected a non-negative integer"),
        (("", "agents", []), "name: expected a host name"),
    ]
    for (name, group_name, devices), message in cases:
        with pytest.raises(hosts.HostError) as error:
            hosts.register_host(name, group_name, devices=devices)
        assert str(error.value).startswith(message)
    with pytest.raises(hosts.HostError, match="labels.switch: expected a string"):
        hosts.register_host("n2", "agents", labels={"switch": ["a"]})
    assert (list(Host.objects.values_list("name", "group_id", "status")), _devices("n1")) == before


def test_registration_revives_lost_and_offline_hosts_but_keeps_draining(group):
    for name, status in (("lost", HostStatus.LOST), ("off", HostStatus.OFFLINE), ("drain", HostStatus.DRAINING)):
        hosts.register_host(name, "agents", devices=cpus(1))
        Host.objects.filter(name=name).update(status=status)
        assert hosts.register_host(name, "agents", devices=cpus(1)).came_online is (status != HostStatus.DRAINING)
    assert dict(Host.objects.values_list("name", "status")) == {"lost": "online", "off": "online", "drain": "draining"}


# --- heartbeats and the watchdog ---------------------------------------------------------


def test_heartbeat_updates_time_and_device_health(group):
    hosts.register_host("n1", "agents", devices=cpus(3))
    _age("n1", 30)
    old = Host.objects.get(name="n1").last_heartbeat
    beat = hosts.heartbeat("n1", {"0": True, "1": False, "7": True})  # JSON keys; index 2 missing
    assert (beat.came_back, beat.health_changed, beat.unknown_indices) == (False, [1, 2], [7])
    assert Host.objects.get(name="n1").last_heartbeat > old
    assert _devices("n1") == [(0, 1024, True), (1, 1024, False), (2, 1024, False)]
    # Liveness only (the probe failed): health stays as it was.
    assert hosts.heartbeat("n1", None).health_changed == []
    assert _devices("n1") == [(0, 1024, True), (1, 1024, False), (2, 1024, False)]
    # Recovered devices become healthy again.
    assert hosts.heartbeat("n1", {0: True, 1: True, 2: True}).health_changed == [1, 2]


def test_heartbeat_refusals(group):
    with pytest.raises(hosts.UnknownHost, match="host: no host named 'ghost' is registered"):
        hosts.heartbeat("ghost")
    hosts.register_host("n1", "agents", devices=cpus(1))
    with pytest.raises(hosts.HostError, match="devices_health: key 'x' is not a device index"):
        hosts.heartbeat("n1", {"x": True})
    with pytest.raises(hosts.HostError, match="devices_health.0: expected true or false"):
        hosts.heartbeat("n1", {"0": "ok"})
    assert _devices("n1") == [(0, 1024, True)]


def test_watchdog_marks_only_silent_online_hosts_lost(group, cpu_group):
    for name in ("fresh", "silent", "draining"):
        hosts.register_host(name, "agents", devices=cpus(1))
    _age("silent", 120)
    _age("draining", 120)
    Host.objects.filter(name="draining").update(status=HostStatus.DRAINING)
    # cpu_group's hosts were created by hand and never heartbeated: not watched.
    assert hosts.mark_lost_hosts(60) == ["silent"]
    statuses = dict(Host.objects.values_list("name", "status"))
    assert statuses["silent"] == "lost"
    assert [statuses[n] for n in ("fresh", "draining", "cpu-local-h1", "cpu-local-h2")] == [
        "online",
        "draining",
        "online",
        "online",
    ]
    assert hosts.mark_lost_hosts(60) == []  # already lost: nothing more happens
    with pytest.raises(hosts.HostError, match="grace_s: expected a positive number"):
        hosts.mark_lost_hosts(0)


def test_heartbeat_brings_a_lost_host_back_and_a_fresh_one_is_never_lost(group):
    hosts.register_host("n1", "agents", devices=cpus(1))
    _age("n1", 120)
    assert hosts.mark_lost_hosts(60) == ["n1"]
    beat = hosts.heartbeat("n1")
    assert beat.came_back is True
    assert Host.objects.get(name="n1").status == "online"
    # The heartbeat moved the clock: the watchdog now leaves it alone.
    assert hosts.mark_lost_hosts(60) == []
    assert hosts.heartbeat("n1").came_back is False


def test_clean_stop_marks_offline_only_online_hosts(group):
    hosts.register_host("n1", "agents", devices=cpus(1))
    hosts.register_host("n2", "agents", devices=cpus(1))
    Host.objects.filter(name="n2").update(status=HostStatus.DRAINING)
    assert (hosts.mark_offline("n1"), hosts.mark_offline("n2")) == (True, False)
    assert dict(Host.objects.values_list("name", "status")) == {"n1": "offline", "n2": "draining"}


# --- admission sees it ------------------------------------------------------------------


def test_lost_host_devices_leave_admission_and_come_back(
    group, make_experiment, team_a, submit, eager_celery, django_capture_on_commit_callbacks
):
    hosts.register_host("n1", "agents", labels={"switch": "sw1"}, devices=cpus(2))
    hosts.register_host("n2", "agents", labels={"switch": "sw1"}, devices=cpus(2))
    exp = make_experiment(team_a, group, "e")
    holder = submit(exp, 2)
    [holder_host] = set(Allocation.objects.filter(run=holder).values_list("device__host__name", flat=True))
    other = "n2" if holder_host == "n1" else "n1"

    _age(other, 120)
    with django_capture_on_commit_callbacks(execute=True):
        assert tasks.mark_lost_hosts() == [other]
    waiting = submit(exp, 2)
    # The lost host's two free devices are not offered: the run waits, naming the free devices.
    assert _state(waiting) == (RunState.QUEUED, "no free cpu devices in group agents (need 2, free 0)")
    assert Allocation.objects.filter(run=waiting).count() == 0

    # The host heartbeats again: it is online, and the admission pass it queues admits the run there.
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        result = tasks.host_heartbeat(other, {"0": True, "1": True})
    assert result == {"came_back": True, "health_changed": [], "unknown": []}
    # Nothing is admitted inside the heartbeat's transaction: the admission pass runs after commit.
    assert _state(waiting)[0] == RunState.QUEUED
    for callback in callbacks:
        callback()
    assert _state(waiting) == (RunState.ADMITTED, "")
    assert sorted(
        Allocation.objects.active().filter(run=waiting).values_list("device__host__name", "device__index")
    ) == [
        (other, 0),
        (other, 1),
    ]


def test_losing_a_host_refreshes_the_reason_of_queued_runs(
    group, make_experiment, team_a, submit, eager_celery, django_capture_on_commit_callbacks
):
    hosts.register_host("n1", "agents", devices=cpus(2))
    hosts.register_host("n2", "agents", devices=cpus(2))
    exp = make_experiment(team_a, group, "e")
    holder = submit(exp, 2)
    waiting = submit(exp, 3)
    assert _state(waiting) == (RunState.QUEUED, "no free cpu devices in group agents (need 3, free 2)")
    [holder_host] = set(Allocation.objects.filter(run=holder).values_list("device__host__name", flat=True))
    _age("n2" if holder_host == "n1" else "n1", 120)
    with django_capture_on_commit_callbacks(execute=True):
        tasks.mark_lost_hosts()
    assert _state(waiting) == (RunState.QUEUED, "needs 3 devices; group agents has 2 healthy devices on online hosts")


def test_unhealthy_device_reported_by_heartbeat_leaves_admission(group, make_experiment, team_a, submit):
    hosts.register_host("n1", "agents", devices=cpus(2))
    hosts.heartbeat("n1", {0: True, 1: False})
    exp = make_experiment(team_a, group, "e")
    waiting = submit(exp, 2)
    assert _state(waiting) == (RunState.QUEUED, "needs 2 devices; group agents has 1 healthy devices on online hosts")


def test_register_task_takes_json_and_queues_admission(group, eager_celery, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        result = tasks.register_host("n1", "agents", devices=[{"index": 0, "kind": "cpu", "memory_mb": 512}])
    assert result == {"host_id": Host.objects.get(name="n1").pk, "created": True, "added": [0], "updated": [],
                      "vanished": [], "came_online": False}  # fmt: skip
    assert len(callbacks) == 1
    assert _devices("n1") == [(0, 512, True)]


def test_beat_schedule_runs_the_watchdog(settings):
    entry = settings.CELERY_BEAT_SCHEDULE["mark-lost-hosts"]
    assert entry == {"task": "rlplatform.tasks.mark_lost_hosts", "schedule": settings.TANDEM_HEARTBEAT_S}


def test_grace_shorter_than_two_heartbeats_stops_start_up():
    env = {**os.environ, "TANDEM_HEARTBEAT_S": "10", "TANDEM_HOST_GRACE_S": "15", "DEBUG": "true"}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import django, os; os.environ['DJANGO_SETTINGS_MODULE']='rlplatform.settings'; django.setup()",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert "TANDEM_HOST_GRACE_S=15 must be at least twice TANDEM_HEARTBEAT_S=10" in done.stderr
