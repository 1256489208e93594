"""Device telemetry: a role samples its own devices every ``metrics.telemetry_interval_s`` from a daemon thread.

What is sampled (``runtime.contract.DEVICE_METRICS`` gives each field's meaning):

* ``cpu``, always: the role's process's CPU share and resident set (its peak from ``getrusage``), and the
  host's memory, through ``psutil``;
* ``cuda<i>``, each visible GPU: utilisation, used memory (its highest sample as the peak), power and
  temperature through NVML (``nvidia-ml-py``, imported when a cuda run starts; requirements-gpu.txt);
* ``npu<i>``, each visible NPU: torch_npu's allocated and peak memory, utilisation through
  ``torch.npu.utilization`` where torch_npu has it, power and temperature from ``npu-smi info -t common``.

A field the driver does not report is left out, a sampler that fails is dropped with one log line: telemetry
never fails a run. The samples reach the run's reporters as ``device/<role>/<device>/<field>`` metrics with
the step in progress (:class:`TelemetryReporter`, each sample once); the sampling thread touches no reporter.
The NVML and NPU samplers have run against injected fakes only, not yet on hardware.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from runtime.contract import (
    DEVICE_HOST_MEM_TOTAL,
    DEVICE_HOST_MEM_USED,
    DEVICE_MEM_PEAK,
    DEVICE_MEM_USED,
    DEVICE_POWER,
    DEVICE_TEMP,
    DEVICE_UTIL,
    ENV_ROLE,
    TRAINER_ROLE,
    device_metric,
)
from runtime.devices import visible_indices

Reading = dict[str, dict[str, float]]  # device label (cpu, cuda0, npu1) -> field -> value


def _log(message: str) -> None:
    print(f"[telemetry] {message}", file=sys.stderr, flush=True)


class Sampler(Protocol):
    def sample(self) -> Reading:
        """One reading of this sampler's devices."""


# ------------------------------------------------------------------------------------------------ cpu


class CpuSampler:
    """The role's process (CPU share of the whole host, resident set and its peak) and the host's memory."""

    def __init__(self, psutil: Any = None):
        self._psutil = psutil if psutil is not None else importlib.import_module("psutil")
        self._process = self._psutil.Process()
        self._cores = self._psutil.cpu_count() or 1
        self._process.cpu_percent(None)  # the first call starts the interval the next one measures
        self._peak = 0

    def _peak_rss(self, rss: int) -> int:
        try:
            import resource

            kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peak = kib if sys.platform == "darwin" else kib * 1024  # bytes on macOS, KiB on Linux
        except (ImportError, OSError):
            peak = 0
        self._peak = max(self._peak, peak, rss)
        return self._peak

    def sample(self) -> Reading:
        rss = int(self._process.memory_info().rss)
        memory = self._psutil.virtual_memory()
        return {
            "cpu": {
                DEVICE_UTIL: float(self._process.cpu_percent(None)) / self._cores,
                DEVICE_MEM_USED: float(rss),
                DEVICE_MEM_PEAK: float(self._peak_rss(rss)),
                DEVICE_HOST_MEM_USED: float(memory.total - memory.available),
                DEVICE_HOST_MEM_TOTAL: float(memory.total),
            }
        }


# ------------------------------------------------------------------------------------------------ nvidia


