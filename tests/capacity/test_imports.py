"""The capacity package loads without Django or torch (the platform's web processes and planners use it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_capacity_imports_without_django_or_torch():
    code = "import sys, capacity, capacity.hardware; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = {name.split(".")[0] for name in out.stdout.split()}
    assert not loaded & {"torch", "django", "rest_framework", "celery", "runtime", "jobs", "rlplatform", "pydantic"}
    assert {"simpy", "numpy"} <= loaded
