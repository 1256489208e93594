"""The host agent: a Celery worker that registers its machine and heartbeats.

Start a worker on an accelerator host with ``TANDEM_HOST_NAME`` and
``TANDEM_HOST_GROUP`` set (docs/host-agents.md)::

    TANDEM_HOST_NAME=npu-01 TANDEM_HOST_GROUP=ascend-910b celery -A rlplatform worker -Q host.npu-01

Celery's own worker signals drive it: ``celeryd_after_setup`` adds the host's
queue (``host.<name>``) to the queues the worker consumes, ``worker_ready``
starts the agent, ``worker_shutdown`` stops it and marks the host OFFLINE.
These hooks are the host agent's one entry point: they also start and stop
the host services registered with ``on_host_ready`` (the role supervisor,
jobs.supervisor).

The heartbeat loop is a thread of the worker's main process, not a task on
the host's queue: a heartbeat task would wait behind whatever tasks fill the
worker's pool slots, and a busy host would look dead. The thread probes the devices (health), writes the heartbeat through
rlplatform.hosts, re-registers when the platform forgot the host or a device
appeared, and retries registration until it succeeds (the database or the
group may not be there yet when the worker starts).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from celery.signals import celeryd_after_setup, worker_ready, worker_shutdown
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import close_old_connections, connection

from rlplatform import hosts, inventory, shutdown
from rlplatform.admission_request import request_admission
from rlplatform.env import env_int, env_str

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentConfig:
    host_name: str
    group_name: str
    address: str
    labels: dict[str, str] = field(default_factory=dict)
    kind: str | None = None  # None: detect (npu-smi, then nvidia-smi, else cpu)
    cpu_devices: int | None = None
    heartbeat_s: float = 10.0

    @property
    def queue(self) -> str:
        return f"host.{self.host_name}"


def parse_labels(text: str | None, *, name: str = "TANDEM_HOST_LABELS") -> dict[str, str]:
    """``rack=r1,switch=s1`` -> ``{"rack": "r1", "switch": "s1"}``; a malformed item names the variable."""
    labels: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ImproperlyConfigured(f"environment variable {name}: {item.strip()!r} is not key=value")
        labels[key.strip()] = value.strip()
    return labels


def config_from_env() -> AgentConfig | None:
    """The agent's configuration, or None when ``TANDEM_HOST_NAME`` is unset (a plain worker)."""
    host_name = env_str("TANDEM_HOST_NAME")
    if host_name is None:
        return None
    group_name = env_str("TANDEM_HOST_GROUP")
    if group_name is None:
        raise ImproperlyConfigured("environment variable TANDEM_HOST_GROUP is required when TANDEM_HOST_NAME is set")
    kind = env_str("TANDEM_HOST_DEVICE_KIND")
    if kind is not None and kind not in inventory.KINDS:
        raise ImproperlyConfigured(
            f"environment variable TANDEM_HOST_DEVICE_KIND={kind!r} is not one of {', '.join(inventory.KINDS)}"
        )
    cpu_devices = env_int("TANDEM_CPU_DEVICES", 0, minimum=0) or None
    return AgentConfig(
        host_name=host_name,
        group_name=group_name,
        address=env_str("TANDEM_HOST_ADDRESS", socket.gethostname()),
        labels=parse_labels(env_str("TANDEM_HOST_LABELS")),
        kind=kind,
        cpu_devices=cpu_devices,
        heartbeat_s=settings.TANDEM_HEARTBEAT_S,
    )