class NvmlSampler:
    """Each visible GPU through NVML: ``nvml`` is the ``pynvml`` module (nvidia-ml-py) or a stand-in.

    ``visible`` is CUDA_VISIBLE_DEVICES's entries (indices or ``GPU-`` UUIDs; None: every GPU), so ``cuda<i>``
    is the device torch calls ``cuda:i`` in the role's process."""

    def __init__(self, nvml: Any, visible: Sequence[str] | None):
        self._nvml = nvml
        nvml.nvmlInit()
        if visible is None:
            visible = [str(i) for i in range(nvml.nvmlDeviceGetCount())]
        self._handles = [
            nvml.nvmlDeviceGetHandleByIndex(int(entry)) if entry.isdigit() else nvml.nvmlDeviceGetHandleByUUID(entry)
            for entry in visible
        ]
        self._peaks = [0.0] * len(self._handles)

    def _read(self, call: Callable[[], float]) -> float | None:
        try:
            return float(call())
        except self._nvml.NVMLError:  # not supported on this GPU (power on some boards, ...): left out
            return None

    def sample(self) -> Reading:
        nvml = self._nvml
        out: Reading = {}
        for i, handle in enumerate(self._handles):
            fields: dict[str, float] = {}
            util = self._read(lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu)  # noqa: B023 - called at once
            used = self._read(lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used)  # noqa: B023
            power_mw = self._read(lambda: nvml.nvmlDeviceGetPowerUsage(handle))  # noqa: B023
            temp = self._read(lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))  # noqa: B023
            if util is not None:
                fields[DEVICE_UTIL] = util
            if used is not None:
                self._peaks[i] = max(self._peaks[i], used)
                fields[DEVICE_MEM_USED] = used
                fields[DEVICE_MEM_PEAK] = self._peaks[i]
            if power_mw is not None:
                fields[DEVICE_POWER] = power_mw / 1000.0
            if temp is not None:
                fields[DEVICE_TEMP] = temp
            out[f"cuda{i}"] = fields
        return out


# ------------------------------------------------------------------------------------------------ ascend

_NPU_SMI_FIELDS = (  # npu-smi info -t common: "<name> : <value>" lines
    (re.compile(r"^aicore usage rate", re.I), DEVICE_UTIL),
    (re.compile(r"^temperature", re.I), DEVICE_TEMP),
    (re.compile(r"power", re.I), DEVICE_POWER),
)


