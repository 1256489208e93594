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


def stop_and_wait_for_the_end(api, run, logs: list[Path], timeout: float) -> None:
    """Send the run a stop command through the API; wait until the run is COMPLETED (the trainer took
    the command) and every one of its roles has exited."""
    from jobs.models import Command, RunRole
    from jobs.models import RoleState as R
    from jobs.states import RunState

    status, body = api.request("POST", f"/api/runs/{run.pk}/commands/", {"kind": "stop", "args": {}})
    assert status == 201, body

    def ended() -> bool:
        run.refresh_from_db()
        return run.state in (RunState.COMPLETED, RunState.FAILED)

    wait_for(ended, "the run to end", timeout, logs)
    assert run.state == RunState.COMPLETED, run.reason
    assert Command.objects.get(pk=body["id"]).state == "done"  # trainer-0 took it, not another role
    wait_for(
        lambda: not RunRole.objects.filter(run=run).exclude(state=R.EXITED).exists(), "every role to end", 60, logs
    )
