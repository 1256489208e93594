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


def take(free_by_host: MutableMapping[int, list[int]], host_of: Mapping[int, int], chosen: Sequence[int]) -> None:
    """Remove ``chosen`` devices from ``free_by_host``, in place (``host_of``: device id -> host id).

    Touches only the hosts of the chosen devices, so a pass admitting many
    small runs stays linear in the devices it hands out.
    """
    taken = set(chosen)
    for host_id in {host_of[d] for d in taken}:
        free_by_host[host_id] = [d for d in free_by_host[host_id] if d not in taken]
