"""Helpers of the runtime tests: the tiny run spec the pipeline tests start from, and a remote rollout process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from runtime.spec import RunSpec, load_spec

ROOT = Path(__file__).resolve().parents[2]

# A random tiny model on a short reversal task: a step takes a fraction of a second on one thread.
TINY: dict[str, Any] = {
    "seed": 3,
    "model": {"builtin": "tiny-qwen2"},
    "task": {"name": "reverse", "min_len": 1, "max_len": 4, "train_size": 256, "eval_size": 8},
    # the entropy bonus guarantees a gradient even when every reward of a random model is 0
    "algorithm": {"name": "grpo", "group_size": 4, "entropy_coef": 0.01},
    "trainer": {"lr": 1e-3},
    "rollout": {"max_new_tokens": 6, "max_batch_size": 16},
    "pipeline": {"prompts_per_step": 4, "eval_interval": 0},
    "resources": {"threads_per_process": 1},
    "metrics": {"progress_bar": False},
}


def derived(**sections: dict[str, Any]) -> dict[str, Any]:
    """TINY with some sections' fields replaced (``pipeline={"mode": "async"}``); top-level values as given."""
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in TINY.items()}
    for key, value in sections.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    return data


def tiny_spec(tmp_path, name: str, base: dict[str, Any] = TINY, **over: Any) -> RunSpec:
    """A spec named ``name`` writing under ``tmp_path``; overrides as ``section__field=value``."""
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    data["name"] = name
    data["output_dir"] = str(tmp_path / name)
    for dotted, value in over.items():
        section, field = dotted.split("__")
        data.setdefault(section, {})[field] = value
    return load_spec(data)


def assert_each_group_once(consumed_steps: list[list[int]], *others: list[int]) -> list[int]:
    """Every issued group (issue index) accounted for exactly once: consumed by a step, or in one of ``others``
    (dropped, left over, ...), and no index missing; returns the consumed ones."""
    consumed = [g for step in consumed_steps for g in step]
    everything = consumed + [g for other in others for g in other]
    assert len(everything) == len(set(everything))  # nothing twice
    assert set(everything) == set(range(max(everything) + 1))  # nothing lost
    return consumed


def remote_rollout(spec_path: Path, index: int, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m runtime rollout SPEC --index I``: a remote rollout instance as a process of its own, its output
    appended to ``log``."""
    environ = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log, "ab") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "runtime", "rollout", str(spec_path), "--index", str(index)],
            cwd=ROOT,
            env=environ,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
