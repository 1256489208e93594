"""The network link between the trainer and remote rollout instances (async mode, other hosts),
also used by a remote evaluator (:mod:`runtime.evaluation.remote`).

A remote instance is a process of its own — under the platform a ``rollout-<i>`` role on another
host (:mod:`runtime.rollout.remote`) — that runs the same :class:`~runtime.rollout.instance.RolloutInstance`
loop as a local one. What a local instance gets from its parent (a work queue, a result pipe, the
shared-memory weight buffer, the shared STOP/EPOCH flags) travels over one TCP connection instead:

    trainer -> instance: ("welcome", info) or ("refused", reason), then ("weights", (version, blob))
                         or, with pipeline.remote_weight_sync broadcast, ("weights_bcast", (version,
                         manifest)) followed by the tensors on a process group of its own
                         (runtime.weights.broadcast), ("work", (epoch, entries)), ("epoch", n), ("stop", None)
    instance -> trainer: ("hello", {rank, pid, host, digest}), then the local protocol
                         ("ready", "beat", "samples", "error", "exit"; samples always inline)

Authentication. Both ends prove they hold the run's rollout key (HMAC-SHA256 over a fresh 32-byte
challenge, each way) before anything is unpickled; until then only bounded byte strings are read.
The key comes from ``TANDEM_ROLLOUT_KEY`` (the platform gives every role of a run the same one) or,
for a standalone run, is drawn by the trainer and written to the endpoint file (mode 0600).

Finding the trainer. The trainer writes ``rollout-endpoint.json`` (address, port, a nonce) to its
output directory — shared with the instances' hosts like the checkpoints — so an instance finds a
restarted trainer at its new port; a run that ended writes ``{"ended": true}`` there.

Weights are pushed newest-wins: each peer has one sender thread, and a version not yet sent when a
newer one is published is skipped (the instance takes the newest at its next engine step anyway),
so a slow link delays that instance's weights, never the trainer. A version is serialised once for
every peer, as safetensors bytes (no pickle).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.contract import ENV_HOST_ADDRESS, ENV_ROLLOUT_KEY

if TYPE_CHECKING:  # torch is only needed by the functions that (de)serialise weights: the platform
    import torch  # imports this module for its file names without loading torch

HANDSHAKE_S = 10.0  # a peer that does not answer the challenge in this long is dropped
MAX_HANDSHAKES = 32  # connections authenticating at once; more are closed at once (a flood costs no threads)
MAX_PROOF = 64  # bytes of a challenge or an answer: nothing longer is read before authentication
MAGIC = b"tandem-rollout-1"
# TCP keepalive on every link: a peer whose host vanished (no FIN, no RST) is found out within about
# KEEPALIVE_IDLE_S + KEEPALIVE_COUNT x KEEPALIVE_INTERVAL_S instead of holding its place for ever
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 30, 10, 3


class LinkError(RuntimeError):
    """The link could not be set up: no trainer, a wrong key, a refused hello."""


class Refused(LinkError):
    """The trainer refused this instance (``retry``: it may accept it later, e.g. a rank still connected)."""

    def __init__(self, reason: str, retry: bool):
        super().__init__(reason)
        self.retry = retry


# ---- the key and the endpoint file ------------------------------------------------------------


def env_key(environ: Any = os.environ) -> bytes | None:
    value = environ.get(ENV_ROLLOUT_KEY, "").strip()
    return value.encode() if value else None


@dataclass(frozen=True)
class Endpoint:
    address: str
    port: int
    nonce: str
    key: bytes | None = None  # only when the trainer drew it (standalone runs)


def write_endpoint(path: Path, endpoint: Endpoint | None) -> None:
    """Atomically (write, then rename) and readable by the owner only: the file may carry the key.
    ``None`` writes the run-ended marker."""
    if endpoint is None:
        data: dict[str, Any] = {"ended": True}
    else:
        data = {"address": endpoint.address, "port": endpoint.port, "nonce": endpoint.nonce}
        if endpoint.key is not None:
            data["key"] = endpoint.key.decode()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def read_endpoint(path: Path) -> Endpoint | None | str:
    """The trainer's endpoint; None while there is none (no file yet, or half-written); ``"ended"``
    when the run has ended."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if data.get("ended"):
        return "ended"
    try:
        key = data.get("key")
        return Endpoint(str(data["address"]), int(data["port"]), str(data["nonce"]), key.encode() if key else None)
    except (KeyError, TypeError, ValueError):
        return None


