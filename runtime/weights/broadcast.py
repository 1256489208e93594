"""Weights to a remote rollout instance by torch.distributed broadcast, in a process group of its own.

With ``pipeline.remote_weight_sync: broadcast`` the link (:mod:`runtime.rollout.link`) carries only the
announcement of a version; its tensors go by ``broadcast`` in a two-member process group made for that
connection — the trainer is rank 0, the instance rank 1 — on the run's backend: gloo on CPU, NCCL on
CUDA and HCCL on Ascend, where the tensors move device to device without the host in between.

    trainer -> instance   welcome {"broadcast": {"port": P, "prefix": secret}}    (on the authenticated link)
                          ("weights_bcast", (version, manifest))   then one broadcast per manifest entry

The group meets at a ``TCPStore`` the trainer opens for the connection (port ``P``), under a key prefix
drawn for it and sent over the authenticated link, so nobody else can join its rendezvous. Its data
connections are torch.distributed's own, unauthenticated like those of the trainer ranks: use it on
the cluster's trusted network. Each side builds its half of the group at the first announcement (the
constructors meet each other); a peer that dies mid-broadcast fails the collective (after
``rollout.hang_timeout_s`` at most) and ends the connection.
"""

from __future__ import annotations

import secrets
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

Manifest = list[tuple[str, list[int], str]]  # (name, shape, dtype) in broadcast order


def make_group(backend: str, store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    """A process group of ``size`` members outside the default group, on ``backend``."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":  # CUDA builds only
        options = dist.ProcessGroupNCCL.Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)  # type: ignore[attr-defined]
    if backend == "hccl":
        import torch_npu  # noqa: F401  (registers ProcessGroupHCCL)

        return dist.ProcessGroupHCCL(store, rank, size, timeout)  # type: ignore[attr-defined]
    raise ValueError(f"no process group for backend {backend!r}")


def manifest_of(state: dict[str, torch.Tensor]) -> Manifest:
    return [(name, list(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in state.items()]


class BroadcastSender:
    """The trainer's end for one connection: a store to meet at, then the group and its broadcasts."""

    def __init__(self, backend: str, device: torch.device, timeout_s: float):
        self.backend, self.device = backend, device
        self.timeout = timedelta(seconds=timeout_s)
        self.prefix = secrets.token_hex(16)
        self.store: Any = dist.TCPStore("0.0.0.0", 0, 2, True, timeout=self.timeout, wait_for_workers=False)
        self.group: Any = None

    @property
    def welcome(self) -> dict[str, Any]:
        return {"port": self.store.port, "prefix": self.prefix}

    def close(self) -> None:
        """Drop the group and the store (its port closes): the connection is over."""
        self.group = self.store = None

    def send(self, state: dict[str, torch.Tensor]) -> None:
        """Broadcast ``state``'s tensors in manifest order (after announcing it on the link)."""
        if self.group is None:
            self.group = make_group(self.backend, dist.PrefixStore(self.prefix, self.store), 0, 2, self.timeout)
        for tensor in state.values():
            self.group.broadcast(tensor.detach().to(self.device).contiguous(), 0).wait()


class BroadcastReceiver:
    """The instance's end: joins the trainer's store from the welcome, receives each announced version."""

    def __init__(self, address: str, info: dict[str, Any], backend: str, device: torch.device, timeout_s: float):
        self.backend, self.device = backend, device
        self.timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(address, int(info["port"]), 2, False, timeout=self.timeout)
        self.prefix = str(info["prefix"])
        self.group: Any = None

    def receive(self, manifest: Manifest) -> dict[str, torch.Tensor]:
        """The tensors of one announced version, fresh ones on this instance's device."""
        if self.group is None:
            self.group = make_group(self.backend, dist.PrefixStore(self.prefix, self.store), 1, 2, self.timeout)
        state = {}
        for name, shape, dtype in manifest:
            buf = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            self.group.broadcast(buf, 0).wait()
            state[name] = buf
        return state


__all__ = ["BroadcastReceiver", "BroadcastSender", "Manifest", "make_group", "manifest_of"]
