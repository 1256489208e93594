"""Device inventory of this machine: what the vendor tools say, parsed.

Pure parsers (``parse_npu_smi_info``, ``parse_nvidia_smi_csv``) turn the text
of ``npu-smi info`` and of ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits``
into :class:`DeviceInfo` rows; ``probe_devices`` runs the tool that is present
(with a timeout) or describes the CPU. Nothing here touches the database, so
the parsers are tested on sample outputs and the host agent (rlplatform.agent)
feeds the result to rlplatform.hosts.

Health: an Ascend chip is healthy only when its card's Health column says
``OK`` (Warning, Alarm, Critical, a missing or unknown word all count as
unhealthy: the platform never places work on a device it cannot vouch for). A
GPU is unhealthy when nvidia-smi reports an error for it (``[GPU is lost]``,
``[Unknown Error]``, ``ERR!``), uncorrected volatile ECC errors, or retired
pages pending a reset.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from dataclasses import field as dc_field
from pathlib import Path

PROBE_TIMEOUT_S = 20.0
KINDS = ("npu", "gpu", "cpu")

# The nvidia-smi fields we ask for, in this order; parse_nvidia_smi_csv reads columns by this tuple.
NVIDIA_QUERY_FIELDS = (
    "index",
    "uuid",
    "name",
    "memory.total",
    "memory.used",
    "ecc.errors.uncorrected.volatile.total",
    "retired_pages.pending",
    "utilization.gpu",
)
NVIDIA_SMI_COMMAND = (
    "nvidia-smi",
    "--query-gpu=" + ",".join(NVIDIA_QUERY_FIELDS),
    "--format=csv,noheader,nounits",
)
NPU_SMI_COMMAND = ("npu-smi", "info")

# nvidia-smi writes these in place of a value it could not read from a failing GPU.
_NVIDIA_ERROR_MARKERS = ("gpu is lost", "unknown error", "err!", "requires reset")
# ... and these for values the GPU simply does not have (no ECC, no page retirement).
_NVIDIA_MISSING = {"", "[n/a]", "n/a", "[not supported]", "not supported", "na"}
_PAIR = re.compile(r"(\d+)\s*/\s*(\d+)")


class InventoryError(RuntimeError):
    """A probe tool is missing, failed, or printed something that is not its documented format."""


@dataclass(frozen=True)
class DeviceInfo:
    """One schedulable device of a host.

    ``index`` is what ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES take (the
    logical id), ``health`` the tool's own word for logs and the UI.
    """

    index: int
    kind: str
    model: str = ""
    memory_mb: int = 0
    healthy: bool = True
    health: str = "OK"
    # What the tool says the device is doing now (None: not reported), sent with each heartbeat:
    # (not part of equality: a device is the same device whatever it is doing)
    util_pct: float | None = dc_field(default=None, compare=False)
    mem_used_mb: int | None = dc_field(default=None, compare=False)

    def usage(self) -> dict[str, float | int]:
        """The device's utilisation (%) and memory in use (MB), those the tool reported."""
        out: dict[str, float | int] = {}
        if self.util_pct is not None:
            out["util_pct"] = self.util_pct
        if self.mem_used_mb is not None:
            out["mem_used_mb"] = self.mem_used_mb
        return out

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, *, field: str = "device") -> DeviceInfo:
        """Validate a device sent as JSON (Celery task arguments); errors name the field."""
        if not isinstance(data, dict):
            raise ValueError(f"{field}: expected an object, got {type(data).__name__}")
        unknown = set(data) - {"index", "kind", "model", "memory_mb", "healthy", "health", "util_pct", "mem_used_mb"}
        if unknown:
            raise ValueError(f"{field}: unknown keys {sorted(unknown)}")
        index = data.get("index")
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"{field}.index: expected a non-negative integer, got {index!r}")
        kind = data.get("kind")
        if kind not in KINDS:
            raise ValueError(f"{field}.kind: expected one of {', '.join(KINDS)}, got {kind!r}")
        memory = data.get("memory_mb", 0)
        if not isinstance(memory, int) or isinstance(memory, bool) or memory < 0:
            raise ValueError(f"{field}.memory_mb: expected a non-negative integer, got {memory!r}")
        healthy = data.get("healthy", True)
        if not isinstance(healthy, bool):
            raise ValueError(f"{field}.healthy: expected true or false, got {healthy!r}")
        model = data.get("model", "")
        health = data.get("health", "OK" if healthy else "unhealthy")
        if not isinstance(model, str) or not isinstance(health, str):
            raise ValueError(f"{field}.model and {field}.health must be strings")
        return cls(index=index, kind=kind, model=model[:100], memory_mb=memory, healthy=healthy, health=health)


