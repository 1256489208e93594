"""What the real-vLLM tests share: the GRPO spec they start from (see conftest.py for the model fixtures)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The task and sizes every test here shares: short reversals, a step in a fraction of a second.
TASK: dict[str, Any] = {"name": "reverse", "min_len": 1, "max_len": 4, "eval_size": 32}


def vllm_spec(tmp_path: Path, name: str, model: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """A GRPO run on vLLM's CPU build over ``model``; sections' fields replaced as given."""
    data: dict[str, Any] = {
        "name": name,
        "seed": 0,
        "output_dir": str(tmp_path / name),
        "model": {"path": str(model)},
        "task": dict(TASK),
        "algorithm": {"name": "grpo", "group_size": 4},
        "trainer": {"lr": 1e-3},
        "rollout": {"engine": "vllm", "max_new_tokens": 8, "max_batch_size": 32, "kv_cache_gib": 0.25},
        "pipeline": {"steps": 4, "prompts_per_step": 8, "eval_interval": 0},
        "resources": {"device": "cpu", "threads_per_process": 1},
        "metrics": {"progress_bar": False},
    }
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    return data
