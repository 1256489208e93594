"""Data-parallel trainer ranks as one trainer: this process is rank 0 (the leader), the others follow.

With ``resources.trainer_devices = N > 1`` the run starts N-1 follower processes (spawned, one device
each: trainer rank r uses device index r) that join a torch.distributed process group with the
leader (gloo on CPU, NCCL on CUDA, HCCL on Ascend). Everything the pipeline does with its trainer
goes through the leader's :class:`TrainerGroup`, which looks like a :class:`~runtime.train.trainer.Trainer`:

- ``train_step(samples, step)`` — *hierarchical transfer*: only the leader takes the step's batch
  from the sample queue (so the queue's load does not grow with the number of ranks); it cuts the
  batch into N interleaved shards and scatters them over the process group; every rank trains on its
  shard, the strategy's engine (DDP or FSDP2, :mod:`runtime.train.parallel`) sums the gradients, and
  the ranks end the step with identical weights (with ``trainer.strategy: fsdp``, each with its shards).
- ``load_state_dict`` (resume, rollback) and ``set_lr`` (live parameter change) are applied on every
  rank; ``state_dict`` and the rest are the leader's (identical on every rank).
- With fsdp the ranks hold different shards, so what reads the whole model is a collective the
  followers are commanded to join: ``publish_state`` and ``unsharded_policy`` (the full weights
  gathered onto the leader), ``save_shards`` (every rank writes its shards into the checkpoint being
  written), ``load_state_dict`` (every rank reads them back) and ``score_logprobs``.

Ranks on other hosts. By default the leader starts every follower itself. With ``TANDEM_LOCAL_RANKS``
(``first-last``, 0 included) it starts only those, and the others join from processes of their own —
``python -m runtime trainer-ranks SPEC --ranks first-last`` on another host (:func:`serve_ranks`), one
device each in rank order — at the rendezvous ``MASTER_ADDR`` / ``MASTER_PORT``, which must then be set
alike everywhere. A remote rank that dies shows as a failed collective (after
``trainer.collective_timeout_s`` at most), named by the error; its own process exits non-zero.

Followers learn what to do from a command the leader broadcasts: ``("train", step, version)``
followed by the scatter of shards, ``("state", trainer state, shards directory or None)``,
``("lr", value)``, ``("verify",)``, ``("publish",)``, ``("save", directory)``, ``("score",)`` followed
by the scatter of samples, or ``("stop",)``. At start the leader sends its state (ddp), so every rank
begins from the same weights and optimizer state whatever it built; with fsdp every rank shards the
leader's weights, broadcast when the model is wrapped. A follower that dies makes the next collective fail (after
``trainer.collective_timeout_s`` at most) and the leader checks its followers before every command:
either way the run fails with the rank named, and a platform-managed run restarts the whole trainer
group from its newest checkpoint.
"""

from __future__ import annotations

import os
import socket
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runtime import processes
from runtime.placement import TrainerGroupError, local_ranks
from runtime.samples import Sample


def rendezvous() -> str:
    """The process group's init method: ``MASTER_ADDR`` / ``MASTER_PORT`` when the launcher set them,
    else a free port on this host (all ranks of a run are on one host today)."""
    addr = os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT")
    if addr and port:
        return f"tcp://{addr}:{port}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def shards(samples: list[Sample], world: int) -> list[list[Sample]]:
    """``world`` interleaved shards of a step's samples (sizes differ by one at most; a GRPO group may
    span ranks — the trainer gathers groups across ranks for the advantages)."""
    if len(samples) < world:
        raise TrainerGroupError(f"{len(samples)} samples cannot feed resources.trainer_devices={world} ranks")
    return [samples[r::world] for r in range(world)]


def weights_digest(trainer: Any) -> list[float]:
    """Per-tensor float64 sums of the policy's (and critic's) parameters: equal on ranks that agree."""
    models = [trainer.policy] + ([trainer.critic] if trainer.critic is not None else [])
    with torch.no_grad():
        return [float(p.detach().double().sum()) for m in models for p in m.parameters()]


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _scatter(parts: list[Any] | None) -> Any:
    box: list[Any] = [None]
    dist.scatter_object_list(box, parts, src=0)
    return box[0]


