"""Which ranks and devices of this host a run's processes use.

The trainer ranks of a run may span hosts (``TANDEM_LOCAL_RANKS`` on the leader's host,
``--ranks`` / ``TANDEM_RANKS`` on the others); on each host the trainer's devices come first,
then the rollout devices, then the evaluator's. Read by the trainer group, the rollout
instances and the evaluator alike, so it belongs to none of them.
"""

from __future__ import annotations

import os
from typing import Any

from runtime.contract import ENV_LOCAL_RANKS
from runtime.spec import RunSpec


class TrainerGroupError(RuntimeError):
    """A trainer rank failed or cannot be reached."""


def parse_ranks(text: str, world: int, what: str) -> range:
    """``first-last`` (or one rank) -> range, within ``[0, world)``; a clear error naming ``what`` otherwise."""
    first, sep, last = text.strip().partition("-")
    try:
        ranks = range(int(first), int(last if sep else first) + 1)
    except ValueError:
        raise TrainerGroupError(f"{what}: expected first-last, e.g. 0-3, got {text!r}") from None
    if not ranks or ranks.start < 0 or ranks.stop > world:
        raise TrainerGroupError(f"{what}: {text!r} is not within the run's ranks 0-{world - 1}")
    return ranks


def local_ranks(world: int, environ: Any = os.environ) -> range:
    """The ranks the leader's host runs (``TANDEM_LOCAL_RANKS``; default all). They include rank 0, and
    ranks beyond them need a rendezvous every host reaches (``MASTER_ADDR`` / ``MASTER_PORT``)."""
    text = environ.get(ENV_LOCAL_RANKS, "").strip()
    if not text:
        return range(world)
    ranks = parse_ranks(text, world, ENV_LOCAL_RANKS)
    if ranks.start != 0:
        raise TrainerGroupError(f"{ENV_LOCAL_RANKS}: {text!r} must include rank 0, the leader")
    if len(ranks) < world and not (environ.get("MASTER_ADDR") and environ.get("MASTER_PORT")):
        raise TrainerGroupError(
            f"{ENV_LOCAL_RANKS}={text}: ranks on other hosts need MASTER_ADDR and MASTER_PORT (the rendezvous)"
        )
    return ranks


def trainer_devices_here(spec: RunSpec) -> int:
    """Trainer ranks on this host: all of them, or those ``TANDEM_LOCAL_RANKS`` names (the others run on
    other hosts, runtime.train.group); this host's rollout and evaluator devices come after them."""
    return len(local_ranks(spec.resources.trainer_devices))


def rollout_device_index(spec: RunSpec, rank: int) -> int:
    """Rollout devices follow this host's trainer devices; 0 when they share (CPU)."""
    r = spec.resources
    return trainer_devices_here(spec) + rank % r.rollout_devices if r.rollout_devices else 0


def eval_device_index(spec: RunSpec) -> int | None:
    """The evaluator's own device (after this host's trainer and rollout devices), or None when it has
    none (``eval_devices: 0``) and shares the trainer's."""
    r = spec.resources
    return trainer_devices_here(spec) + r.rollout_devices if r.eval_devices else None