class HostAgent:
    """Registers one host and heartbeats for it from a background thread."""

    def __init__(self, config: AgentConfig):
        self.config = config
        self.kind: str | None = config.kind
        self.registered = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _probe(self) -> list[inventory.DeviceInfo]:
        self.kind, devices = inventory.probe_devices(self.kind, cpu_count=self.config.cpu_devices)
        return devices

    def register(self) -> bool:
        """Probe and register; False (logged) when the probe or the platform refused."""
        try:
            devices = self._probe()
            result = hosts.register_host(
                self.config.host_name,
                self.config.group_name,
                address=self.config.address,
                queue=self.config.queue,
                labels=self.config.labels,
                devices=devices,
            )
        except (inventory.InventoryError, hosts.HostError) as exc:
            logger.error("host agent %s: registration refused: %s", self.config.host_name, exc)
            return False
        if result.capacity_may_have_grown or result.vanished:
            request_admission()
        self.registered = True
        return True

    def beat(self) -> None:
        """One heartbeat (registering first when needed)."""
        if not self.registered:
            self.register()
            return
        try:
            devices = self._probe()
            health = {d.index: d.healthy for d in devices}
            usage = {d.index: d.usage() for d in devices if d.usage()}  # utilisation, memory: the Cluster page
        except inventory.InventoryError as exc:
            # The tool hanging is not the devices failing: report liveness only, keep their health as it was.
            logger.warning("host agent %s: device probe failed: %s", self.config.host_name, exc)
            health, usage = None, None
        try:
            result = hosts.heartbeat(self.config.host_name, health, usage)
        except hosts.UnknownHost:
            self.registered = False
            self.register()
            return
        if result.unknown_indices:
            self.register()  # a device appeared: record its model and memory
        elif result.admission_needed:
            request_admission()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    close_old_connections()
                    self.beat()
                except Exception:  # the loop must outlive a database or broker outage
                    logger.exception("host agent %s: heartbeat failed", self.config.host_name)
                self._stop.wait(self.config.heartbeat_s)
        finally:
            connection.close()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tandem-host-agent", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the heartbeat and mark the host offline, within seconds (rlplatform.shutdown)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=shutdown.THREAD_JOIN_S)  # a daemon: a beat still running cannot hold us

        def mark_offline() -> bool:
            try:
                return hosts.mark_offline(self.config.host_name)
            finally:
                connection.close()  # this helper thread's connection

        try:
            marked = shutdown.bounded(mark_offline, shutdown.MARK_OFFLINE_S, "mark-offline")
        except Exception:  # shutting down with the database gone: the watchdog will mark it lost instead
            logger.exception("host agent %s: could not mark the host offline", self.config.host_name)
            return
        if marked:
            logger.info("host agent %s: host marked offline", self.config.host_name)
        elif marked is None:  # still waiting for the database: the watchdog marks the host lost later
            logger.warning("host agent %s: host not marked offline in time", self.config.host_name)


_agent: HostAgent | None = None


# --- what else a host agent runs ---------------------------------------------------------------------------
#
# The agent's worker_ready / worker_shutdown hooks are the one entry point of a host agent: they start and
# stop the agent and then the host services registered here. The role supervisor is one (jobs.supervisor
# registers it when imported, which the worker does through the autodiscovery of jobs.tasks, before it is
# ready). Registration instead of an import: jobs imports rlplatform, and rlplatform reaches jobs only by
# name (task names, apps.get_model), so the dependency keeps one direction.


@dataclass(frozen=True)
class HostService:
    name: str
    start: Callable[[AgentConfig], None]
    stop: Callable[[], None]


_services: list[HostService] = []


def on_host_ready(name: str, start: Callable[[AgentConfig], None], stop: Callable[[], None]) -> None:
    """Have every host agent call ``start(config)`` once it is ready (after the agent started) and ``stop()``
    at its shutdown (after the agent stopped). Registering the same name again replaces it."""
    _services[:] = [s for s in _services if s.name != name]
    _services.append(HostService(name, start, stop))


@celeryd_after_setup.connect
def _consume_host_queue(sender, instance, **kwargs) -> None:
    """Consume ``host.<name>`` besides any ``-Q`` queues (Celery's documented hook for adding queues)."""
    try:
        config = config_from_env()
    except ImproperlyConfigured as exc:
        # A misconfigured agent must not run as a silent plain worker.
        logger.critical("host agent: %s", exc)
        raise SystemExit(f"host agent: {exc}") from None
    if config is not None:
        instance.app.amqp.queues.select_add(config.queue)


@worker_ready.connect
def _start_host_agent(sender, **kwargs) -> None:
    global _agent
    config = config_from_env()
    if config is None or _agent is not None:
        return
    _agent = HostAgent(config)
    _agent.start()
    logger.info("host agent %s started (group %s, queue %s)", config.host_name, config.group_name, config.queue)
    for service in list(_services):
        try:
            service.start(config)
        except Exception:  # one service failing to start must not keep the others (or the agent) from running
            logger.exception("host agent %s: could not start %s", config.host_name, service.name)


@worker_shutdown.connect
def _stop_host_agent(sender, **kwargs) -> None:
    global _agent
    if _agent is None:
        return
    _agent.stop()
    _agent = None
    for service in list(_services):
        try:
            service.stop()
        except Exception:  # the others must still stop, and the exit guard be armed
            logger.exception("host agent: could not stop %s", service.name)
    shutdown.arm_exit_guard()  # the pool has stopped: only the interpreter's exit is left
