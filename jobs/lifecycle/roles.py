"""A run's roles: which ones its current admission launches, where they go, which attempts are current.

Every admission launches all of a run's roles together: its trainer roles (as many as the hosts its
trainer ranks lie on), then its remote rollout roles, then its remote evaluator. Where each goes follows
from the run's active allocations alone (jobs.placement.split_roles), so the answer is the same for the
whole admission, whoever asks.
"""

from __future__ import annotations

from typing import Any

from jobs import placement
from jobs.lifecycle.names import is_trainer, rollout_names, trainer_names
from jobs.models import Allocation, Run, RunRole
from jobs.models import RoleState as R
from jobs.states import RunState
from rlplatform.models import Host
from runtime.contract import EVALUATOR_ROLE, TRAINER_ROLE

Placed = dict[str, tuple[int, list[int]]]  # role name -> (host id, device indices), trainer-0 first


def resources_of(run: Run) -> dict[str, Any]:
    """The ``resources`` section of the run's resolved spec."""
    return run.resolved_spec.get("resources", {}) or {}


def remote_rollout_workers(run: Run) -> int:
    return int(resources_of(run).get("remote_rollout_workers", 0) or 0)


def remote_evaluator(run: Run) -> bool:
    return bool(resources_of(run).get("remote_evaluator", False))


def uses_link(run: Run) -> bool:
    """Whether roles of the run connect to trainer-0 (runtime.rollout.link): remote rollout roles, the evaluator."""
    return remote_rollout_workers(run) > 0 or remote_evaluator(run)


def _serving_roles(run: Run) -> list[str]:
    """The roles that serve trainer-0 from devices of their own: remote rollout instances, the evaluator."""
    return rollout_names(remote_rollout_workers(run)) + ([EVALUATOR_ROLE] if remote_evaluator(run) else [])


def role_names(run: Run) -> list[str]:
    """Every role the current admission of ``run`` launches: its trainer roles, then its remote rollout
    instances (how many trainer roles: how its allocated devices lie, see :func:`placed_roles`)."""
    placed = placed_roles(run)
    if isinstance(placed, str):
        return [TRAINER_ROLE, *_serving_roles(run)]
    return list(placed)


def place_roles(run: Run, devices: list[tuple[int, int]]) -> Placed | str:
    """Role name -> (host id, device indices) for the run's allocated ``(host id, index)`` devices, in launch
    order (``trainer-0`` first), or the reason they cannot be divided among its roles."""
    by_host: dict[int, list[int]] = {}
    for host_id, index in devices:
        by_host.setdefault(host_id, []).append(index)
    labels = Host.objects.filter(pk__in=by_host).values_list("pk", "labels")
    switch_of = {
        pk: (str(lab["switch"]) if isinstance(lab, dict) and lab.get("switch") else None) for pk, lab in labels
    }
    split = placement.split_roles(by_host, placement.shape_of(resources_of(run), run.devices_requested), switch_of)
    if isinstance(split, str):
        return split
    trainer, others = split
    placed = {
        name: (host_id, indices) for name, (host_id, indices) in zip(trainer_names(len(trainer)), trainer, strict=True)
    }
    for name, (host_id, index) in zip(_serving_roles(run), others, strict=True):
        placed[name] = (host_id, [index])
    return placed


def placed_roles(run: Run) -> Placed | str:
    """:func:`place_roles` over the run's active allocations: the same answer for the whole admission."""
    devices = list(
        Allocation.objects.active()
        .filter(run=run)
        .order_by("device__host_id", "device__index")
        .values_list("device__host_id", "device__index")
    )
    return place_roles(run, devices)


def trainer_ranks(placed: Placed, resources: dict[str, Any]) -> dict[str, range]:
    """The data-parallel ranks each trainer role runs: ``trainer-0`` first, on its first devices (its
    rollout and evaluator devices come after them), then each further trainer role on all of its own."""
    extras = placement.shape_of(resources).lead - 1  # trainer-0's rollout and evaluator devices
    ranks, first = {}, 0
    for name, (_host, indices) in placed.items():
        if is_trainer(name):
            count = len(indices) - (extras if name == TRAINER_ROLE else 0)
            ranks[name] = range(first, first + count)
            first += count
    return ranks


def superseded(role: RunRole, run: Run) -> bool:
    """Whether ``role``'s live attempt is left from an earlier admission of ``run``.

    jobs.launch queues every role of an admission together, and only once no role of the run is live.
    So while the run is ADMITTED, another of its roles that is not live means this attempt belongs to
    the admission before (the run was requeued and admitted again before this attempt ended)."""
    if run.state != RunState.ADMITTED:
        return False
    live_others = RunRole.objects.filter(run_id=run.pk).exclude(pk=role.pk).exclude(state=R.EXITED).count()
    return live_others < len(role_names(run)) - 1
