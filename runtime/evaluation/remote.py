"""The evaluator as a process of its own (``resources.remote_evaluator``), on any host.

    python -m runtime evaluator SPEC.yaml [--endpoint FILE] [key.sub=value ...]   (standalone)
    python -m runtime role evaluator --spec FILE --workdir DIR                  (platform role)

It reaches the trainer like a remote rollout instance (:mod:`runtime.rollout.link`: the endpoint file,
the shared key, a hello — ``{"role": "evaluator", ...}`` instead of a rank) and reconnects to a
restarted trainer the same way (:func:`runtime.rollout.remote.serve_trainers`).

The trainer's side, :class:`RemoteEvaluator`, is a drop-in for the in-process
:class:`~runtime.evaluation.evaluator.BackgroundEvaluator`: ``submit(step, version, weights)`` hands it the
weights of a step to evaluate, ``results()`` collects (step, metrics). One evaluation runs at a time
and one waits; a newer request replaces a waiting older one, so evaluation may fall behind but never
holds training up. A request the evaluator had not answered when it went away is sent again to the
next one that connects. Messages on the link:

    trainer -> evaluator   ("weights", (version, safetensors bytes))   the weights of the next request
                           ("evaluate", (request id, step, version))
                           ("stop", None)                                the run ended: exit 0
    evaluator -> trainer   ("result", (request id, step, metrics))
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runtime.contract import EVALUATOR_ROLE
from runtime.rollout.link import RemotePeer, WeightBlobs, decode_weights, shutdown_socket, spec_digest
from runtime.workloads.base import workload_for

Request = tuple[int, int, int, dict[str, torch.Tensor]]  # (request id, step, version, weights)


class RemoteEvaluator:
    """The trainer's side (see the module docstring). ``news(kind, payload)`` reports connections."""

    def __init__(self, digest: str, news: Callable[[str, dict[str, Any]], None]):
        self.digest = digest
        self._news = news
        self._blobs = WeightBlobs(keep=2)
        self._cond = threading.Condition()
        self._peer: RemotePeer | None = None
        self._pending: Request | None = None  # waiting to be sent
        self._sent: Request | None = None  # sent, not answered yet
        self._results: list[tuple[int, dict]] = []
        self._next_id = 0
        self.skipped = 0

    # ---- the listener's thread ----
    def admit(self, conn: Any, hello: dict[str, Any]) -> tuple[str, bool] | None:
        """An evaluator said hello: refuse it with (reason, retry later?), or take it."""
        if hello.get("digest") != self.digest:
            return "its spec differs from the trainer's (model, task, rollout, reward, group size or seed)", False
        with self._cond:
            if self._peer is not None and not self._peer.disconnected:
                return "an evaluator is still connected", True
            conn.send(("welcome", {}))
            peer = RemotePeer(conn, -1, int(hello.get("pid") or 0), str(hello.get("host") or "?"))
            self._peer = peer
            if self._sent is not None:  # unanswered by the one before: this one evaluates it
                self._pending = self._pending or self._sent
                self._sent = None
            self._dispatch()
        # Reported before its receiver starts: an evaluator that dies at once is reported disconnected
        # after it was reported connected, never before.
        self._news("evaluator_connected", {"host": peer.host, "pid": peer.pid})
        threading.Thread(target=self._receive, args=(peer,), name="evaluator-receiver", daemon=True).start()
        return None

    def _receive(self, peer: RemotePeer) -> None:
        try:
            while True:
                kind, payload = peer.conn.recv()
                if kind == "result":
                    request_id, step, metrics = payload
                    with self._cond:
                        if self._sent is not None and self._sent[0] == request_id:
                            if metrics is not None:  # None: it could not evaluate that version
                                self._results.append((step, metrics))
                            self._sent = None
                            self._dispatch()
                        self._cond.notify_all()
        except (EOFError, OSError, ValueError, TypeError):
            pass
        self._news("evaluator_disconnected", {"host": peer.host, "pid": peer.pid})  # before release() sees it
        peer.gone()
        peer.conn.close()
        with self._cond:
            self._cond.notify_all()

    # ---- the trainer's thread ----
    def submit(self, step: int, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Queue an evaluation of ``weights`` (a copy the evaluator may keep) for ``step``."""
        with self._cond:
            if self._pending is not None:
                self.skipped += 1  # an unsent older request: the newer weights matter more
            self._next_id += 1
            self._pending = (self._next_id, step, version, weights)
            self._dispatch()

    def _dispatch(self) -> None:
        """Under the lock: send the waiting request when an evaluator is connected and idle."""
        peer, request = self._peer, self._pending
        if peer is None or peer.disconnected or request is None or self._sent is not None:
            return
        request_id, step, version, weights = request
        peer.push_weights(version, lambda: self._blobs.get(version, weights))
        peer.send("evaluate", (request_id, step, version))
        self._sent, self._pending = request, None

    def results(self) -> list[tuple[int, dict]]:
        """Finished evaluations since the last call, as (step, metrics)."""
        with self._cond:
            out, self._results = self._results, []
            return out

    def close(self, wait: bool = True, timeout: float = 300.0) -> list[tuple[int, dict]]:
        """With ``wait``: wait (while an evaluator is connected, ``timeout`` at most) for the requests
        made; otherwise forget them (a rollback abandons their timeline). The connection stays for
        :meth:`release`. Returns the last results."""
        with self._cond:
            if wait:
                deadline = time.monotonic() + timeout
                while (self._pending or self._sent) and self._connected() and time.monotonic() < deadline:
                    self._cond.wait(0.2)
            self._pending = self._sent = None  # a late answer to a forgotten request is dropped
        return self.results()

    def release(self, stop: bool) -> None:
        """The trainer is done: tell the evaluator the run ended (``stop``: it exits), or cut the link
        (the trainer failed: the evaluator waits for a restarted one)."""
        with self._cond:
            peer = self._peer
        if peer is None:
            return
        if stop:
            peer.close(stop=True)
            peer.join(timeout=10)
        else:
            peer.kill()

    def _connected(self) -> bool:
        return self._peer is not None and not self._peer.disconnected


def require_remote(spec: Any) -> None:
    """Bad input (:class:`~runtime.rollout.remote.RolloutRefused`) unless the run has a remote evaluator."""
    from runtime.rollout.remote import RolloutRefused

    if not spec.resources.remote_evaluator:
        raise RolloutRefused("resources.remote_evaluator: false; this run evaluates inside its trainer")


class EvaluatorProcess:
    """The evaluator's engine and task (the run's workload's), kept across sessions with (restarted) trainers."""

    def __init__(self, spec: Any, log: Callable[[str], None] = print):
        from runtime.devices import resolve_device, set_threads

        r = spec.resources
        self.spec, self.log = spec, log
        if r.threads_per_process:
            set_threads(r.threads_per_process)
        self.device = resolve_device(r.device, 0)  # the platform makes this role's one device visible as 0
        self.workload = workload_for(spec)
        self.engine = self.workload.eval_engine(spec, self.device)
        self.task = self.workload.build_task(spec)
        self.hello = {
            "role": EVALUATOR_ROLE,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "digest": spec_digest(spec),
        }

    def serve(self, endpoint_path: Path, key: bytes | None, status: Callable[[str], None] = lambda s: None) -> int:
        """Serve trainers until the run ends (0) or none is found for ``rollout_reconnect_s`` (3)."""
        from runtime.rollout.remote import serve_trainers

        return serve_trainers(
            self.spec, endpoint_path, key, self.hello, "the evaluator", self.session, self.log, status
        )

    def session(self, conn: Any, welcome: dict[str, Any]) -> bool:
        """Evaluate for one connected trainer; True when it ended the run, False when it went away."""
        weights: tuple[int, dict[str, torch.Tensor]] | None = None
        try:
            while True:
                kind, payload = conn.recv()
                if kind == "weights":
                    version, blob = payload
                    weights = (version, decode_weights(blob))
                elif kind == "evaluate":
                    request_id, step, version = payload
                    if weights is None or weights[0] != version:  # the weights come first: not on an intact link
                        conn.send(("result", (request_id, step, None)))
                        continue
                    self.engine.update_weights(weights[1], version)
                    metrics = self.workload.evaluate(self.spec, self.engine, self.task)
                    conn.send(("result", (request_id, step, metrics)))
                elif kind == "stop":
                    return True
        except (EOFError, OSError):
            return False
        finally:
            shutdown_socket(conn)
            conn.close()


__all__ = ["EvaluatorProcess", "RemoteEvaluator", "require_remote"]
