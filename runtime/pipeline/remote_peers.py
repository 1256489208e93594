"""Remote rollout instances and the remote evaluator of an ``async`` run: the trainer's TCP side.

With ``resources.remote_rollout_workers`` or ``resources.remote_evaluator`` the trainer listens
(:mod:`runtime.rollout.link`) and writes its endpoint to the output directory, which the remote
hosts share. A rollout instance that says hello with a rank of this run and the trainer's spec
digest is admitted into the instance pool, where it is supervised like a local one; every weight
version published from then on is pushed to it (over the link, or by broadcast with
``pipeline.remote_weight_sync: broadcast``). An evaluator's hello goes to the
:class:`~runtime.evaluation.remote.RemoteEvaluator`, kept across rollbacks.
"""

from __future__ import annotations

import secrets
from typing import Any

import torch

from runtime.contract import ENDPOINT_FILE, EVALUATOR_ROLE
from runtime.evaluation.remote import RemoteEvaluator
from runtime.pipeline.driver import RunContext
from runtime.pipeline.instance_pool import InstancePool
from runtime.pipeline.rollout_ledger import InstanceSlot
from runtime.rollout.link import (
    Endpoint,
    RemotePeer,
    RolloutListener,
    WeightBlobs,
    advertised_address,
    env_key,
    spec_digest,
    write_endpoint,
)
from runtime.rollout.wire import EPOCH
from runtime.spec import RunSpec
from runtime.workloads.llm.models import engine_weight_dtype


def takes_remote_peers(spec: RunSpec) -> bool:
    """Whether the run listens for remote rollout instances or a remote evaluator."""
    return bool(spec.resources.remote_rollout_workers or spec.resources.remote_evaluator)


class RemotePeers:
    """The listener, the endpoint file, and the admission of remote instances and the evaluator."""

    def __init__(self, ctx: RunContext, pool: InstancePool):
        self.ctx = ctx
        self.pool = pool
        self.ledger = pool.ledger
        self.listener: Any = None
        self.endpoint_address = ""  # the address the listener advertises
        # each version's weights as bytes, made once for every peer, in the dtype a vLLM engine computes in
        self.blobs = WeightBlobs(dtype=engine_weight_dtype(ctx.spec))
        self.evaluator: RemoteEvaluator | None = None  # resources.remote_evaluator: kept across rollbacks

    def listen(self) -> None:
        """Accept remote instances; their endpoint goes to the output directory (shared with their hosts)."""
        ctx = self.ctx
        key = env_key()
        drawn = key is None  # standalone: draw one; the endpoint file (mode 0600) carries it
        if key is None:
            key = secrets.token_hex(32).encode()
        if ctx.spec.resources.remote_evaluator:
            self.evaluator = RemoteEvaluator(spec_digest(ctx.spec), self.pool.tell)
        self.listener = RolloutListener(ctx.spec.pipeline.rollout_listen, key, self.admit)
        self.pool.listening = True
        ctx.weights.on_publish = self.push_weights
        endpoint = Endpoint(
            advertised_address(self.listener.bind_host),
            self.listener.port,
            secrets.token_hex(8),
            key if drawn else None,
        )
        write_endpoint(ctx.out_dir / ENDPOINT_FILE, endpoint)
        self.endpoint_address = endpoint.address
        self.listener.start()
        ctx.reporters.event("rollout_listening", {"address": endpoint.address, "port": endpoint.port})

    def admit(self, conn: Any, hello: dict[str, Any]) -> tuple[str, bool] | None:
        """A remote instance said hello (listener thread): refuse it with (reason, retry later?), or take it."""
        spec = self.ctx.spec
        r = spec.resources
        if hello.get("role") == EVALUATOR_ROLE:
            if self.evaluator is None:
                return "this run has no remote evaluator (resources.remote_evaluator)", False
            return self.evaluator.admit(conn, hello)
        rank = hello.get("rank")
        if not isinstance(rank, int) or not r.rollout_workers <= rank < r.all_rollout_workers:
            first, last = r.rollout_workers, r.all_rollout_workers - 1
            return f"rank {rank!r} is not a remote rollout rank of this run ({first}..{last})", False
        if hello.get("digest") != spec_digest(spec):
            what = (
                "env, agent or seed" if spec.workload == "gym" else "model, task, rollout, reward, group size or seed"
            )
            return f"its spec differs from the trainer's ({what})", False
        with self.ledger.lock:
            if self.pool.closing:
                return "the trainer is shutting down", True
            if any(s.rank == rank and not s.handled for s in self.ledger.slots):
                return f"rank {rank} is still connected", True
            version = self.ctx.weights.version
            if version not in self.ctx.weights.versions():
                return "the trainer has not kept its weights yet", True
            self._take(conn, hello, rank, version)
        return None

    def _take(self, conn: Any, hello: dict[str, Any], rank: int, version: int) -> None:
        """Welcome an admitted rollout instance into the pool with the kept weights of ``version`` (a version
        published from now on is pushed by push_weights); the caller holds the ledger's lock."""
        weights = self.ctx.weights.state(version)
        welcome: dict[str, Any] = {"epoch": int(self.pool.flags[EPOCH])}
        state = self.ledger.states.get(rank)  # where this rank's last accepted samples left it
        if state is not None:
            welcome["state"] = state
        broadcast = self._broadcast_sender()
        if broadcast is not None:
            welcome["broadcast"] = {**broadcast.welcome, "address": self.endpoint_address}
        conn.send(("welcome", welcome))
        peer = RemotePeer(conn, rank, int(hello.get("pid") or 0), str(hello.get("host") or "?"), broadcast)
        self.ledger.add(InstanceSlot(rank, peer, peer, conn, remote=True))
        self._push_to(peer, version, weights)
        sync = "broadcast" if broadcast is not None else "link"
        self.pool.note("rollout_connected", {"rank": rank, "host": peer.host, "pid": peer.pid, "weight_sync": sync})

    def push_weights(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """A version was published: to every live remote instance."""
        with self.ledger.lock:
            peers = [s.proc for s in self.pool.live_slots() if s.remote]
        for peer in peers:
            self._push_to(peer, version, state)

    def _push_to(self, peer: Any, version: int, state: dict[str, torch.Tensor]) -> None:
        peer.push_weights(version, lambda: self.blobs.get(version, state), state)

    def _broadcast_sender(self) -> Any:
        """With pipeline.remote_weight_sync broadcast: a new connection's end of its own process group."""
        if self.ctx.spec.pipeline.remote_weight_sync != "broadcast":
            return None
        from runtime.devices import dist_backend
        from runtime.weights.broadcast import BroadcastSender

        spec = self.ctx.spec
        return BroadcastSender(dist_backend(spec.resources.device), self.ctx.device, spec.rollout.hang_timeout_s)

    def stop_listening(self, ended: bool) -> None:
        """No more connections; the endpoint file is cleared only when the run ended (after a failure
        remote instances wait there for a restarted trainer)."""
        if self.listener is not None:
            self.listener.close()
            if ended:
                write_endpoint(self.ctx.out_dir / ENDPOINT_FILE, None)

    def release_evaluator(self, ended: bool) -> None:
        if self.evaluator is not None:
            self.evaluator.release(stop=ended)
