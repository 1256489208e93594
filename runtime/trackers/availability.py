"""Which trackers this interpreter can import, found without importing them (a run that does not ask for a
tracker never loads it). Standard library only: :mod:`runtime.spec` checks ``metrics.reporters`` with it at
submit, on the control plane, which has no torch."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

# tracker name in metrics.reporters -> the package it needs (pip name, import name)
TRACKER_PACKAGES: dict[str, str] = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
INSTALL_HINT = "pip install -r requirements-trackers.txt"


def installed(tracker: str) -> bool:
    """Whether the package ``tracker`` needs can be imported here (a ``sys.modules`` entry of None, as a
    test sets to simulate its absence, counts as missing)."""
    try:
        return importlib.util.find_spec(TRACKER_PACKAGES[tracker]) is not None
    except (ImportError, ValueError):  # a broken or half-imported package
        return False


def missing(trackers: Iterable[str]) -> list[str]:
    """The trackers of ``trackers`` whose package is not installed, in order."""
    return [name for name in trackers if not installed(name)]