def advertised_address(bind_host: str, environ: Any = os.environ) -> str:
    """The address remote instances connect to: ``TANDEM_HOST_ADDRESS``, else the bind address unless it
    is a wildcard, else this host's name."""
    value = environ.get(ENV_HOST_ADDRESS, "").strip()
    if value:
        return value
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    return socket.getfqdn()


def spec_digest(spec: Any) -> str:
    """What must agree between the trainer and an instance for its samples to be right: for an LLM run the
    model (not which implementation computes it), the task, the generation and reward settings, the group
    size and the seed; for a gym run the
    env, the agent (its networks) and the seed."""
    d = spec.resolved()
    if d.get("workload") == "gym":
        same = {k: d[k] for k in ("workload", "env", "agent", "seed")}
    else:
        same = {k: d[k] for k in ("model", "task", "rollout", "reward", "seed")}
        same["group_size"] = d["algorithm"]["group_size"]
        # Which implementation computes the model is each process's own (the trainer pins `auto` for its
        # device, an instance on another device may resolve it otherwise): same weights, same names.
        same["model"] = {k: v for k, v in d["model"].items() if k not in ("implementation", "attn_implementation")}
    return hashlib.sha256(json.dumps(same, sort_keys=True).encode()).hexdigest()[:16]


# ---- authentication ---------------------------------------------------------------------------------