# --- npu-smi info ------------------------------------------------------------------


def _cells(line: str) -> list[str]:
    """The cells of a table row ``| a | b | c |`` (outer bars dropped, cells stripped)."""
    inner = line.strip()
    inner = inner[1:] if inner.startswith("|") else inner
    inner = inner[:-1] if inner.endswith("|") else inner
    return [cell.strip() for cell in inner.split("|")]


def _is_int(token: str) -> bool:
    return token.isdigit()


def _memory_total(cell: str) -> int:
    """The last ``used / total`` pair with a non-zero total: HBM on 910 cards, Memory-Usage on 310 cards."""
    totals = [int(total) for _used, total in _PAIR.findall(cell)]
    nonzero = [t for t in totals if t > 0]
    return nonzero[-1] if nonzero else 0


def _npu_usage(cell: str) -> tuple[float | None, int | None]:
    """``AICore(%)  Memory-Usage(MB)  HBM-Usage(MB)`` of a chip row: the AI-core usage and the memory in use
    of the pair ``_memory_total`` reads (None where the cell does not say)."""
    first = cell.split()[:1]
    util = float(first[0]) if first and _is_int(first[0]) else None
    used = [int(u) for u, total in _PAIR.findall(cell) if int(total) > 0]
    return util, (used[-1] if used else None)


def parse_npu_smi_info(text: str) -> list[DeviceInfo]:
    """Devices (one per chip) from the text of ``npu-smi info``.

    The device table has two header rows (``NPU Name | Health | ...`` and
    ``Chip [Device|Phy-ID] | Bus-Id | ... Memory-Usage(MB) [HBM-Usage(MB)]``)
    and, per card, a card row (NPU id, name, health) followed by one row per
    chip (chip id, on 310P-style tables also the logical device id). The
    process table after it is ignored. Cards with two chips (310P Duo, 910C)
    give two devices. Where the table has no Device column, chips are numbered
    in the order listed, which is how the Ascend runtime numbers logical ids.
    """
    lines = text.splitlines()
    start = None
    for i, line in enumerate(lines):
        cells = _cells(line) if line.strip().startswith("|") else []
        if len(cells) >= 2 and cells[0].split()[:1] == ["NPU"] and "Name" in cells[0] and "Health" in cells[1]:
            start = i
            break
    if start is None:
        raise InventoryError("npu-smi info: no device table (expected a header row 'NPU Name | Health | ...')")
    has_device_column = False
    if start + 1 < len(lines) and lines[start + 1].strip().startswith("|"):
        chip_header = _cells(lines[start + 1])[0].split()
        has_device_column = len(chip_header) >= 2 and chip_header[0] == "Chip" and chip_header[1] == "Device"

    devices: list[DeviceInfo] = []
    card: tuple[str, str] | None = None  # (model, health word) of the card whose chips come next
    card_has_chips = False
    after_separator = True
    next_index = 0
    seen: set[int] = set()

    def add(
        model: str, health_word: str, memory: int, device_id: int | None, usage: tuple[float | None, int | None]
    ) -> None:
        nonlocal next_index
        index = device_id if device_id is not None else next_index
        while index in seen:  # a malformed table repeating ids: never give two chips one index
            index += 1
        seen.add(index)
        next_index = max(next_index, index + 1)
        word = health_word or "unknown"
        devices.append(
            DeviceInfo(
                index=index,
                kind="npu",
                model=model,
                memory_mb=memory,
                healthy=word.upper() == "OK",
                health=word,
                util_pct=usage[0],
                mem_used_mb=usage[1],
            )
        )

    def close_card() -> None:
        # A card row without chip rows (truncated output): still one device, so it is not lost.
        if card is not None and not card_has_chips:
            add(card[0], card[1], 0, None, (None, None))

    for line in lines[start + 2 :]:
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("+"):
            after_separator = True
            continue
        if not stripped.startswith("|"):
            continue
        cells = _cells(stripped)
        first = cells[0].split()
        if not first:
            continue
        if "Process id" in stripped or "No running processes" in stripped or first[:2] == ["NPU", "Chip"]:
            break  # the process table follows the device table
        if not _is_int(first[0]):
            continue
        is_card = after_separator or (len(first) >= 2 and not _is_int(first[1]))
        after_separator = False
        if is_card:
            close_card()
            name = " ".join(first[1:])
            model = name if not name or name.lower().startswith("ascend") else f"Ascend {name}"
            health_word = cells[1].split()[0] if len(cells) > 1 and cells[1].split() else ""
            card, card_has_chips = (model, health_word), False
            continue
        if card is None:
            continue
        card_has_chips = True
        device_id = int(first[1]) if has_device_column and len(first) >= 2 and _is_int(first[1]) else None
        memory = _memory_total(cells[2]) if len(cells) > 2 else 0
        add(card[0], card[1], memory, device_id, _npu_usage(cells[2]) if len(cells) > 2 else (None, None))
    close_card()
    return sorted(devices, key=lambda d: d.index)


