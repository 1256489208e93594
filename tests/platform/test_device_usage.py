"""Device state with the host agent's heartbeat (utilisation, memory; the holder from allocations), shown on the
Cluster page, and the run page's Devices charts from a run's telemetry series."""

from __future__ import annotations

import os

import pytest
from django.utils import timezone

from jobs.models import MetricPoint
from rlplatform import hosts
from rlplatform.inventory import parse_npu_smi_info, parse_nvidia_smi_csv
from rlplatform.models import Device, ResourceGroup
from tests.platform.test_inventory import NPU_910B

pytestmark = pytest.mark.django_db


def _agent(**overrides):
    from rlplatform.agent import AgentConfig, HostAgent

    values = {"host_name": "n1", "group_name": "agent-gpu", "address": "10.0.0.9", "kind": None, "cpu_devices": None}
    values.update(overrides)
    return HostAgent(AgentConfig(**values))


def test_the_parsers_read_utilisation_and_memory_in_use():
    gpus = parse_nvidia_smi_csv("0, GPU-a, NVIDIA L4, 23034, 5120, 0, No, 37\n1, GPU-b, NVIDIA L4, 23034, 0\n")
    assert [(d.util_pct, d.mem_used_mb) for d in gpus] == [(37.0, 5120), (None, 0)]
    assert gpus[0].usage() == {"util_pct": 37.0, "mem_used_mb": 5120}
    npus = parse_npu_smi_info(NPU_910B)
    assert [(d.util_pct, d.mem_used_mb) for d in npus] == [(0.0, 3161), (0.0, 3162), (12.0, 40960), (0.0, 0)]


def test_the_agents_heartbeat_stores_each_devices_usage(tmp_path, monkeypatch):
    ResourceGroup.objects.create(name="agent-gpu", kind="gpu")
    tool = tmp_path / "nvidia-smi"
    tool.write_text(
        '#!/bin/sh\necho "0, GPU-a, NVIDIA L4, 23034, 1024, 0, No, 12"\necho "1, GPU-b, NVIDIA L4, 23034, 0, 0, No, 0"\n'
    )
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    agent = _agent()
    agent.beat()  # registers
    agent.beat()  # heartbeats with the devices' usage
    usage = dict(Device.objects.filter(host__name="n1").values_list("index", "usage"))
    assert {i: {k: v for k, v in u.items() if k != "at"} for i, u in usage.items()} == {
        0: {"util_pct": 12.0, "mem_used_mb": 1024},
        1: {"util_pct": 0.0, "mem_used_mb": 0},
    }
    assert all("at" in u for u in usage.values())


def test_bad_usage_is_refused_naming_the_field(cpu_group):
    with pytest.raises(hosts.HostError, match=r"devices_usage\.0\.util_pct"):
        hosts.heartbeat("cpu-local-h1", None, {"0": {"util_pct": 140}})
    with pytest.raises(hosts.HostError, match=r"devices_usage\.1: expected an object"):
        hosts.heartbeat("cpu-local-h1", None, {"1": {"watts": 3}})


def test_the_cluster_page_shows_each_devices_utilisation_memory_and_holder(client, viewer, experiment, submit):
    run = submit(experiment, 2)  # admitted onto two devices of one host
    held = list(run.allocations.active().select_related("device__host"))
    host = held[0].device.host.name
    hosts.heartbeat(host, None, {a.device.index: {"util_pct": 87.4, "mem_used_mb": 512} for a in held})
    client.force_login(viewer)
    html = client.get("/cluster/").content.decode()
    for a in held:
        row = html.split(f'data-device="{host}:{a.device.index}"', 1)[1].split("</tr>", 1)[0]
        assert "87%" in row and "512 / 1024 MB" in row
        assert f'href="/runs/{run.pk}/">run {run.pk}</a>' in row
    free = next(d for d in Device.objects.filter(host__name=host) if d.pk not in {a.device_id for a in held})
    row = html.split(f'data-device="{host}:{free.index}"', 1)[1].split("</tr>", 1)[0]
    assert "free" in row and "—" in row  # nothing reported for it yet


def test_the_run_page_charts_each_devices_telemetry(client, viewer, experiment, submit):
    run = submit(experiment, 1)
    metrics = {
        "reward/mean": 0.5,
        "device/trainer-0/cpu/util": 40.0,
        "device/trainer-0/cpu/mem_used_bytes": 2.0e9,
        "device/trainer-0/cpu/mem_peak_bytes": 2.5e9,
        "device/trainer-0/cuda0/util": 90.0,
        "device/trainer-0/cuda0/temp_c": 61.0,
    }
    MetricPoint.objects.create(run=run, attempt=1, step=1, time=timezone.now(), metrics=metrics)
    client.force_login(viewer)
    html = client.get(f"/runs/{run.pk}/").content.decode()
    assert 'id="charts-devices"' in html
    assert 'data-title="trainer-0 · cpu: utilisation (%)" data-keys="device/trainer-0/cpu/util"' in html
    assert (
        'data-title="trainer-0 · cpu: memory (bytes)" '
        'data-keys="device/trainer-0/cpu/mem_used_bytes,device/trainer-0/cpu/mem_peak_bytes"' in html
    )
    assert 'data-keys="device/trainer-0/cuda0/temp_c"' in html
    assert "trainer-0 · cuda0: power (W)" not in html  # a field the device never reported gets no chart
    # a run without telemetry has no Devices group
    other = submit(experiment, 1)
    assert 'id="charts-devices"' not in client.get(f"/runs/{other.pk}/").content.decode()
