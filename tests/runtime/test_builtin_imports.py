"""A built-in model's run trains the plain decoder (runtime/models/decoder.py), never transformers' model classes.
Checked on a whole run through the CLI, with ``-X importtime`` listing every module the process imported. (Start-up
is not a target: the trainer's fused AdamW, torch.optim's, imports ``torch._dynamo``, and that is fine.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.runtime.helpers import ROOT

# bench/startup.py's overrides, one step
OVERRIDES = ["pipeline.steps=1", "pipeline.eval_interval=0", "checkpoint.interval=0", "resources.threads_per_process=1"]


def _imported(stderr: str) -> set[str]:
    """Module names from ``-X importtime`` lines (``import time: self | cumulative | name``)."""
    return {
        line.rsplit("|", 1)[1].strip()
        for line in stderr.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }


def imported_by_a_run(out, *overrides: str) -> set[str]:
    """Every module a one-step ``examples/grpo-sync.yaml`` run into ``out`` with ``overrides`` imported
    (``-X importtime``)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "runtime", "run", "examples/grpo-sync.yaml", f"output_dir={out}"]
        + OVERRIDES
        + list(overrides),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "metrics.jsonl").is_file()
    imported = _imported(proc.stderr)
    assert "torch" in imported and "runtime.models.decoder" in imported  # the listing is what it claims
    return imported


def transformers_model_modules(imported: set[str]) -> list[str]:
    return sorted(m for m in imported if m.startswith("transformers.models") or m == "transformers.modeling_utils")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_builtin_run_imports_no_transformers_model_class(tmp_path, mode):
    """async: the trainer also builds the probe's and evaluator's meta-device skeleton (PublishedPolicy)."""
    imported = imported_by_a_run(tmp_path / "run", f"pipeline.mode={mode}")
    assert transformers_model_modules(imported) == []
    assert "runtime.train.optimizer" in imported  # the run trained