# --- nvidia-smi --query-gpu ------------------------------------------------------------


def _nvidia_value(raw: str) -> tuple[str | None, bool]:
    """(value or None when missing, True when nvidia-smi reported an error in its place)."""
    value = raw.strip()
    lowered = value.lower()
    if any(marker in lowered for marker in _NVIDIA_ERROR_MARKERS):
        return None, True
    if lowered in _NVIDIA_MISSING:
        return None, False
    return value, False


def _nvidia_int(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(float(value))
    except ValueError:
        return None


def parse_nvidia_smi_csv(text: str) -> list[DeviceInfo]:
    """Devices from ``nvidia-smi --query-gpu=<NVIDIA_QUERY_FIELDS> --format=csv,noheader,nounits``.

    Columns are read in the order of ``NVIDIA_QUERY_FIELDS``; missing trailing
    columns count as unknown. Lines without a comma are nvidia-smi's own
    messages (e.g. "Unable to determine the device handle for GPU ...") and are
    skipped; a GPU that fell off the bus then simply does not appear, and the
    host handler marks its device unhealthy.
    """
    devices: list[DeviceInfo] = []
    seen: set[int] = set()
    rows = csv.reader((line for line in text.splitlines() if "," in line), skipinitialspace=True)
    for number, row in enumerate(rows, start=1):
        parsed: dict[str, str | None] = {}
        error_fields = []
        for field, raw in zip(NVIDIA_QUERY_FIELDS, row, strict=False):
            value, is_error = _nvidia_value(raw)
            parsed[field] = value
            if is_error:
                error_fields.append(field)
        index = _nvidia_int(parsed.get("index"))
        if index is None or index < 0:
            raise InventoryError(f"nvidia-smi row {number}: index {row[0].strip()!r} is not a GPU index")
        if index in seen:
            raise InventoryError(f"nvidia-smi row {number}: GPU index {index} listed twice")
        seen.add(index)
        ecc = _nvidia_int(parsed.get("ecc.errors.uncorrected.volatile.total"))
        pending = (parsed.get("retired_pages.pending") or "").lower() == "yes"
        problems = [f"{field} error" for field in error_fields]
        if ecc:
            problems.append(f"{ecc} uncorrected ECC errors")
        if pending:
            problems.append("retired pages pending")
        devices.append(
            DeviceInfo(
                index=index,
                kind="gpu",
                model=(parsed.get("name") or "")[:100],
                memory_mb=max(_nvidia_int(parsed.get("memory.total")) or 0, 0),
                healthy=not problems,
                health="; ".join(problems) or "OK",
                util_pct=_nvidia_number(parsed.get("utilization.gpu")),
                mem_used_mb=_nvidia_int(parsed.get("memory.used")),
            )
        )
    return sorted(devices, key=lambda d: d.index)


def _nvidia_number(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


# --- CPU and the probe itself --------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()[:100]
    except OSError:
        pass
    return os.uname().machine


def _total_memory_mb() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (1024 * 1024)
    except (ValueError, OSError):
        return 0


def probe_cpu(count: int | None = None) -> list[DeviceInfo]:
    """This machine's CPU as ``count`` devices (default: the cores this process may use).

    Memory is split evenly, so the sum over devices is the machine's memory.
    """
    if count is None:
        count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if count < 1:
        raise InventoryError(f"CPU device count must be >= 1, got {count}")
    model, memory = _cpu_model(), _total_memory_mb() // count
    util, used = _cpu_usage(count)
    return [
        DeviceInfo(index=i, kind="cpu", model=model, memory_mb=memory, util_pct=util[i], mem_used_mb=used)
        for i in range(count)
    ]


def _cpu_usage(count: int) -> tuple[list[float | None], int | None]:
    """Per CPU device: the busy share of its core since the previous call (psutil; the first call says 0), and
    the host's memory in use split evenly, as ``memory_mb`` is."""
    try:
        import psutil
    except ImportError:
        return [None] * count, None
    cores = psutil.cpu_percent(percpu=True)
    util: list[float | None] = [float(cores[i]) if i < len(cores) else None for i in range(count)]
    memory = psutil.virtual_memory()
    return util, (memory.total - memory.available) // (1024 * 1024) // count


def _run(command: tuple[str, ...], timeout: float) -> str:
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise InventoryError(f"`{' '.join(command)}` did not answer within {timeout:g} s") from None
    except OSError as exc:
        raise InventoryError(f"`{command[0]}` could not be run: {exc}") from None
    if done.returncode != 0 and "," not in done.stdout and "|" not in done.stdout:
        message = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise InventoryError(f"`{' '.join(command)}` exited with {done.returncode}: {message[0]}")
    return done.stdout


def detect_kind() -> str:
    """npu when npu-smi is on PATH, else gpu when nvidia-smi is, else cpu."""
    if shutil.which(NPU_SMI_COMMAND[0]):
        return "npu"
    if shutil.which(NVIDIA_SMI_COMMAND[0]):
        return "gpu"
    return "cpu"


def probe_devices(
    kind: str | None = None, *, cpu_count: int | None = None, timeout: float = PROBE_TIMEOUT_S
) -> tuple[str, list[DeviceInfo]]:
    """Probe this machine: ``(kind, devices)``.

    ``kind=None`` detects it (``detect_kind``). An accelerator kind whose tool
    is missing, hangs past ``timeout`` or fails raises InventoryError: a broken
    driver must not make a GPU host register as a CPU host.
    """
    kind = kind or detect_kind()
    if kind not in KINDS:
        raise InventoryError(f"unknown device kind {kind!r}; expected one of {', '.join(KINDS)}")
    if kind == "cpu":
        return kind, probe_cpu(cpu_count)
    command = NPU_SMI_COMMAND if kind == "npu" else NVIDIA_SMI_COMMAND
    if shutil.which(command[0]) is None:
        raise InventoryError(f"device kind {kind} needs `{command[0]}` on PATH; it was not found")
    text = _run(command, timeout)
    devices = parse_npu_smi_info(text) if kind == "npu" else parse_nvidia_smi_csv(text)
    return kind, devices
