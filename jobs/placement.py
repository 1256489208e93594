"""Choosing concrete devices for a gang: one host if possible, then one switch, then fewest hosts.

Pure functions over plain data, so the packing rules are tested without a
database. Ties are broken by host order (pk), so placement is deterministic.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any


def place(
    need: int,
    free_by_host: Mapping[int, Sequence[int]],
    switch_of: Mapping[int, str | None],
) -> list[int] | None:
    """Device ids for ``need`` devices, or None when the free devices do not suffice.

    ``free_by_host`` maps host id -> free device ids (in device-index order);
    ``switch_of`` maps host id -> its switch label (None: unknown, never grouped).

    1. One host: the host with the fewest free devices that still fits (best
       fit keeps big hosts whole for big gangs).
    2. One switch: the switch with the fewest free devices that fits, filled
       from its fullest hosts (fewest hosts).
    3. Anywhere: fullest hosts first (fewest hosts).
    """
    if need <= 0:
        return []
    hosts = sorted(h for h, devices in free_by_host.items() if devices)
    if sum(len(free_by_host[h]) for h in hosts) < need:
        return None

    fitting = [h for h in hosts if len(free_by_host[h]) >= need]
    if fitting:
        best = min(fitting, key=lambda h: (len(free_by_host[h]), h))
        return list(free_by_host[best][:need])

    by_switch: dict[str, list[int]] = {}
    for h in hosts:
        switch = switch_of.get(h)
        if switch is not None:
            by_switch.setdefault(switch, []).append(h)
    fitting_switches = [
        (sum(len(free_by_host[h]) for h in members), switch)
        for switch, members in by_switch.items()
        if sum(len(free_by_host[h]) for h in members) >= need
    ]
    if fitting_switches:
        _, switch = min(fitting_switches)
        return _fill(need, by_switch[switch], free_by_host)
    return _fill(need, hosts, free_by_host)


def _fill(need: int, hosts: Sequence[int], free_by_host: Mapping[int, Sequence[int]]) -> list[int]:
    chosen: list[int] = []
    for h in sorted(hosts, key=lambda h: (-len(free_by_host[h]), h)):
        take = min(need - len(chosen), len(free_by_host[h]))
        chosen.extend(free_by_host[h][:take])
        if len(chosen) == need:
            break
    return chosen


def place_with_home(
    need: int,
    home: int,
    free_by_host: Mapping[int, Sequence[int]],
    switch_of: Mapping[int, str | None],
) -> list[int] | None:
    """Device ids for ``need`` devices of which ``home`` lie on one host (a run's trainer share; the
    rest are its remote rollout roles, one device each, anywhere), or None when that cannot be done.

    :func:`place` decides first (one host, one switch, fewest hosts); when its choice keeps ``home`` of
    them together it stands (``home`` 0 or 1: no constraint, :func:`place` alone). Otherwise the home share goes to the host with the fewest free devices
    that holds it (best fit), and the rest are placed by :func:`place` among the devices left.
    """
    chosen = place(need, free_by_host, switch_of)
    if chosen is None or home <= 1:
        return chosen
    host_of = {d: h for h, devices in free_by_host.items() for d in devices}
    per_host: dict[int, int] = {}
    for d in chosen:
        per_host[host_of[d]] = per_host.get(host_of[d], 0) + 1
    if max(per_host.values()) >= home:
        return chosen
    fitting = [h for h, devices in free_by_host.items() if len(devices) >= home]
    if not fitting:
        return None
    best = min(fitting, key=lambda h: (len(free_by_host[h]), h))
    at_home = list(free_by_host[best][:home])
    rest = {h: (list(devices[home:]) if h == best else list(devices)) for h, devices in free_by_host.items()}
    others = place(need - home, rest, switch_of)
    return None if others is None else at_home + others


@dataclass(frozen=True)
class Shape:
    """What placing one run asks for: ``need`` devices, ``home`` of them the trainer's (its data-parallel
    ranks plus the leader's own rollout and evaluator devices; the rest are remote rollout roles and a
    remote evaluator, one device each, anywhere), and at least ``lead`` of those on the leader's host
    (rank 0 + its rollout and evaluator devices: they are processes of the leader)."""

    need: int
    home: int
    lead: int


def shape_of(resources: Mapping[str, Any] | None, need: int | None = None) -> Shape:
    """The :class:`Shape` of a run from its resolved spec's ``resources`` section; ``need``: the devices
    the run was admitted for (its ``devices_requested``), which wins over the spec's count."""
    r = resources or {}

    def count(key: str) -> int:
        return int(r.get(key, 0) or 0)

    extras = count("rollout_devices") + count("eval_devices")
    remote = count("remote_rollout_workers") + int(bool(r.get("remote_evaluator")))  # one device each, anywhere
    home = max(1, count("trainer_devices")) + extras if need is None else max(0, need - remote)
    return Shape(home + remote, home, max(1, min(extras + 1, home)))