class TrainerGroup:
    """The leader's view of the trainer ranks (see the module docstring)."""

    def __init__(self, trainer: Any, followers: list[Any]):
        self.trainer = trainer
        self.followers = followers  # the ones this process started (ranks on other hosts are not here)
        self.world = dist.get_world_size()
        if not trainer.sharded:  # fsdp: the ranks shard the leader's weights when they wrap the model
            self._send(("state", trainer.state_dict(), None))  # every rank starts from the leader's state

    def __getattr__(self, name: str) -> Any:  # everything else is the leader's own trainer
        return getattr(self.__dict__["trainer"], name)

    @property
    def version(self) -> int:
        return int(self.trainer.version)

    @version.setter
    def version(self, value: int) -> None:
        self.trainer.version = value  # followers get it with every train command

    def _check(self) -> None:
        for rank, proc in enumerate(self.followers, start=1):
            if proc.exitcode is not None:
                raise TrainerGroupError(f"trainer rank {rank} exited with status {proc.exitcode}")

    def _send(self, command: tuple) -> None:
        self._check()
        try:
            _broadcast(command)
        except RuntimeError as exc:  # a collective timed out or a peer's connection closed
            raise TrainerGroupError(f"trainer ranks unreachable: {exc}") from None

    def train_step(self, samples: list[Sample], step: int) -> dict[str, float]:
        parts = shards(samples, self.world)
        self._send(("train", step, self.trainer.version))
        try:
            _scatter(parts)
            return self.trainer.train_step(parts[0], step)
        except RuntimeError as exc:
            self._check()
            raise TrainerGroupError(f"data-parallel step {step + 1} failed: {exc}") from None

    def load_state_dict(self, state: dict[str, Any], shards: str | Path | None = None) -> None:
        # Followers first: with fsdp the load is a collective the leader would wait in alone.
        self._send(("state", state, None if shards is None else str(shards)))
        self.trainer.load_state_dict(state, shards)

    def publish_state(self) -> dict[str, Any]:
        if self.trainer.sharded:
            self._send(("publish",))
        return self.trainer.publish_state()

    def unsharded_policy(self) -> Any:
        if self.trainer.sharded:
            self._send(("unsharded",))  # the whole model's gather (a LoRA publication gathers the adapters only)
        return self.trainer.unsharded_policy()

    def save_shards(self, directory: str | Path) -> None:
        self._send(("save", str(directory)))
        self.trainer.save_shards(directory)

    def score_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """The policy's log-probs of ``samples``' response tokens; with fsdp every rank scores a shard."""
        if not self.trainer.sharded:
            return self.trainer.score_logprobs(samples)
        parts = shards(samples, self.world)
        self._send(("score",))
        _scatter(parts)
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, self.trainer.score_logprobs(parts[0]))
        out: list[list[float]] = [[] for _ in samples]
        for rank, scored in enumerate(gathered):
            out[rank :: self.world] = scored
        return out

    def set_lr(self, lr: float) -> None:
        self.trainer.set_lr(lr)
        self._send(("lr", lr))

    @staticmethod
    def abandon(followers: list[Any]) -> None:
        """Kill the followers and leave the group: the leader failed before the group was usable."""
        for proc in followers:
            proc.kill()
            proc.join()
        if dist.is_initialized():
            dist.destroy_process_group()

    def verify(self) -> None:
        """Check that every rank holds the leader's weights (before a checkpoint: only rank 0's state is
        saved); ranks that drifted apart — a command one of them missed — fail the run by name. With
        fsdp every rank saves its own shards and there is nothing to compare."""
        if self.trainer.sharded:
            return
        self._send(("verify",))
        mine = weights_digest(self.trainer)
        digests: list[Any] = [None] * self.world
        dist.all_gather_object(digests, mine)
        bad = [rank for rank, d in enumerate(digests) if d != mine]
        if bad:
            raise TrainerGroupError(f"trainer ranks {bad} hold different weights than rank 0")

    def close(self) -> None:
        """Stop the followers and leave the process group (also after a failure)."""
        try:
            if all(p.exitcode is None for p in self.followers):
                _broadcast(("stop",))
        except RuntimeError:
            pass
        for proc in self.followers:  # the local ones; remote ranks exit on the stop by themselves
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if dist.is_initialized():
            dist.destroy_process_group()


