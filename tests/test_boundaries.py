"""The dependency direction of DESIGN.md, enforced.

runtime/ never imports the platform (Django, rlplatform, jobs); the spec module
imports without torch so the platform can validate submissions with it; the CI
client imports without Django.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLATFORM_MODULES = {"django", "rest_framework", "channels", "celery", "rlplatform", "jobs", "drf_spectacular"}


def _imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_runtime_source_imports_no_platform_module():
    offenders = {}
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        bad = _imported_top_levels(path) & PLATFORM_MODULES
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert offenders == {}


def _modules_loaded_by(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return {name.split(".")[0] for name in out.stdout.split()}


def test_spec_imports_without_torch_or_django():
    loaded = _modules_loaded_by("import runtime.spec")
    assert "torch" not in loaded
    assert not loaded & PLATFORM_MODULES


@pytest.mark.skipif(not (ROOT / "jobs" / "client.py").exists(), reason="CLI client not present")
def test_ci_client_imports_without_django():
    loaded = _modules_loaded_by("import jobs.client")
    assert "django" not in loaded
    assert "torch" not in loaded