def place_run(
    shape: Shape, free_by_host: Mapping[int, Sequence[int]], switch_of: Mapping[int, str | None]
) -> list[int] | None:
    """Device ids for a run of ``shape`` (trainer's share first when it spans hosts), or None.

    1. The whole share on one host when one holds it (:func:`place_with_home`).
    2. Otherwise its ranks spread (:func:`spread`: one switch, then fewest hosts), the leader's host
       holding ``lead``; then the remote rollout roles by :func:`place` among the devices left.
    """
    chosen = place_with_home(shape.need, shape.home, free_by_host, switch_of)
    if chosen is not None or shape.home <= 1:
        return chosen
    parts = spread(shape.home, shape.lead, free_by_host, switch_of)
    if parts is None:
        return None
    trainer = [d for _host, devices in parts for d in devices]
    taken = set(trainer)
    rest = {h: [d for d in devices if d not in taken] for h, devices in free_by_host.items()}
    others = place(shape.need - shape.home, rest, switch_of)
    return None if others is None else trainer + others


def spread(
    home: int, lead: int, free_by_host: Mapping[int, Sequence[int]], switch_of: Mapping[int, str | None]
) -> list[tuple[int, list[int]]] | None:
    """A trainer share of ``home`` devices over several hosts: ``[(host, devices)]``, the leader's first.

    Within the switch with the fewest free devices that holds the share, else anywhere; fullest hosts
    first (fewest hosts), so the leader's host is the fullest, and it must hold ``lead`` (else None).
    """
    hosts = sorted(h for h, devices in free_by_host.items() if devices)
    by_switch: dict[str, list[int]] = {}
    for h in hosts:
        switch = switch_of.get(h)
        if switch is not None:
            by_switch.setdefault(switch, []).append(h)
    total = {switch: sum(len(free_by_host[h]) for h in members) for switch, members in by_switch.items()}
    fitting = sorted((s for s in by_switch if total[s] >= home), key=lambda s: (total[s], s))
    pools = [by_switch[s] for s in fitting]
    for pool in [*pools, hosts]:
        ordered = sorted(pool, key=lambda h: (-len(free_by_host[h]), h))
        if not ordered or len(free_by_host[ordered[0]]) < lead or sum(len(free_by_host[h]) for h in pool) < home:
            continue
        parts, left = [], home
        for h in ordered:
            take = min(left, len(free_by_host[h]))
            parts.append((h, list(free_by_host[h][:take])))
            left -= take
            if not left:
                return parts
    return None


def take(free_by_host: MutableMapping[int, list[int]], host_of: Mapping[int, int], chosen: Sequence[int]) -> None:
    """Remove ``chosen`` devices from ``free_by_host``, in place (``host_of``: device id -> host id).

    Touches only the hosts of the chosen devices, so a pass admitting many
    small runs stays linear in the devices it hands out.
    """
    taken = set(chosen)
    for host_id in {host_of[d] for d in taken}:
        free_by_host[host_id] = [d for d in free_by_host[host_id] if d not in taken]


def split_roles(
    devices_by_host: Mapping[int, Sequence[int]], shape: Shape, switch_of: Mapping[int, str | None]
) -> tuple[list[tuple[int, list[int]]], list[tuple[int, int]]] | str:
    """Divide a run's allocated devices among its roles.

    ``devices_by_host`` maps host id -> the run's device indices there. The trainer takes ``shape.home``
    of them: on one host when one holds them all (the host holding most of the run's devices that can;
    ties: lowest host id), else spread over hosts by :func:`spread` (one switch, then fewest hosts, the
    leader's host first). Each remote rollout instance (then a remote evaluator) takes one of the devices
    left, the trainer's hosts first, then the others by host id. Returns ``([(host, indices)] of the
    trainer, leader first, [(host, index)] per other role)``, or a one-line reason when the devices
    cannot be divided.
    """
    total = sum(len(indices) for indices in devices_by_host.values())
    if total != shape.need:
        return f"it holds {total} devices but needs {shape.need}"
    hosts = sorted(devices_by_host, key=lambda h: (-len(devices_by_host[h]), h))
    fitting = [h for h in hosts if len(devices_by_host[h]) >= shape.home]
    if fitting:
        indices = sorted(devices_by_host[fitting[0]])
        trainer = [(fitting[0], indices[: shape.home])]
    else:
        spread_out = spread(shape.home, shape.lead, {h: sorted(d) for h, d in devices_by_host.items()}, switch_of)
        if spread_out is None:
            most = len(devices_by_host[hosts[0]]) if hosts else 0
            return (
                f"its trainer's first host needs {shape.lead} devices (rank 0 with its rollout and evaluator "
                f"devices), but its {total} devices lie on {len(hosts)} hosts with at most {most} on one"
            )
        trainer = spread_out
    used = {h: set(indices) for h, indices in trainer}
    order = [h for h, _ in trainer] + sorted(h for h in devices_by_host if h not in used)
    rest = [(h, i) for h in order for i in sorted(devices_by_host[h]) if i not in used.get(h, ())]
    return trainer, rest