def keep_alive(sock: socket.socket) -> None:
    """Probe an idle connection (see KEEPALIVE_IDLE_S); where the platform lacks the knobs, its defaults."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_COUNT),
    ):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _answer(conn: Connection, key: bytes) -> None:
    if not conn.poll(HANDSHAKE_S):
        raise LinkError("the peer sent no challenge")
    challenge = conn.recv_bytes(len(MAGIC) + MAX_PROOF)
    if not challenge.startswith(MAGIC):
        raise LinkError("the peer does not speak the rollout protocol")
    conn.send_bytes(hmac.new(key, challenge, "sha256").digest())


def _challenge(conn: Connection, key: bytes) -> None:
    challenge = MAGIC + secrets.token_bytes(32)
    conn.send_bytes(challenge)
    if not conn.poll(HANDSHAKE_S):
        raise LinkError("the peer did not answer the challenge")
    answer = conn.recv_bytes(MAX_PROOF)
    if not hmac.compare_digest(answer, hmac.new(key, challenge, "sha256").digest()):
        raise LinkError("wrong rollout key")


def connect(
    endpoint: Endpoint, key: bytes, hello: dict[str, Any], timeout: float = HANDSHAKE_S
) -> tuple[Connection, dict]:
    """Instance side: connect, authenticate both ways, say hello; returns (connection, welcome info).
    Raises :class:`LinkError` (OSError when nothing listens there)."""
    sock = socket.create_connection((endpoint.address, endpoint.port), timeout=timeout)
    sock.settimeout(None)
    keep_alive(sock)
    conn = Connection(sock.detach())
    try:
        _answer(conn, key)
        _challenge(conn, key)
        conn.send(("hello", hello))
        if not conn.poll(timeout):
            raise LinkError("the trainer did not answer the hello")
        kind, payload = conn.recv()
        if kind == "refused":
            raise Refused(payload["reason"], bool(payload.get("retry")))
        return conn, payload
    except BaseException:
        conn.close()
        raise


# ---- trainer side ----------------------------------------------------------------------------------


class WeightBlobs:
    """Each published version serialised once (safetensors bytes) for all peers, the newest few kept; with
    ``dtype``, floating-point tensors cross in it (the dtype a vLLM engine computes in: bf16 weights are half
    the bytes of the trainer's float32 masters, and the engine would convert them anyway)."""

    def __init__(self, keep: int = 2, dtype: torch.dtype | None = None):
        self.keep = keep
        self.dtype = dtype
        self._lock = threading.Lock()
        self._blobs: dict[int, bytes] = {}

    def get(self, version: int, state: dict[str, torch.Tensor]) -> bytes:
        from safetensors.torch import save

        with self._lock:
            blob = self._blobs.get(version)
            if blob is None:
                blob = save(_unshared(_in_dtype(state, self.dtype)))
                self._blobs[version] = blob
                for old in sorted(self._blobs)[: -self.keep]:
                    del self._blobs[old]
            return blob


def _in_dtype(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    if dtype is None:
        return state
    return {k: t.to(dtype) if t.is_floating_point() else t for k, t in state.items()}


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors of which none shares memory with another (safetensors refuses tied ones,
    e.g. an embedding tied to the output layer: each name gets its own copy)."""
    out, seen = {}, set()
    for name, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if ptr in seen else tensor.contiguous()
        seen.add(ptr)
    return out


def decode_weights(blob: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(blob)


def shutdown_socket(conn: Connection) -> None:
    """End the connection for both sides without closing our descriptor (another thread may be waiting
    on it): the peer and our own reader then see end-of-file."""
    try:
        dup = socket.socket(fileno=os.dup(conn.fileno()))
    except (OSError, ValueError):
        return
    try:
        dup.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        dup.close()


class RemotePeer:
    """The trainer's handle on one connected remote instance.

    It stands in for a local instance's process and work queue in the trainer's bookkeeping:
    ``put`` sends work (None: stop), ``kill`` cuts the connection, ``exitcode`` is None while it is
    connected. Sending is a thread of its own (an outbox), so a slow or stalled link never blocks
    the trainer; weights wait in one newest-wins slot and go before any message queued after them.
    """

    def __init__(self, conn: Connection, rank: int, pid: int, host: str, broadcast: Any = None):
        self.conn, self.rank, self.pid, self.host = conn, rank, pid, host
        self.broadcast = broadcast  # a runtime.weights.broadcast.BroadcastSender: weights go by broadcast
        self._cond = threading.Condition()
        self._outbox: deque[tuple[str, Any]] = deque()
        self._weights: tuple[int, Callable[[], bytes], dict[str, torch.Tensor] | None] | None = None
        self._closing = False
        self._stopping = False  # a stop is on its way: the instance ends the connection itself
        self.disconnected = False
        self._thread = threading.Thread(target=self._send_loop, name=f"rollout-link-{rank}", daemon=True)
        self._thread.start()

    # -- what the trainer's slot uses of a process and a queue --
    @property
    def exitcode(self) -> int | None:
        return None if not self.disconnected else 0

    def is_alive(self) -> bool:
        return not self.disconnected

    def kill(self) -> None:
        """Cut the connection (the receiver then reads its end) and end the sender."""
        shutdown_socket(self.conn)
        self.close()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def put(self, msg: Any) -> None:
        if msg is None:
            self.close(stop=True)
        else:
            self._queue(("work", msg))

    def cancel_join_thread(self) -> None:
        pass

    def close(self, stop: bool = False) -> None:
        """Send what is queued (then ``stop`` when asked) and end the sender; the receiver closes the
        connection when it reads the end."""
        with self._cond:
            if self._closing:
                return
            if stop:
                self._outbox.append(("stop", None))
                self._stopping = True
            self._closing = True
            self._cond.notify()

    # -- the trainer's sends --
    def set_epoch(self, epoch: int) -> None:
        self._queue(("epoch", epoch))

    def push_weights(
        self, version: int, blob: Callable[[], bytes], state: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Send ``version`` (newest wins): ``blob()`` on the link, or ``state`` by broadcast."""
        with self._cond:
            self._weights = (version, blob, state)
            self._cond.notify()

    def send(self, kind: str, payload: Any) -> None:
        """Queue a message of another kind (the remote evaluator's requests), after the weights pushed."""
        self._queue((kind, payload))

    def _send_weights(self, version: int, blob: Callable[[], bytes], state: dict[str, torch.Tensor] | None) -> None:
        if self.broadcast is None or state is None:
            self.conn.send(("weights", (version, blob())))
            return
        from runtime.weights.broadcast import manifest_of

        self.conn.send(("weights_bcast", (version, manifest_of(state))))
        self.broadcast.send(state)

    def gone(self) -> None:
        """The receiver read end-of-file: the instance is gone."""
        self.disconnected = True
        self.close()

    def _queue(self, msg: tuple[str, Any]) -> None:
        with self._cond:
            if not self._closing:
                self._outbox.append(msg)
                self._cond.notify()

    def _send_loop(self) -> None:
        try:
            self._sending()
        finally:
            if self.broadcast is not None:  # the connection's process group and store end with it
                self.broadcast.close()

    def _sending(self) -> None:
        while True:
            with self._cond:
                while not self._outbox and self._weights is None and not self._closing:
                    self._cond.wait()
                weights, msg = None, None
                if self._weights is not None and not self._closing:  # closing: weights no longer matter
                    weights, self._weights = self._weights, None
                elif self._outbox:
                    msg = self._outbox.popleft()
                else:
                    break  # closing, and everything queued is sent
            try:
                if weights is not None:
                    self._send_weights(*weights)
                else:
                    self.conn.send(msg)
            except (OSError, ValueError):  # the connection is gone: the receiver sees it too
                return
            except RuntimeError:  # a broadcast failed: the instance is gone or stuck; end the link
                shutdown_socket(self.conn)
                return
        if self.disconnected:
            return
        if self._stopping:  # let the instance read the stop and close its side (we then see EOF)
            deadline = time.monotonic() + 5.0
            while not self.disconnected and time.monotonic() < deadline:
                time.sleep(0.05)
        if not self.disconnected:  # closed without a stop (the trainer failed): cut it at once
            shutdown_socket(self.conn)


class RolloutListener:
    """Trainer side: accept remote instances on ``bind`` (``host:port``) and hand each authenticated one's
    hello to ``admit(conn, hello)``, which returns None to accept it or ``(reason, retry)`` to refuse.

    Each connection is authenticated on a thread of its own, so a peer that stalls mid-handshake holds
    up no one else (for at most ``HANDSHAKE_S``), and at most ``max_handshakes`` at once.
    """

    def __init__(
        self,
        bind: str,
        key: bytes,
        admit: Callable[[Connection, dict[str, Any]], tuple[str, bool] | None],
        max_handshakes: int = MAX_HANDSHAKES,
    ):
        host, _, port = bind.rpartition(":")
        self.key = key
        self.admit = admit
        self.sock = socket.create_server((host.strip("[]"), int(port)), reuse_port=False)
        self.bind_host = host.strip("[]")
        self.port = self.sock.getsockname()[1]
        self.rejected = 0  # connections that failed authentication or the hello, or found no handshake slot
        self._slots = threading.BoundedSemaphore(max_handshakes)
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="rollout-listener", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self.sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                self.rejected += 1
                sock.close()
                continue
            threading.Thread(target=self._handshake, args=(sock,), name="rollout-handshake", daemon=True).start()

    def _handshake(self, sock: socket.socket) -> None:
        try:
            self._authenticate(sock)
        finally:
            self._slots.release()

    def _authenticate(self, sock: socket.socket) -> None:
        sock.settimeout(None)
        keep_alive(sock)
        conn = Connection(sock.detach())
        try:
            _challenge(conn, self.key)
            _answer(conn, self.key)
            if not conn.poll(HANDSHAKE_S):
                raise LinkError("no hello")
            kind, hello = conn.recv()  # authenticated: a pickle from a holder of the key
            if kind != "hello" or not isinstance(hello, dict):
                raise LinkError("expected a hello")
            refusal = self.admit(conn, hello)
        except (LinkError, OSError, EOFError, ValueError):
            self.rejected += 1
            conn.close()
            return
        if refusal is not None:
            reason, retry = refusal
            try:
                conn.send(("refused", {"reason": reason, "retry": retry}))
            except OSError:
                pass
            conn.close()
