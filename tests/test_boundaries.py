"""The dependency direction of DESIGN.md, enforced.

runtime/ never imports the platform (Django, rlplatform, jobs); the spec module
imports without torch so the platform can validate submissions with it; the CI
client imports without Django. No import cycle runs through jobs/, counting
imports inside functions too, and jobs/ hides no new first-party import inside
a function.
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


# What the platform may import of the runtime: the spec (to validate submissions), the contract (what
# the halves agree on), the dataset task's file rule (submit reads a dataset file's columns as the runtime
# does: jobs/spec_files.py) and what vLLM can serve (a model's head size, read from its config.json). Anything
# else would tie the web processes to the runtime's internals (and torch).
PLATFORM_MAY_IMPORT = {"runtime", "runtime.spec", "runtime.contract", "runtime.tasks.dataset", "runtime.vllm_support"}


@pytest.mark.parametrize("module", ["runtime.tasks.dataset", "runtime.vllm_support"])
def test_the_file_rules_the_platform_uses_import_without_torch_or_django(module):
    loaded = _modules_loaded_by(f"import {module}")
    assert "torch" not in loaded and "transformers" not in loaded and "vllm" not in loaded
    assert not loaded & PLATFORM_MODULES


def _runtime_modules_imported_by(path: Path) -> set[str]:
    """Runtime modules ``path`` imports, at any depth (``from runtime import contract`` counts as
    runtime.contract)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "runtime")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "runtime":
                found.update(f"runtime.{a.name}" for a in node.names)
            elif node.module.split(".")[0] == "runtime":
                found.add(node.module)
    return found


def test_the_platform_imports_only_the_spec_the_contract_and_the_dataset_rule_of_the_runtime():
    offenders = {}
    for folder in ("jobs", "rlplatform"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            bad = _runtime_modules_imported_by(path) - PLATFORM_MAY_IMPORT
            if bad:
                offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert offenders == {}


def test_contract_imports_without_torch_or_django():
    # jobs imports runtime.contract (the ingest schema, retention, role names) in its web processes.
    loaded = _modules_loaded_by("import runtime.contract")
    assert "torch" not in loaded
    assert not loaded & PLATFORM_MODULES


# --- import cycles and hidden imports in jobs/ ----------------------------------------------------------

FIRST_PARTY = ("jobs", "runtime", "rlplatform")

# Function-local first-party imports jobs/ may keep, (importing module, imported module) -> why. Anything
# else goes at the top of its module: an import inside a function hides a dependency (and often a cycle).
ALLOWED_FUNCTION_LOCAL_IMPORTS = {
    ("jobs.stream", "rlplatform.api"): (
        "rlplatform.api loads DRF and drf-spectacular; every process that streams (Celery workers, through "
        "jobs.handler) imports jobs.stream, and only the cluster view's group usage needs the REST layer"
    ),
    ("jobs.stream", "rlplatform.models"): "imported beside rlplatform.api in group_usage; could move to the top",
}


def _first_party_modules() -> dict[str, Path]:
    modules = {}
    for package in FIRST_PARTY:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _imports(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, bool]]:
    """(first-party module imported, whether inside a function) for every import statement of ``path``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{alias.name}" for alias in child.names]
            else:
                visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))
                continue
            for name in names:
                while name and name not in modules:  # the longest first-party module it is or lies in
                    name = name.rpartition(".")[0]
                if name and name != module and not module.startswith(name + "."):
                    found.append((name, in_function))

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycle_runs_through_jobs():
    modules = _first_party_modules()
    graph = {module: {name for name, _ in _imports(module, path, modules)} for module, path in modules.items()}
    through_jobs = [cycle for cycle in _cycles(graph) if any(m.split(".")[0] == "jobs" for m in cycle)]
    assert through_jobs == []


def test_jobs_hides_no_new_first_party_import_inside_a_function():
    modules = _first_party_modules()
    hidden = {
        (module, name)
        for module, path in modules.items()
        if module.split(".")[0] == "jobs"
        for name, in_function in _imports(module, path, modules)
        if in_function
    }
    assert sorted(hidden - set(ALLOWED_FUNCTION_LOCAL_IMPORTS)) == [], "move these imports to the module's top"
    assert sorted(set(ALLOWED_FUNCTION_LOCAL_IMPORTS) - hidden) == [], "gone: take them off the allow-list"
