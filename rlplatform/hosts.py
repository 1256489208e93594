"""Host handler: registration, heartbeats and the lost-host watchdog.

Host agents (rlplatform.agent) call ``register_host`` when their Celery worker
starts and ``heartbeat`` every ``TANDEM_HEARTBEAT_S``; beat runs
``mark_lost_hosts`` (rlplatform.tasks). Admission only places runs on
healthy devices of ONLINE hosts, so a LOST host's devices leave admission the
moment it is marked, and come back with its next heartbeat.

Concurrency: registration changes a group's devices under that group's row
lock (rlplatform.locks, the lock admission takes), so an admission pass never
sees half a registration. Status moves are conditional UPDATEs, and every
timestamp is the database's clock (``Now()``), so hosts with skewed clocks are
judged fairly and a heartbeat racing the watchdog can never leave a live host
LOST: the heartbeat's plain update skips LOST rows, its revival only matches
them.

Hosts that never heartbeated (created by hand or by a fixture, with no agent)
are not watched: ``last_heartbeat`` is empty and the watchdog leaves them alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta

from django.db import transaction
from django.db.models.functions import Now
from django.utils import timezone

from rlplatform import live, locks
from rlplatform.inventory import DeviceInfo
from rlplatform.models import Device, Host, HostStatus, ResourceGroup

logger = logging.getLogger(__name__)


class HostError(ValueError):
    """Bad registration or heartbeat input; the message names the field."""


class UnknownHost(HostError):
    """A heartbeat for a host that is not registered (the agent registers again)."""


@dataclass
class Registration:
    host_id: int
    created: bool
    added: list[int] = field(default_factory=list)
    updated: list[int] = field(default_factory=list)
    vanished: list[int] = field(default_factory=list)
    came_online: bool = False

    @property
    def capacity_may_have_grown(self) -> bool:
        return self.created or self.came_online or bool(self.added or self.updated)


@dataclass
class Beat:
    came_back: bool
    health_changed: list[int] = field(default_factory=list)
    unknown_indices: list[int] = field(default_factory=list)

    @property
    def admission_needed(self) -> bool:
        return self.came_back or bool(self.health_changed)


def _clean_labels(labels) -> dict[str, str]:
    if labels is None:
        return {}
    if not isinstance(labels, Mapping):
        raise HostError(f"labels: expected an object of topology labels, got {type(labels).__name__}")
    clean = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not key.strip():
            raise HostError(f"labels: keys must be non-empty strings, got {key!r}")
        if not isinstance(value, str | int):
            raise HostError(f"labels.{key}: expected a string, got {type(value).__name__}")
        clean[key.strip()] = str(value)
    return clean


def _clean_devices(devices: Iterable, group: ResourceGroup) -> list[DeviceInfo]:
    clean: list[DeviceInfo] = []
    seen: set[int] = set()
    for i, item in enumerate(devices):
        try:
            info = item if isinstance(item, DeviceInfo) else DeviceInfo.from_dict(item, field=f"devices[{i}]")
        except ValueError as exc:
            raise HostError(str(exc)) from None
        if info.kind != group.kind:
            raise HostError(
                f"devices[{i}].kind: the host reports {info.kind} devices but group {group.name} holds {group.kind}"
            )
        if info.index in seen:
            raise HostError(f"devices[{i}].index: index {info.index} is listed twice")
        seen.add(info.index)
        clean.append(info)
    return clean


def register_host(
    name: str,
    group_name: str,
    address: str = "",
    queue: str = "",
    labels: Mapping[str, str] | None = None,
    devices: Iterable[DeviceInfo | dict] = (),
) -> Registration:
    """Create or update a host and its devices; safe to repeat (a restarting agent calls it every start).

    Devices the host no longer reports are marked unhealthy, never deleted:
    allocations of past and running runs reference them. A LOST or OFFLINE host
    becomes ONLINE; a DRAINING one stays draining (the operator's choice
    outlives worker restarts).
    """
    if not isinstance(name, str) or not name.strip() or len(name) > 200:
        raise HostError(f"name: expected a host name of 1-200 characters, got {name!r}")
    name = name.strip()
    group = ResourceGroup.objects.filter(name=group_name).first()
    if group is None:
        raise HostError(f"group: no resource group named {group_name!r}")
    clean_labels = _clean_labels(labels)
    infos = _clean_devices(devices, group)
    if not isinstance(address, str) or len(address) > 255:
        raise HostError("address: expected a string of at most 255 characters")
    if not isinstance(queue, str) or len(queue) > 200:
        raise HostError("queue: expected a string of at most 200 characters")

    with transaction.atomic():
        locks.lock_group(group.pk)  # admission of this group waits until the devices are consistent
        host = Host.objects.filter(name=name).first()
        created = host is None
        if host is not None and host.group_id != group.pk:
            raise HostError(f"group: host {name} belongs to group {host.group.name}, not {group.name}")
        if host is None:
            host = Host(name=name, group=group, status=HostStatus.ONLINE, address=address, labels=clean_labels)
            host.queue = queue  # empty: Host.save() fills in host.<name>
            host.save()
        else:
            changes = {"address": address or host.address, "queue": queue or host.queue or f"host.{name}"}
            if labels is not None:
                changes["labels"] = clean_labels
            Host.objects.filter(pk=host.pk).update(**changes)
        # Conditional, so an operator's DRAINING set meanwhile is never overwritten.
        came_online = bool(
            Host.objects.filter(pk=host.pk, status__in=[HostStatus.LOST, HostStatus.OFFLINE]).update(
                status=HostStatus.ONLINE
            )
        )
        Host.objects.filter(pk=host.pk).update(last_heartbeat=Now())

        result = Registration(host_id=host.pk, created=created, came_online=came_online)
        existing = {d.index: d for d in Device.objects.filter(host=host)}
        new_devices = []
        for info in infos:
            device = existing.pop(info.index, None)
            if device is None:
                new_devices.append(
                    Device(
                        host=host,
                        index=info.index,
                        kind=info.kind,
                        model=info.model,
                        memory_mb=info.memory_mb,
                        healthy=info.healthy,
                    )
                )
                result.added.append(info.index)
                continue
            wanted = {"kind": info.kind, "model": info.model, "memory_mb": info.memory_mb, "healthy": info.healthy}
            if any(getattr(device, key) != value for key, value in wanted.items()):
                Device.objects.filter(pk=device.pk).update(**wanted)
                result.updated.append(info.index)
        Device.objects.bulk_create(new_devices)
        gone = [index for index, device in existing.items() if device.healthy]
        if gone:
            Device.objects.filter(host=host, index__in=gone).update(healthy=False)
        result.vanished = sorted(existing)
    logger.info(
        "host %s registered in group %s: %d devices (added %s, updated %s, vanished %s)",
        name,
        group.name,
        len(infos),
        result.added,
        result.updated,
        result.vanished,
    )
    return result


def _clean_health(devices_health) -> dict[int, bool] | None:
    if devices_health is None:
        return None
    if not isinstance(devices_health, Mapping):
        raise HostError(f"devices_health: expected an object of index: healthy, got {type(devices_health).__name__}")
    clean = {}
    for key, value in devices_health.items():
        try:
            index = int(key)  # JSON (Celery arguments) turns integer keys into strings
        except (TypeError, ValueError):
            raise HostError(f"devices_health: key {key!r} is not a device index") from None
        if index < 0 or not isinstance(value, bool):
            raise HostError(f"devices_health.{key}: expected true or false for a non-negative index")
        clean[index] = value
    return clean


_USAGE_FIELDS = {"util_pct": (0.0, 100.0), "mem_used_mb": (0, 2**40)}


def _clean_usage(devices_usage) -> dict[int, dict[str, float | int]] | None:
    """``{index: {util_pct, mem_used_mb}}`` as the agent read it; a value out of range or of the wrong type is
    a HostError naming it (the agent's own parsers give none)."""
    if devices_usage is None:
        return None
    if not isinstance(devices_usage, Mapping):
        raise HostError(f"devices_usage: expected an object of index: usage, got {type(devices_usage).__name__}")
    clean: dict[int, dict[str, float | int]] = {}
    for key, usage in devices_usage.items():
        try:
            index = int(key)
        except (TypeError, ValueError):
            raise HostError(f"devices_usage: key {key!r} is not a device index") from None
        if index < 0 or not isinstance(usage, Mapping) or set(usage) - set(_USAGE_FIELDS):
            raise HostError(f"devices_usage.{key}: expected an object of {', '.join(_USAGE_FIELDS)}")
        for name, value in usage.items():
            low, high = _USAGE_FIELDS[name]
            if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
                raise HostError(f"devices_usage.{key}.{name}: expected a number in [{low}, {high}], got {value!r}")
        clean[index] = dict(usage)
    return clean


def heartbeat(
    host_name: str,
    devices_health: Mapping[int | str, bool] | None = None,
    devices_usage: Mapping[int | str, Mapping[str, float | int]] | None = None,
) -> Beat:
    """Record that ``host_name``'s agent is alive; a LOST host becomes ONLINE again.

    ``devices_health`` is the host's full inventory ``{index: healthy}`` (None:
    liveness only, e.g. when the probe itself failed). Devices missing from it
    are marked unhealthy; indices the platform does not know are returned in
    ``unknown_indices`` so the agent can register them. ``devices_usage``
    (``{index: {"util_pct", "mem_used_mb"}}``, what the tool read) is stored on
    each known device with the time it arrived, for the Cluster page; once committed, the pages showing
    the host's group are told (rlplatform.live).
    """
    health = _clean_health(devices_health)
    usage = _clean_usage(devices_usage)
    with transaction.atomic():
        # Order matters against mark_lost_hosts: see the module docstring.
        alive = Host.objects.filter(name=host_name).exclude(status=HostStatus.LOST).update(last_heartbeat=Now())
        came_back = False
        if not alive:
            came_back = bool(
                Host.objects.filter(name=host_name, status=HostStatus.LOST).update(
                    status=HostStatus.ONLINE, last_heartbeat=Now()
                )
            )
            if not came_back:
                raise UnknownHost(f"host: no host named {host_name!r} is registered")
        beat = Beat(came_back=came_back)
        if health is not None:
            known = dict(Device.objects.filter(host__name=host_name).values_list("index", "healthy"))
            wanted = {index: health.get(index, False) for index in known}
            for healthy in (True, False):
                indices = sorted(i for i, h in wanted.items() if h is healthy and known[i] is not healthy)
                if indices:
                    Device.objects.filter(host__name=host_name, index__in=indices).update(healthy=healthy)
                    beat.health_changed.extend(indices)
            beat.health_changed.sort()
            beat.unknown_indices = sorted(set(health) - set(known))
        if usage:
            _store_usage(host_name, usage)
        if usage or beat.health_changed:  # the Cluster pages read the group's device rows again (throttled)
            group_id = Host.objects.filter(name=host_name).values_list("group_id", flat=True).first()
            if group_id is not None:
                live.devices_changed(group_id)
    if came_back:
        logger.warning("host %s is back online after being lost", host_name)
    if beat.health_changed:
        logger.warning("host %s: device health changed for indices %s", host_name, beat.health_changed)
    return beat


def _store_usage(host_name: str, usage: Mapping[int, Mapping[str, float | int]]) -> None:
    at = timezone.now().isoformat()
    devices = list(Device.objects.filter(host__name=host_name, index__in=list(usage)))
    for device in devices:
        device.usage = {**usage[device.index], "at": at}
    Device.objects.bulk_update(devices, ["usage"])


def mark_lost_hosts(grace_s: float) -> list[str]:
    """Mark ONLINE hosts whose last heartbeat is older than ``grace_s`` seconds as LOST; return their names.

    Each host moves by its own conditional UPDATE, so a heartbeat landing in
    between wins and the host stays online.
    """
    if grace_s <= 0:
        raise HostError(f"grace_s: expected a positive number of seconds, got {grace_s!r}")
    cutoff = Now() - timedelta(seconds=grace_s)
    stale = Host.objects.filter(status=HostStatus.ONLINE, last_heartbeat__lt=cutoff)
    lost = []
    for host_id, name in stale.values_list("pk", "name"):
        if Host.objects.filter(pk=host_id, status=HostStatus.ONLINE, last_heartbeat__lt=cutoff).update(
            status=HostStatus.LOST
        ):
            lost.append(name)
    if lost:
        logger.warning("hosts lost (no heartbeat for %g s): %s", grace_s, ", ".join(lost))
    return lost


def mark_offline(host_name: str) -> bool:
    """A cleanly stopping agent takes its host out of admission at once (ONLINE -> OFFLINE)."""
    return bool(Host.objects.filter(name=host_name, status=HostStatus.ONLINE).update(status=HostStatus.OFFLINE))