def parse_npu_smi_common(text: str) -> dict[str, float]:
    """Utilisation, temperature and power from ``npu-smi info -t common -i <id>``; absent fields left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if not sep:
            continue
        name = name.strip()
        try:
            number = float(value.strip())
        except ValueError:
            continue
        for pattern, field in _NPU_SMI_FIELDS:
            if field not in out and pattern.search(name):
                out[field] = number
                break
    return out


def _npu_smi(npu_id: str) -> str:
    try:
        return subprocess.run(
            ["npu-smi", "info", "-t", "common", "-i", npu_id], capture_output=True, text=True, timeout=5, check=True
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return ""


class NpuSampler:
    """Each visible NPU: ``npu`` is ``torch.npu`` (torch_npu loaded) or a stand-in; ``smi(id)`` the text of
    ``npu-smi info -t common -i id`` ("" when there is none), for the figures torch_npu does not give."""

    def __init__(self, npu: Any, visible: Sequence[str] | None, smi: Callable[[str], str] | None = None):
        self._npu = npu
        count = int(npu.device_count())
        self._ids = list(visible)[:count] if visible is not None else [str(i) for i in range(count)]
        self._smi = smi if smi is not None else (_npu_smi if shutil.which("npu-smi") else None)

    def sample(self) -> Reading:
        out: Reading = {}
        utilization = getattr(self._npu, "utilization", None)
        for i, npu_id in enumerate(self._ids):
            fields: dict[str, float] = {
                DEVICE_MEM_USED: float(self._npu.memory_allocated(i)),
                DEVICE_MEM_PEAK: float(self._npu.max_memory_allocated(i)),
            }
            if self._smi is not None:
                fields.update(parse_npu_smi_common(self._smi(npu_id)))
            if utilization is not None:
                try:
                    fields[DEVICE_UTIL] = float(utilization(i))
                except Exception:  # an old torch_npu or no driver figure: npu-smi's, if any, stays
                    pass
            out[f"npu{i}"] = fields
        return out


def samplers_for(kind: str, environ: Mapping[str, str] | None = None) -> list[Sampler]:
    """The samplers of a role on ``kind`` (cpu, cuda, npu): the CPU always, then its accelerators where their
    library loads (a missing one is a log line and no accelerator figures, never an error)."""
    environ = os.environ if environ is None else environ
    out: list[Sampler] = [CpuSampler()]
    try:
        if kind == "cuda":
            out.append(NvmlSampler(importlib.import_module("pynvml"), visible_indices(kind, environ)))
        elif kind == "npu":
            import torch

            importlib.import_module("torch_npu")
            out.append(NpuSampler(torch.npu, visible_indices(kind, environ)))  # type: ignore[attr-defined]
    except Exception as exc:  # ImportError (nvidia-ml-py absent), NVMLError (no driver), ...
        _log(f"{kind} devices are not sampled: {type(exc).__name__}: {exc}")
    return out


# ------------------------------------------------------------------------------------------------ the thread


class Telemetry:
    """Samples every ``interval_s`` on a daemon thread (the first at once); :meth:`take` hands the newest
    sample not yet taken to the caller's thread as metrics. A sampler that raises is dropped (logged once)."""

    def __init__(self, role: str, samplers: Sequence[Sampler], interval_s: float):
        if interval_s <= 0:
            raise ValueError(f"telemetry interval must be > 0 seconds, got {interval_s}")
        self.role, self.interval_s = role, interval_s
        self._samplers = list(samplers)
        self._lock = threading.Lock()
        self._pending: dict[str, float] = {}
        self._latest: dict[str, float] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="device-telemetry", daemon=True)

    def sample(self) -> dict[str, float]:
        """One sample of every sampler, as ``device/<role>/<device>/<field>`` metrics."""
        metrics: dict[str, float] = {}
        for sampler in list(self._samplers):
            try:
                reading = sampler.sample()
            except Exception as exc:
                _log(f"{type(sampler).__name__} stopped: {type(exc).__name__}: {exc}")
                self._samplers.remove(sampler)
                continue
            for device, fields in reading.items():
                for field, value in fields.items():
                    metrics[device_metric(self.role, device, field)] = value
        with self._lock:
            self._pending, self._latest = metrics, metrics
            self.samples += 1
        return metrics

    def take(self) -> dict[str, float]:
        """The newest sample not taken yet ({} when none came since the last call)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        return pending

    def latest(self) -> dict[str, float]:
        """The newest sample, taken or not (a heartbeat's device state)."""
        with self._lock:
            return dict(self._latest)

    def start(self) -> Telemetry:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                return


def role_name(environ: Mapping[str, str] | None = None) -> str:
    """The role the series are named after: the platform's ``TANDEM_ROLE``, else trainer-0 (a CLI run)."""
    environ = os.environ if environ is None else environ
    return environ.get(ENV_ROLE, "").strip() or TRAINER_ROLE


def start_for(spec: Any, role: str | None = None) -> Telemetry | None:
    """A started Telemetry for a run spec's role and device kind, or None when the spec turns it off."""
    interval = float(spec.metrics.telemetry_interval_s)
    if interval <= 0:
        return None
    kind = spec.resources.device
    return Telemetry(role or role_name(), samplers_for(kind), interval).start()


# ------------------------------------------------------------------------------------------------ reporting


class TelemetryReporter:
    """The run's reporters with the newest device sample added to the next ``report`` (each sample once).
    Everything else goes to the wrapped reporter unchanged; ``close`` stops the sampling thread first."""

    def __init__(self, inner: Any, telemetry: Telemetry):
        self.inner, self.telemetry = inner, telemetry

    def report(self, step: int, metrics: Mapping[str, float]) -> None:
        extra = self.telemetry.take()
        self.inner.report(step, {**metrics, **extra} if extra else metrics)

    def event(self, kind: str, payload: Mapping[str, Any]) -> None:
        self.inner.event(kind, payload)

    def close(self) -> None:
        self.telemetry.stop()
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # find(), reporters, ... of the wrapped MultiReporter
        return getattr(self.inner, name)


def with_telemetry(reporters: Any, spec: Any, role: str | None = None) -> Any:
    """``reporters`` wrapped in a :class:`TelemetryReporter` sampling the spec's devices (unchanged when
    ``metrics.telemetry_interval_s`` is 0)."""
    telemetry = start_for(spec, role)
    return reporters if telemetry is None else TelemetryReporter(reporters, telemetry)
