"""The UI's pure JavaScript helpers, run by Node (skipped where Node is absent; make test has it for npm)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")


def _node(script: str):
    result = subprocess.run(
        [NODE, "--input-type=module", "-e", script], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_ema_is_debiased_keeps_gaps_and_is_off_at_zero():
    out = _node(
        'import { ema } from "./frontend/js/smoothing.js";'
        "console.log(JSON.stringify([ema([1, 2, null, 4], 0.5), ema([3, 5], 0), ema([2, 2, 2], 0.9)]));"
    )
    # By hand: avg 0.5, 1.25, -, 2.625 over weights 0.5, 0.75, -, 0.875.
    assert out[0] == [1, 1.25 / 0.75, None, 2.625 / 0.875]
    assert out[1] == [3, 5]
    assert out[2] == pytest.approx([2, 2, 2])  # a constant stays put (no pull towards zero)


def test_every_module_parses():
    # Through stdin as a module: `node --check file.js` would read the file as CommonJS.
    for path in sorted((ROOT / "frontend" / "js").glob("*.js")):
        result = subprocess.run(
            [NODE, "--input-type=module", "--check"], input=path.read_text(), capture_output=True, text=True, timeout=30
        )
        assert result.returncode == 0, f"{path.name}: {result.stderr}"


def test_device_charts_are_laid_out_per_device_from_its_first_point():
    out = _node(
        'import { newDeviceCharts } from "./frontend/js/device_charts.js";'
        "const keys = ['reward/mean', 'device/trainer-0/cpu/util', 'device/trainer-0/cpu/mem_used_bytes',"
        " 'device/trainer-0/cpu/mem_peak_bytes', 'device/rollout-1/cuda0/temp_c', 'device/x/y/unknown'];"
        "const charted = new Set(['device/rollout-1/cuda0/temp_c']);"
        "console.log(JSON.stringify([newDeviceCharts(keys, (k) => false), newDeviceCharts(keys, (k) => charted.has(k))]));"
    )
    every, fresh = out
    assert every == [
        {"title": "trainer-0 · cpu: utilisation (%)", "keys": ["device/trainer-0/cpu/util"]},
        {
            "title": "trainer-0 · cpu: memory (bytes)",
            "keys": ["device/trainer-0/cpu/mem_used_bytes", "device/trainer-0/cpu/mem_peak_bytes"],
        },
        {"title": "rollout-1 · cuda0: temperature (°C)", "keys": ["device/rollout-1/cuda0/temp_c"]},
    ]
    assert fresh == every[:2]  # a device already charted gets nothing new