def start_group(spec: Any, threads: int) -> tuple[Any, list[Any]]:
    """Start the followers and join the process group as rank 0; returns (process group, followers)."""
    from runtime.devices import dist_backend

    world = spec.resources.trainer_devices
    init = rendezvous()
    followers = spawn_followers(spec, local_ranks(world)[1:], 0, init, threads)
    timeout = timedelta(seconds=spec.trainer.collective_timeout_s)
    try:
        dist.init_process_group(
            dist_backend(spec.resources.device), init_method=init, rank=0, world_size=world, timeout=timeout
        )
    except Exception:
        TrainerGroup.abandon(followers)
        raise
    return dist.group.WORLD, followers


def spawn_followers(spec: Any, ranks: range, first_device: int, init: str, threads: int) -> list[Any]:
    """Start follower processes for ``ranks``; rank r uses device index ``r - ranks.start + first_device``."""
    mp = processes.context()
    followers = []
    for rank in ranks:
        proc = mp.Process(
            target=follower_process,
            args=(
                rank,
                spec.resources.trainer_devices,
                init,
                spec.resolved(),
                threads,
                rank - ranks.start + first_device,
            ),
            name=f"trainer-rank-{rank}",
            daemon=True,
        )
        proc.start()
        followers.append(proc)
    return followers


def serve_ranks(spec: Any, ranks: range, threads: int) -> int:
    """``python -m runtime trainer-ranks``: run trainer ranks ``ranks`` (> 0) of a leader on another host,
    on this host's devices 0.. in rank order; returns 0 when the leader stopped them all, 1 otherwise."""
    if ranks.start == 0:
        raise TrainerGroupError("--ranks: rank 0 is the leader (python -m runtime run); give ranks from 1")
    if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        raise TrainerGroupError("MASTER_ADDR and MASTER_PORT: required, the leader's rendezvous")
    followers = spawn_followers(spec, ranks, 0, rendezvous(), threads)
    for proc in followers:
        proc.join()
    return 0 if all(proc.exitcode == 0 for proc in followers) else 1


def follower_process(rank: int, world: int, init: str, spec_data: dict, threads: int, device_index: int) -> None:
    """Entry point of trainer rank ``rank`` > 0: build the models, then follow the leader's commands."""
    from runtime.devices import dist_backend, manual_seed_all, resolve_device, set_threads
    from runtime.spec import validate_spec
    from runtime.train.trainer import Trainer
    from runtime.workloads.llm.models import build_models

    try:
        set_threads(threads)
        spec = validate_spec(spec_data)
        manual_seed_all(spec.seed)
        device = resolve_device(spec.resources.device, device_index)
        if device.type != "cpu":
            getattr(torch, device.type).set_device(device)  # the collectives' tensors live on it
        timeout = timedelta(seconds=spec.trainer.collective_timeout_s)
        dist.init_process_group(
            dist_backend(spec.resources.device), init_method=init, rank=rank, world_size=world, timeout=timeout
        )
        models = build_models(spec, device)
        trainer = Trainer(
            spec, models.policy, models.tokenizer, device, models.ref_policy, models.critic, dist.group.WORLD
        )
        while True:
            command = _broadcast(None)
            if command[0] == "train":
                _, step, version = command
                trainer.version = version
                trainer.train_step(_scatter(None), step)
            elif command[0] == "state":
                trainer.load_state_dict(command[1], command[2])
            elif command[0] == "publish":
                trainer.publish_state()  # the gather; rank 0 keeps the weights
            elif command[0] == "unsharded":
                with trainer.unsharded_policy():  # the gather; rank 0 exports the model
                    pass
            elif command[0] == "save":
                trainer.save_shards(command[1])
            elif command[0] == "score":
                dist.all_gather_object([None] * world, trainer.score_logprobs(_scatter(None)))
            elif command[0] == "lr":
                trainer.set_lr(command[1])
            elif command[0] == "verify":
                dist.all_gather_object([None] * world, weights_digest(trainer))
            else:  # "stop"
                break
    except Exception:
        traceback.print_exc()  # the leader names this rank when its next collective fails
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
