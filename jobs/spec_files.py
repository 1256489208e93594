"""The files a spec names, checked at submit where the control plane can see them.

Runs after ``jobs.confinement`` has allowed every path, so what these checks reveal (a file is missing, a
parquet's columns) is about files the team may read anyway; a refusal of a path outside the team's roots
never depends on the file.

The control plane need not mount the hosts' filesystems, so a path is checked only when the allowed root it
lies in (the team's run directory, a data root, the shared model root: the innermost that holds it) is a
directory here; otherwise nothing is said and the runtime's preflight on the host remains the check (exit 2,
the run failed once). What is checked, without reading any file whole:

* ``model.path``: a directory with a ``config.json`` (the rule of ``runtime.models.loading.check_model_path``,
  written here because importing that module imports torch); with ``rollout.engine: vllm``, a head size vLLM
  serves on the run's device (``runtime.vllm_support.head_dim_problem``, the runtime's preflight rule);
* ``task.path``, ``task.eval_path``: a file; for ``task.name: dataset`` a readable one whose columns include
  ``task.prompt_key`` and ``task.answer_key`` (``runtime.tasks.dataset.dataset_columns``: a parquet or arrow
  file's schema, a json / jsonl file's first record). Rows are the runtime's to check.

A file the control plane cannot read (a permission or I/O error) is not judged. Paths are resolved as confinement
resolves them (links followed, relative ones from ``settings.BASE_DIR``) and messages name the resolved path.
"""

from __future__ import annotations

from pathlib import Path

from django.conf import settings

from jobs import confinement
from rlplatform.models import Team
from runtime.spec import RunSpec
from runtime.tasks.dataset import DatasetFileError, check_keys, dataset_columns
from runtime.vllm_support import head_dim_problem

__all__ = ["MODEL_CONFIG", "dataset_file_problem", "model_dir_problem", "spec_file_problems"]

MODEL_CONFIG = "config.json"  # what makes a directory a Hugging Face model directory


def _visible_root(team: Team, path: Path) -> Path | None:
    """The innermost allowed root holding ``path``, when it is a directory on the control plane; None when it is
    not here (its files live on the hosts only) or there is none (the path is not one confinement allows)."""
    checkpoints = confinement.checkpoint_root()
    if path.is_relative_to(checkpoints):  # confinement allows only the team's run directories there
        parts = path.relative_to(checkpoints).parts
        holding = [checkpoints / parts[0]] if parts else []
    else:
        holding = [root for root in confinement.readable_roots(team) if path.is_relative_to(root)]
    # innermost: a data root whose parent is mounted here while it is not says nothing of its files
    root = max(holding, key=lambda r: len(r.parts), default=None)
    return root if root is not None and root.is_dir() else None


def model_dir_problem(path: Path) -> str | None:
    """What keeps ``path`` from being a model directory the runtime loads, or None."""
    if not path.is_dir():
        return f"no such model directory: {path}"
    if not (path / MODEL_CONFIG).is_file():
        return f"{path} has no {MODEL_CONFIG} (not a Hugging Face model directory)"
    return None


def dataset_file_problem(path: str, field: str, prompt_key: str, answer_key: str) -> str | None:
    """What keeps the dataset file at ``path`` from being read with these keys, as far as its schema or first
    record shows; None when nothing does (or its first record is too long to read here)."""
    try:
        columns = dataset_columns(path, field)
        if columns is not None:
            check_keys(columns, path, field, prompt_key, answer_key)
    except DatasetFileError as exc:
        return exc.problem
    return None


def _model_problem(spec: RunSpec, path: Path) -> str | None:
    problem = model_dir_problem(path)
    if problem is None and spec.rollout.engine == "vllm" and spec.workload == "llm":
        problem = head_dim_problem(path, spec.resources.device)
    return problem


def _task_file_problem(spec: RunSpec, field: str, path: Path) -> str | None:
    if not path.is_file():
        return f"no such file: {path}"
    if spec.task.name != "dataset":  # the jsonl task's rows (fixed keys) are the runtime's to read
        return None
    return dataset_file_problem(str(path), field, spec.task.prompt_key, spec.task.answer_key)


def spec_file_problems(team: Team, spec: RunSpec) -> list[dict[str, str]]:
    """Field errors of the files ``spec`` names that the control plane can see; call after confinement."""
    named = {"model.path": spec.model.path, "task.path": spec.task.path, "task.eval_path": spec.task.eval_path}
    errors = []
    for field, value in named.items():
        if not value:
            continue
        path = confinement.resolve_spec_path(Path(settings.BASE_DIR), value)
        if path is None or _visible_root(team, path) is None:
            continue
        try:
            problem = _model_problem(spec, path) if field == "model.path" else _task_file_problem(spec, field, path)
        except OSError:  # the control plane's permissions or mount troubles say nothing of the hosts' view
            continue
        if problem is not None:
            errors.append({"field": field, "message": problem})
    return errors
