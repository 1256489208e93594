"""A remote rollout instance: a process of its own that generates for a trainer over the network.

    python -m runtime rollout SPEC.yaml --index I [--endpoint FILE] [key.sub=value ...]   (standalone)
    python -m runtime role rollout --spec FILE --workdir DIR                            (platform role)

It builds its workload's generator once (``Workload.remote_rollout``: the LLM's engine, the gym's policy
and envs), then serves the trainer one connection (a *session*) at a time: find the trainer in the
endpoint file, connect and authenticate (:mod:`runtime.rollout.link`), and run the same instance loop
as a local instance of its workload on the work, weights and flags that arrive over the connection,
continuing from the state the trainer's welcome carries (what this rank last reported with accepted
samples; a gym sampler's episodes). When the trainer goes away without ending the run — it
failed and restarts from its last checkpoint — the instance looks for it again, for up to
``pipeline.rollout_reconnect_s``; the trainer re-issues whatever this instance had not returned.

Exit status: 0 when the trainer ended the run (or the endpoint file says it has ended), 2 for bad
input (the spec, a refused rank, a spec the trainer's differs from), 3 when no trainer came back.
"""

from __future__ import annotations

import os
import queue as std_queue
import socket
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runtime.contract import ENDPOINT_FILE, ENV_ROLLOUT_KEY, EXIT_NO_TRAINER
from runtime.rollout.link import (
    Endpoint,
    LinkError,
    Refused,
    connect,
    decode_weights,
    read_endpoint,
    shutdown_socket,
    spec_digest,
)
from runtime.rollout.wire import EPOCH, STOP
from runtime.workloads.base import workload_for

RETRY_S = 1.0  # between looks at the endpoint file while there is no trainer to talk to


class RolloutRefused(ValueError):
    """The trainer will never accept this instance (wrong rank, a different spec): bad input."""


class NetSubscriber:
    """Weights pushed over the link, seen like :class:`~runtime.weights.service.WeightSubscriber` sees the
    shared buffer: ``latest_version``, ``wait_for`` and ``switch`` at an engine-step boundary."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._latest: tuple[int, dict[str, torch.Tensor]] | None = None
        self.current_version = -1

    @property
    def latest_version(self) -> int:
        with self._cond:
            return -1 if self._latest is None else self._latest[0]

    def offer(self, version: int, state: dict[str, torch.Tensor]) -> None:
        with self._cond:
            self._latest = (version, state)
            self._cond.notify_all()

    def wait_for(self, version: int, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._latest is not None and self._latest[0] >= version, timeout)

    def switch(self, apply: Callable[[dict[str, torch.Tensor], int], None]) -> int | None:
        with self._cond:
            latest = self._latest
        if latest is None or latest[0] == self.current_version:
            return None
        version, state = latest
        with torch.no_grad():
            apply(state, version)
        self.current_version = version
        return version


class RemoteInstance:
    """The instance's identity and its workload's generator (``Workload.remote_rollout``: the LLM's engine and
    task, the gym's policy and envs), kept across sessions with (restarted) trainers."""

    def __init__(self, spec: Any, index: int, log: Callable[[str], None] = print):
        from runtime.devices import resolve_device, set_threads

        r = spec.resources
        if not 0 <= index < r.remote_rollout_workers:
            raise RolloutRefused(
                f"--index: {index} is not a remote rollout instance of this run "
                f"(resources.remote_rollout_workers={r.remote_rollout_workers})"
            )
        self.spec, self.log = spec, log
        self.rank = r.rollout_workers + index  # ranks: the trainer host's instances first
        if r.threads_per_process:
            set_threads(r.threads_per_process)
        # the platform makes this role's one device visible as index 0
        self.device = resolve_device(r.device, 0)
        self.generator = workload_for(spec).remote_rollout(self.rank, spec, self.device)
        self.hello = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "digest": spec_digest(spec)}
        self.sessions = 0

    def serve(self, endpoint_path: Path, key: bytes | None, status: Callable[[str], None] = lambda s: None) -> int:
        """Serve trainers until the run ends (0) or none is found for ``rollout_reconnect_s`` (3)."""
        try:
            return serve_trainers(
                self.spec, endpoint_path, key, self.hello, f"rank {self.rank}", self.session, self.log, status
            )
        finally:
            self.generator.close()

    def session(self, conn: Any, welcome: dict[str, Any]) -> bool:
        """Generate for one connected trainer; True when it ended the run, False when it went away."""
        self.sessions += 1
        work_q: std_queue.Queue = std_queue.Queue()
        flags = [0, int(welcome.get("epoch", 0))]  # [STOP, EPOCH], as the trainer's shared flags
        sub = NetSubscriber()
        ended = {"stop": False, "gone": False}
        broadcast = _broadcast_receiver_for(self.spec, self.device, welcome.get("broadcast"))

        def receive() -> None:
            try:
                while True:
                    kind, payload = conn.recv()
                    if kind == "work":
                        work_q.put(payload)
                    elif kind == "weights":
                        version, blob = payload
                        sub.offer(version, decode_weights(blob))
                    elif kind == "weights_bcast" and broadcast is not None:
                        version, manifest = payload
                        sub.offer(version, broadcast.receive(manifest))
                    elif kind == "epoch":
                        flags[EPOCH] = int(payload)
                    elif kind == "stop":
                        ended["stop"] = True
                        flags[STOP] = 1
                        return
            except (EOFError, OSError, RuntimeError):  # RuntimeError: a broadcast failed with the trainer
                ended["gone"] = True
            finally:
                work_q.put(None)  # wake the loop

        receiver = threading.Thread(target=receive, name="rollout-receiver", daemon=True)
        receiver.start()
        # the state this rank last reported with accepted samples, as the trainer kept it (its checkpoint's
        # after a restart): the instance continues from there
        instance = self.generator.session(sub, conn, flags, welcome.get("state"))
        try:
            conn.send(("ready", self.rank, os.getpid()))
            instance.run(work_q, lambda: bool(flags[STOP]) or ended["gone"])
        except (OSError, EOFError):
            pass  # the trainer went away mid-send
        except BaseException:
            try:
                conn.send(("error", self.rank, traceback.format_exc()))
            except OSError:
                pass
            raise
        finally:
            instance.close()
            try:
                conn.send(("exit", self.rank, None))
            except (OSError, ValueError):
                pass
            shutdown_socket(conn)
            receiver.join(timeout=10)
            conn.close()
        return ended["stop"]


