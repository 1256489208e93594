"""Device telemetry (runtime/telemetry.py): a real psutil sample of this process, NVML and NPU logic on injected
fakes (not yet run on hardware), the spec field, and a tiny run writing device metrics into metrics.jsonl."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from runtime.contract import (
    DEVICE_HOST_MEM_TOTAL,
    DEVICE_HOST_MEM_USED,
    DEVICE_MEM_PEAK,
    DEVICE_MEM_USED,
    DEVICE_METRICS,
    DEVICE_POWER,
    DEVICE_TEMP,
    DEVICE_UTIL,
    device_metric,
    split_device_metric,
)
from runtime.devices import visible_indices
from runtime.metrics import METRICS_FILE, MultiReporter, read_jsonl
from runtime.pipeline import run
from runtime.spec import SpecError, load_spec
from runtime.telemetry import (
    CpuSampler,
    NpuSampler,
    NvmlSampler,
    Telemetry,
    TelemetryReporter,
    parse_npu_smi_common,
    role_name,
)
from tests.runtime.helpers import TINY, derived, tiny_spec

# ---------------------------------------------------------------------------------------------- names


def test_device_metric_names_round_trip_and_every_field_has_a_meaning():
    name = device_metric("rollout-1", "cuda0", DEVICE_UTIL)
    assert name == "device/rollout-1/cuda0/util"
    assert split_device_metric(name) == ("rollout-1", "cuda0", "util")
    assert split_device_metric("reward/mean") is None
    assert split_device_metric("device/trainer-0/cpu/nonsense") is None
    assert all(v.endswith(".") and "\n" not in v for v in DEVICE_METRICS.values())
    with pytest.raises(ValueError, match="not a device metric field"):
        device_metric("trainer-0", "cpu", "watts")


def test_the_role_is_the_platforms_or_trainer_0():
    assert role_name({"TANDEM_ROLE": "evaluator"}) == "evaluator"
    assert role_name({}) == "trainer-0"


# ---------------------------------------------------------------------------------------------- cpu


def test_a_real_cpu_sample_of_this_process_is_plausible():
    sampler = CpuSampler()
    sum(i * i for i in range(200_000))  # some CPU time for the share to measure
    cpu = sampler.sample()["cpu"]
    assert cpu[DEVICE_MEM_USED] > 10 * 2**20  # a Python process with torch loaded holds more than 10 MiB
    assert cpu[DEVICE_MEM_PEAK] >= cpu[DEVICE_MEM_USED]
    assert cpu[DEVICE_HOST_MEM_TOTAL] > cpu[DEVICE_HOST_MEM_USED] > 0
    assert cpu[DEVICE_HOST_MEM_USED] >= cpu[DEVICE_MEM_USED] * 0.5  # the host holds at least this process
    assert 0 <= cpu[DEVICE_UTIL] <= 100


# ---------------------------------------------------------------------------------------------- nvidia (fake)


class FakeNvml:
    """What NvmlSampler calls of pynvml, with two GPUs: the second has no power reading (NotSupported)."""

    NVML_TEMPERATURE_GPU = 0

    class NVMLError(Exception):
        pass

    def __init__(self):
        self.inits = 0
        self.used = {0: 1000, 1: 5000}
        self.uuids = {"GPU-aaaa": 0, "GPU-bbbb": 1}

    def nvmlInit(self):
        self.inits += 1

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return self.uuids[uuid]

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=[37, 90][h], memory=5)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=self.used[h], total=80 * 2**30, free=0)

    def nvmlDeviceGetPowerUsage(self, h):
        if h == 1:
            raise self.NVMLError("Not Supported")
        return 312_500  # milliwatts

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return [61, 70][h]


def test_nvml_sampler_reads_each_visible_gpu_and_leaves_out_what_the_driver_does_not_report():
    nvml = FakeNvml()
    sampler = NvmlSampler(nvml, None)
    first = sampler.sample()
    assert nvml.inits == 1
    assert first["cuda0"] == {
        DEVICE_UTIL: 37.0,
        DEVICE_MEM_USED: 1000.0,
        DEVICE_MEM_PEAK: 1000.0,
        DEVICE_POWER: 312.5,
        DEVICE_TEMP: 61.0,
    }
    assert DEVICE_POWER not in first["cuda1"] and first["cuda1"][DEVICE_TEMP] == 70.0
    nvml.used[0] = 400  # memory freed: the peak stays at the highest sample
    assert sampler.sample()["cuda0"][DEVICE_MEM_PEAK] == 1000.0


def test_nvml_sampler_follows_cuda_visible_devices_by_index_or_uuid():
    nvml = FakeNvml()
    by_index = NvmlSampler(nvml, visible_indices("cuda", {"CUDA_VISIBLE_DEVICES": "1"})).sample()
    assert list(by_index) == ["cuda0"] and by_index["cuda0"][DEVICE_UTIL] == 90.0  # the role's cuda:0 is GPU 1
    by_uuid = NvmlSampler(nvml, visible_indices("cuda", {"CUDA_VISIBLE_DEVICES": "GPU-bbbb,GPU-aaaa"})).sample()
    assert [by_uuid[d][DEVICE_UTIL] for d in ("cuda0", "cuda1")] == [90.0, 37.0]
    assert NvmlSampler(nvml, visible_indices("cuda", {"CUDA_VISIBLE_DEVICES": ""})).sample() == {}
    assert visible_indices("cuda", {}) is None and visible_indices("cpu", {"CUDA_VISIBLE_DEVICES": "0"}) is None


# ---------------------------------------------------------------------------------------------- ascend (fake)

NPU_SMI_COMMON = """\
        NPU ID                         : 4
        Chip Count                     : 1

        Chip ID                        : 0
        Memory Usage Rate(%)           : 6
        HBM Usage Rate(%)              : 31
        Aicore Usage Rate(%)           : 87
        Aicore Freq(MHZ)               : 1800
        Temperature(C)                 : 52
        NPU Real-time Power(W)         : 180.4
        Board ID                       : 0x65
