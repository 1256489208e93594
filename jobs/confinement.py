"""Which files and code a run may name: the one place where paths from specs and from ingest are confined.

Every path is resolved first (symlinks followed, ``..`` folded), then:

* a checkpoint a run's token registers must lie inside that run's own directory,
  ``<TANDEM_CHECKPOINT_ROOT>/run-<id>`` (relative paths are taken from the checkpoint root);
* a path a spec names (``model.path``, ``task.path``, ``task.eval_path``: every field called ``path`` or
  ``*_path``; relative ones are taken from where role processes start, ``settings.BASE_DIR``) and a
  fork's parent checkpoint must lie inside what the run's team may read: its own runs' directories,
  its data roots (``Team.data_roots``, set by an admin) or the shared model root
  (``settings.TANDEM_SHARED_MODEL_ROOT``). Inside the checkpoint root only the first counts, so a data
  root drawn around the checkpoint root opens no other team's run.

``output_dir`` is not checked: the platform replaces it with the run's own directory at launch.
The decision never looks at the file itself, so a refusal reads the same whether or not the path
exists. Only once a path is allowed does ``jobs.spec_files`` look at it (when its root is visible on the
control plane); the runtime checks it again when a role starts.

The code a spec names is confined too: a plug-in algorithm (``algorithm.name: package.module:factory``)
and a user's Gymnasium environment (``env.entry_point: package.module:make_env``) make every host of the
run import their module, so the platform takes one only from a module under a prefix the operator lists in
``settings.TANDEM_ALGORITHM_PLUGINS`` (none by default). The runtime's own
CLI, on the user's machine, keeps taking any.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

from django.conf import settings
from pydantic import BaseModel

from jobs.models import Run
from rlplatform.models import Team
from runtime.spec import RunSpec, resolved_value

__all__ = [
    "OUTSIDE_RUN",
    "OUTSIDE_TEAM",
    "SPEC_PATH_FIELDS",
    "inside_run",
    "plugin_allowed",
    "readable_roots",
    "refused_spec_paths",
    "resolve_spec_path",
    "team_may_read",
]

OUTSIDE_RUN = "must be inside this run's own directory (run-<id> under the checkpoint root)"
OUTSIDE_TEAM = "is not inside this team's run directories, its data roots or the shared model root"
_RUN_DIR = re.compile(r"^run-([1-9][0-9]{0,18})$")


def _spec_path_fields(model: type[BaseModel], prefix: str = "") -> tuple[str, ...]:
    """Dotted names of the spec's file-path fields, found by name so a new ``*_path`` field is confined too."""
    found: list[str] = []
    for name, info in model.model_fields.items():
        section = info.annotation
        optional = [arg for arg in typing.get_args(section) if arg is not type(None)]
        if len(optional) == 1:  # `Section | None` (model.lora): its fields are confined when it is set
            section = optional[0]
        if isinstance(section, type) and issubclass(section, BaseModel):
            found.extend(_spec_path_fields(section, f"{prefix}{name}."))
        elif name == "path" or name.endswith("_path"):
            found.append(f"{prefix}{name}")
    return tuple(found)


SPEC_PATH_FIELDS = _spec_path_fields(RunSpec)


def checkpoint_root() -> Path:
    return Path(settings.TANDEM_CHECKPOINT_ROOT).resolve()


def run_directory(run_id: int) -> Path:
    # Not resolved itself: a run-<id> that were a link to another run's directory must confine to nothing.
    return checkpoint_root() / f"run-{run_id}"


def resolve_spec_path(base: Path, value: Any) -> Path | None:
    """``value`` resolved against ``base``; None for anything that is not a usable path string."""
    if not isinstance(value, str) or not value or "\x00" in value:
        return None
    try:
        return (base / value).resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, an unreadable component
        return None


def inside_run(run_id: int, recorded: Any) -> Path | None:
    """A checkpoint path as the runtime reports it, resolved; None unless inside the run's own directory."""
    path = resolve_spec_path(checkpoint_root(), recorded)
    return path if path is not None and path.is_relative_to(run_directory(run_id)) else None


def readable_roots(team: Team) -> list[Path]:
    roots = [Path(item).resolve() for item in team.data_roots or [] if isinstance(item, str) and item]
    if settings.TANDEM_SHARED_MODEL_ROOT is not None:
        roots.append(Path(settings.TANDEM_SHARED_MODEL_ROOT).resolve())
    return roots


def _may_read(team: Team, path: Path | None) -> bool:
    if path is None:
        return False
    root = checkpoint_root()
    if path.is_relative_to(root):
        parts = path.relative_to(root).parts
        match = _RUN_DIR.match(parts[0]) if parts else None
        return match is not None and Run.objects.filter(pk=int(match[1]), experiment__team=team).exists()
    return any(path.is_relative_to(allowed) for allowed in readable_roots(team))


def team_may_read(team: Team, value: Any, *, base: Path | None = None) -> bool:
    """Whether ``team``'s runs may read ``value`` (relative: from ``base``, by default where roles start)."""
    return _may_read(team, resolve_spec_path(base or Path(settings.BASE_DIR), value))


def plugin_allowed(module: str) -> bool:
    """Whether ``module`` is one of, or inside, the packages in ``settings.TANDEM_ALGORITHM_PLUGINS``."""
    prefixes = (p.strip().rstrip(".") for p in settings.TANDEM_ALGORITHM_PLUGINS)
    # whole dotted components only: allowing `team_algos` must not allow `team_algos_evil`
    return any(p and (module == p or module.startswith(p + ".")) for p in prefixes)


# Spec fields that name a `package.module:callable` the run's hosts import: a plug-in algorithm, a user's
# Gymnasium environment. Both are confined to TANDEM_ALGORITHM_PLUGINS.
IMPORTED_FIELDS = ("algorithm.name", "env.entry_point")


def _refused_imports(resolved_spec: dict[str, Any]) -> list[dict[str, str]]:
    errors = []
    for field in IMPORTED_FIELDS:
        name = resolved_value(resolved_spec, field)
        if not isinstance(name, str) or ":" not in name:  # a registered algorithm or env: nothing is imported
            continue
        module = name.partition(":")[0]
        if plugin_allowed(module):
            continue
        message = (
            f"plug-in module {module!r} is not allowed on this platform: its operator allows plug-ins by listing "
            "their packages in the setting TANDEM_ALGORITHM_PLUGINS (comma-separated module prefixes)"
        )
        errors.append({"field": field, "message": message})
    return errors


def refused_spec_paths(team: Team, resolved_spec: dict[str, Any], parent_checkpoint: str = "") -> list[dict[str, str]]:
    """Field errors of what a resolved spec names that the platform refuses, checked at submit and again at
    each role start: a plug-in algorithm or env entry point outside TANDEM_ALGORITHM_PLUGINS, and one error per
    path (and the fork's parent checkpoint) the team may not read."""
    errors = _refused_imports(resolved_spec)
    errors += [
        {"field": field, "message": OUTSIDE_TEAM}
        for field in SPEC_PATH_FIELDS
        if resolved_value(resolved_spec, field) is not None
        and not team_may_read(team, resolved_value(resolved_spec, field))
    ]
    if parent_checkpoint and not team_may_read(team, parent_checkpoint, base=checkpoint_root()):
        errors.append({"field": "parent_checkpoint", "message": OUTSIDE_TEAM})
    return errors