def _broadcast_receiver_for(spec: Any, device: torch.device, info: dict[str, Any] | None) -> Any:
    """The welcome's broadcast group (pipeline.remote_weight_sync broadcast), or None: weights on the link."""
    if not info:
        return None
    from runtime.devices import dist_backend
    from runtime.weights.broadcast import BroadcastReceiver

    backend = dist_backend(spec.resources.device)
    return BroadcastReceiver(str(info["address"]), info, backend, device, spec.rollout.hang_timeout_s)


def serve_trainers(
    spec: Any,
    endpoint_path: Path,
    key: bytes | None,
    hello: dict[str, Any],
    who: str,
    session: Callable[[Any, dict[str, Any]], bool],
    log: Callable[[str], None],
    status: Callable[[str], None],
) -> int:
    """Find the trainer through the endpoint file, connect as ``who`` with ``hello`` and run ``session``
    (True: the trainer ended the run) — again and again while trainers come back, each time within
    ``pipeline.rollout_reconnect_s``. Returns 0 when the run ended, :data:`EXIT_NO_TRAINER` when no
    trainer came back; a refusal for good raises :class:`RolloutRefused`."""
    waited_since = time.monotonic()
    said = ""

    def say(message: str) -> None:  # a waiting loop logs changes, not every retry
        nonlocal said
        if message != said:
            log(message)
            said = message

    status("waiting for the trainer")
    while True:
        endpoint = read_endpoint(endpoint_path)
        if endpoint == "ended":
            log("the run has ended")
            return 0
        if isinstance(endpoint, Endpoint):
            use_key = key or endpoint.key
            if use_key is None:
                raise RolloutRefused(f"{ENV_ROLLOUT_KEY}: not set, and {endpoint_path} carries no key")
            try:
                conn, welcome = connect(endpoint, use_key, hello)
            except Refused as exc:
                if not exc.retry:
                    raise RolloutRefused(f"the trainer refused {who}: {exc}") from None
                say(f"the trainer cannot take {who} yet: {exc}")
            except (OSError, EOFError, LinkError) as exc:
                say(f"no trainer at {endpoint.address}:{endpoint.port} yet ({type(exc).__name__}: {exc})")
            else:
                log(f"{who}: connected to the trainer at {endpoint.address}:{endpoint.port}")
                status("running")
                said = ""
                if session(conn, welcome):
                    log("the trainer ended the run")
                    return 0
                log("the trainer went away; waiting for it to come back")
                status("waiting for the trainer")
                waited_since = time.monotonic()
                continue
        else:
            say(f"waiting for the trainer's endpoint file {endpoint_path}")
        if time.monotonic() - waited_since > spec.pipeline.rollout_reconnect_s:
            log(f"no trainer for pipeline.rollout_reconnect_s={spec.pipeline.rollout_reconnect_s:g} s")
            return EXIT_NO_TRAINER
        time.sleep(RETRY_S)


def endpoint_path(spec: Any, given: str | None = None) -> Path:
    return Path(given) if given else spec.resolved_output_dir() / ENDPOINT_FILE


__all__ = ["NetSubscriber", "RemoteInstance", "RolloutRefused", "endpoint_path", "serve_trainers"]
