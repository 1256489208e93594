"""A run's directory, an attempt's files in it, and what a role's log says at its end.

jobs/rolewrap.py writes an attempt's ``pid``, ``log`` and ``exit_code`` under :func:`role_dir`; the
runtime's last lines say why it ended (runtime/__main__.py: an ``error: <reason>`` line, then a JSON
line with its ``outcome``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from jobs import confinement
from jobs.models import RunRole


def run_dir(run_id: int) -> Path:
    """The run's directory: checkpoints, reporter spools, role logs (inside the checkpoint root)."""
    return confinement.run_directory(run_id)


def role_dir(role: RunRole) -> Path:
    """One attempt's files: ``pid``, ``log``, ``exit_code`` (jobs/rolewrap.py)."""
    return Path(role.workdir) / "roles" / role.name / f"attempt-{role.attempt}"


def read_tail(path: Path, size: int = 8192) -> str:
    """The last ``size`` bytes of a file as text ('' when it is missing): a role's log."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - size))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def last_json_line(log_tail: str) -> dict[str, Any]:
    """The last JSON object line of a log tail ({} when none): the runtime's final ``{"outcome": ...}``."""
    for line in reversed(log_tail.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return {}


def last_error_line(log_tail: str) -> str:
    """The runtime's one-line reason (``error: ...``) from the end of its log, or ''."""
    for line in reversed(log_tail.splitlines()):
        if line.startswith("error: "):
            return line[len("error: ") :].strip()
    return ""
