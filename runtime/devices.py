"""Device kinds (cpu / cuda / npu), their torch.distributed backends and visibility variables.

``torch_npu`` is imported only when an ``npu`` device is asked for, so CPU and
GPU machines never need it. Every failure is a :class:`DeviceError` that says
what is missing, raised before any work starts.
"""

from __future__ import annotations

import importlib
import os
import random
import shutil
import subprocess
from collections.abc import Mapping
from typing import Any

import torch

KINDS = ("cpu", "cuda", "npu")

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
_VISIBILITY = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}
_SMI = {
    "cuda": ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader"],
    "npu": ["npu-smi", "info", "-l"],
}


class DeviceError(RuntimeError):
    """A requested device kind or index is not available on this machine."""


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise DeviceError(f"unknown device kind {kind!r}; expected one of {', '.join(KINDS)}")


def _load_torch_npu() -> Any:
    """Import torch_npu (which registers ``torch.npu``); a DeviceError when it is not installed."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:
        raise DeviceError(
            "device `npu` needs the torch_npu package (see requirements-npu.txt and the CANN toolkit); "
            f"it could not be imported: {exc}"
        ) from None


def device_count(kind: str) -> int:
    """Devices of ``kind`` visible to this process (cpu counts as one)."""
    _check_kind(kind)
    if kind == "cpu":
        return 1
    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    _load_torch_npu()
    npu = getattr(torch, "npu", None)
    return npu.device_count() if npu is not None and npu.is_available() else 0


def resolve_device(kind: str, index: int = 0) -> torch.device:
    """The torch device for ``kind`` and ``index``; a DeviceError when it is not there."""
    _check_kind(kind)
    if index < 0:
        raise DeviceError(f"device index must be >= 0, got {index}")
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise DeviceError("device `cuda` requested but this torch build has no CUDA support or no GPU is visible")
    count = device_count(kind)
    if count == 0:
        raise DeviceError(f"device `{kind}` requested but no {kind} device is visible to this process")
    if index >= count:
        env = _VISIBILITY[kind]
        raise DeviceError(
            f"device `{kind}:{index}` requested but only {count} visible ({env}={os.environ.get(env, '<unset>')})"
        )
    return torch.device(kind, index)


def dist_backend(kind: str) -> str:
    """The torch.distributed backend for a device kind: gloo (cpu), nccl (cuda), hccl (npu)."""
    _check_kind(kind)
    return _BACKENDS[kind]


def visibility_env(kind: str, indices: list[int]) -> dict[str, str]:
    """Environment variables that restrict a child process to ``indices`` (empty for cpu)."""
    _check_kind(kind)
    if kind == "cpu":
        return {}
    if any(i < 0 for i in indices):
        raise DeviceError(f"device indices must be >= 0, got {indices}")
    return {_VISIBILITY[kind]: ",".join(str(i) for i in indices)}


def visible_indices(kind: str, environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The entries of ``kind``'s visibility variable (indices, or GPU UUIDs), in the order the process sees
    its devices; None when the variable is unset (every device is visible) or for cpu."""
    _check_kind(kind)
    environ = os.environ if environ is None else environ
    if kind == "cpu" or _VISIBILITY[kind] not in environ:
        return None
    return [entry.strip() for entry in environ[_VISIBILITY[kind]].split(",") if entry.strip()]


def set_threads(n: int | None) -> None:
    """Set torch intra-op threads (None keeps torch's default)."""
    if n is None:
        return
    if n < 1:
        raise DeviceError(f"threads must be >= 1, got {n}")
    torch.set_num_threads(n)


def manual_seed_all(seed: int) -> None:
    """Seed Python, NumPy (when installed) and torch on every device kind that is loaded."""
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is optional for the runtime
        pass
    torch.manual_seed(seed)  # also seeds every CUDA device
    npu = getattr(torch, "npu", None)
    if npu is not None and hasattr(npu, "manual_seed_all"):
        npu.manual_seed_all(seed)


def probe_inventory(kind: str) -> list[str]:
    """Lines from the vendor tool (nvidia-smi / npu-smi) describing the devices, or [] when it is absent.

    Used by host workers to report their devices; never imports torch_npu.
    """
    _check_kind(kind)
    if kind == "cpu":
        return [f"cpu: {os.cpu_count()} cores"]
    cmd = _SMI[kind]
    if shutil.which(cmd[0]) is None:
        return []
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]
