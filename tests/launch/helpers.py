"""Helpers of the launch tests."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def wait_for(condition, what: str, timeout: float = 20.0, logs: list[Path] = ()):
    """Poll ``condition`` until it returns something truthy; fail with the logs' tails otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    tails = "\n".join(f"--- {p}:\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())
    pytest.fail(f"timed out after {timeout:g} s waiting for {what}\n{tails}")


def start_tasks(callbacks) -> list:
    """The start tasks among captured after-commit callbacks (the live stream has its own)."""
    return [c for c in callbacks if "_request_start" in c.__qualname__]


def launch_captured(run, capture_on_commit) -> tuple:
    """``launch.launch_run`` with its after-commit callbacks captured, not run: (its result, start tasks)."""
    from jobs import launch

    with capture_on_commit(execute=False) as sent:
        result = launch.launch_run(run.pk)
    return result, start_tasks(sent)


def e2e_spec(name: str, resources: dict, checkpoint: dict, **sections) -> dict:
    """A tiny async run for the end-to-end tests, running until stopped (no local rollout instance unless
    ``resources`` asks); ``sections`` replace or add whole spec sections."""
    return {
        "name": name,
        "seed": 1,
        "model": {"builtin": "tiny-qwen2"},
        "task": {"name": "reverse", "min_len": 1, "max_len": 4, "train_size": 256, "eval_size": 8},
        "algorithm": {"name": "grpo", "group_size": 4},
        "rollout": {"max_new_tokens": 6, "max_batch_size": 16},
        "pipeline": {"mode": "async", "steps": 100_000, "prompts_per_step": 4, "eval_interval": 0},
        "resources": {"threads_per_process": 1, "rollout_workers": 0, **resources},
        "checkpoint": checkpoint,
        "metrics": {"progress_bar": False},
        **sections,
    }