"""


def test_npu_smi_common_output_gives_utilisation_temperature_and_power():
    assert parse_npu_smi_common(NPU_SMI_COMMON) == {DEVICE_UTIL: 87.0, DEVICE_TEMP: 52.0, DEVICE_POWER: 180.4}
    assert parse_npu_smi_common("") == {} and parse_npu_smi_common("Health : OK") == {}


class FakeNpu:
    def __init__(self, utilization: bool):
        if utilization:
            self.utilization = lambda i: 12.0 + i

    def device_count(self):
        return 2

    def memory_allocated(self, i):
        return 100 * (i + 1)

    def max_memory_allocated(self, i):
        return 300 * (i + 1)


def test_npu_sampler_reads_torch_npu_memory_and_npu_smi_by_the_physical_id():
    asked = []

    def smi(npu_id):
        asked.append(npu_id)
        return NPU_SMI_COMMON

    reading = NpuSampler(FakeNpu(utilization=False), ["4", "5"], smi).sample()
    assert asked == ["4", "5"]  # ASCEND_RT_VISIBLE_DEVICES's ids, not the role's indices
    assert reading["npu1"] == {
        DEVICE_MEM_USED: 200.0,
        DEVICE_MEM_PEAK: 600.0,
        DEVICE_UTIL: 87.0,
        DEVICE_TEMP: 52.0,
        DEVICE_POWER: 180.4,
    }
    # torch_npu's own utilisation, where it has one, wins over npu-smi's; without npu-smi there is no power
    alone = NpuSampler(FakeNpu(utilization=True), None, smi=None)
    alone._smi = None
    assert alone.sample()["npu0"] == {DEVICE_MEM_USED: 100.0, DEVICE_MEM_PEAK: 300.0, DEVICE_UTIL: 12.0}


# ---------------------------------------------------------------------------------------------- the thread


class Broken:
    def sample(self):
        raise RuntimeError("driver gone")


class Counting:
    def __init__(self):
        self.n = 0
        self.twice = threading.Event()

    def sample(self):
        self.n += 1
        if self.n >= 2:
            self.twice.set()
        return {"cpu": {DEVICE_UTIL: float(self.n)}}


def test_the_thread_samples_each_period_a_failing_sampler_is_dropped_and_each_sample_is_reported_once():
    counting = Counting()
    telemetry = Telemetry("trainer-0", [Broken(), counting], 0.01).start()
    try:
        assert counting.twice.wait(10)
    finally:
        telemetry.stop()
    assert len(telemetry._samplers) == 1  # the broken one is gone, the run goes on

    class Keep:
        def __init__(self):
            self.points = []

        def report(self, step, metrics):
            self.points.append((step, dict(metrics)))

        def event(self, kind, payload):
            pass

        def close(self):
            pass

    keep = Keep()
    reporter = TelemetryReporter(MultiReporter([keep]), telemetry)
    reporter.report(1, {"loss/policy": 0.5})
    reporter.report(2, {"loss/policy": 0.4})  # no new sample since: nothing added
    assert keep.points[0][1] == {"loss/policy": 0.5, "device/trainer-0/cpu/util": float(counting.n)}
    assert keep.points[1][1] == {"loss/policy": 0.4}
    assert reporter.find(Keep) is keep  # the wrapped MultiReporter's methods stay reachable
    assert telemetry.latest() == {"device/trainer-0/cpu/util": float(counting.n)}
    with pytest.raises(ValueError, match="> 0"):
        Telemetry("trainer-0", [], 0)


# ---------------------------------------------------------------------------------------------- the spec


def test_a_negative_interval_is_a_field_error_naming_the_field():
    with pytest.raises(SpecError) as err:
        load_spec(derived(metrics={"telemetry_interval_s": -1}))
    assert [e["field"] for e in err.value.errors] == ["metrics.telemetry_interval_s"]
    assert load_spec(TINY).metrics.telemetry_interval_s == 5.0


# ---------------------------------------------------------------------------------------------- a real run


def test_a_tiny_run_with_telemetry_on_writes_device_metrics_into_metrics_jsonl(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.delenv("TANDEM_ROLE", raising=False)
    spec = tiny_spec(tmp_path, "tel", pipeline__steps=3, metrics__telemetry_interval_s=0.05)
    result = run(spec)
    assert result["outcome"] == "completed"
    steps, _ = read_jsonl(spec.resolved_output_dir() / METRICS_FILE)
    device = [r for r in steps if any(k.startswith("device/") for k in r)]
    assert device and device[0]["step"] == 1  # the first sample is taken as the run starts
    first = device[0]
    assert first["device/trainer-0/cpu/mem_used_bytes"] > 0
    assert first["device/trainer-0/cpu/host_mem_total_bytes"] > first["device/trainer-0/cpu/host_mem_used_bytes"]
    assert all(split_device_metric(k) for k in first if k.startswith("device/"))
    assert not any(k.startswith("device/") for k in result["metrics"])  # the run's own metrics stay as they were
    assert not any(t.name == "device-telemetry" for t in threading.enumerate())  # stopped with the reporters


def test_a_run_with_telemetry_off_reports_no_device_metric(tmp_path):
    torch.set_num_threads(1)
    spec = tiny_spec(tmp_path, "off", pipeline__steps=1, metrics__telemetry_interval_s=0)
    run(spec)
    steps, _ = read_jsonl(spec.resolved_output_dir() / METRICS_FILE)
    assert steps and not any(k.startswith("device/") for r in steps for k in r)


def test_a_role_beside_the_trainer_heartbeats_its_device_telemetry(tmp_path, monkeypatch):
    from runtime.managed import entry

    posts: list[dict] = []
    posted = threading.Event()

    class Poster:
        def __init__(self, url, token):
            pass

        def post(self, path, body):
            posts.append(body)
            posted.set()
            return {}

    monkeypatch.setattr(entry, "JsonPoster", Poster)
    env = entry.RoleEnv("http://127.0.0.1:9", "token", "7", 1, "rollout-0", "h1", 3600.0)
    spec = tiny_spec(tmp_path, "side", metrics__telemetry_interval_s=0.01)

    def sampled() -> bool:
        return any(b["info"].get("telemetry") for b in posts)

    def work(changed) -> int:
        for _ in range(500):  # each status change is a heartbeat at once; the first sample arrives meanwhile
            posted.clear()
            changed("running")
            posted.wait(5)
            if sampled():
                break
        return 0

    assert entry._beside_the_trainer(env, work, spec) == 0
    latest = next(b["info"]["telemetry"] for b in posts if b["info"].get("telemetry"))
    assert latest["device/rollout-0/cpu/mem_used_bytes"] > 0
    assert posts[-1]["status"] == "finished"
    assert not any(t.name == "device-telemetry" for t in threading.enumerate())
