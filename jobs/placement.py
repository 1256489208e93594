"""Choosing concrete devices for a gang: one host if possible, then one switch, then fewest hosts.

Pure functions over plain data, so the packing rules are tested without a
database. Ties are broken by host order (pk), so placement is deterministic.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence


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


def take(free_by_host: MutableMapping[int, list[int]], host_of: Mapping[int, int], chosen: Sequence[int]) -> None:
    """Remove ``chosen`` devices from ``free_by_host``, in place (``host_of``: device id -> host id).

    Touches only the hosts of the chosen devices, so a pass admitting many
    small runs stays linear in the devices it hands out.
    """
    taken = set(chosen)
    for host_id in {host_of[d] for d in taken}:
        free_by_host[host_id] = [d for d in free_by_host[host_id] if d not in taken]


def split_roles(
    devices_by_host: Mapping[int, Sequence[int]], trainer_share: int, remote_workers: int
) -> tuple[int, list[int], list[tuple[int, int]]] | str:
    """Divide a run's allocated devices among its roles.

    ``devices_by_host`` maps host id -> the run's device indices there. The trainer role takes
    ``trainer_share`` devices on one host: the host holding most of the run's devices that can hold it
    (ties: lowest host id); each remote rollout instance takes one of the devices left, the trainer's
    host first, then the others by host id. Returns ``(trainer_host, trainer_indices, [(host, index)
    per rollout instance])``, or a one-line reason when the devices cannot be divided that way.
    """
    total = sum(len(indices) for indices in devices_by_host.values())
    if total != trainer_share + remote_workers:
        return f"it holds {total} devices but needs {trainer_share + remote_workers}"
    hosts = sorted(devices_by_host, key=lambda h: (-len(devices_by_host[h]), h))
    fitting = [h for h in hosts if len(devices_by_host[h]) >= trainer_share]
    if not fitting:
        most = len(devices_by_host[hosts[0]]) if hosts else 0
        return (
            f"its trainer needs {trainer_share} devices on one host, but its {total} devices lie on "
            f"{len(hosts)} hosts with at most {most} on one"
        )
    home = fitting[0]
    indices = sorted(devices_by_host[home])
    rest = [(home, i) for i in indices[trainer_share:]]
    rest += [(h, i) for h in sorted(devices_by_host) if h != home for i in sorted(devices_by_host[h])]
    return home, indices[:trainer_share], rest
