"""One rollout instance process (async mode): the process that hosts a workload's rollout instance.

:func:`rollout_process` is what the trainer spawns (:mod:`runtime.pipeline.instance_pool`): it
builds the run's workload's instance on its device (``Workload.rollout_instance``; the LLM's is
:class:`~runtime.workloads.llm.instance.RolloutInstance`, continuous batching of token groups) and
runs it until the run ends, reporting what goes wrong.

Protocol. In, on the instance's own ``work_q``: ``(epoch, [(ticket, packed work item), ...])`` or
None (exit). Out, on its own pipe: ``("ready", rank, pid)``; ``("beat", rank, None)`` about every
second (the trainer kills an instance silent for ``rollout.hang_timeout_s``); ``("samples", rank,
(blob, info))`` with ``blob`` the workload's packed samples (:func:`runtime.rollout.wire.to_bytes`)
and ``info`` its accounting (the LLM's: :mod:`runtime.workloads.llm.instance`);
``("error", rank, traceback)``; ``("exit", rank, None)``. The shared ``flags`` hold the run's stop
flag and the epoch a rollback bumps (:mod:`runtime.rollout.wire`).

Instance state. An instance whose output depends on more than its work items (a gym sampler's running
episodes and action RNG) puts ``info["state"]`` (bytes) in each ``samples`` message: where it stands
after those samples. The trainer keeps the last one of each rank whose samples it accepted, in its
checkpoints too, and hands it to the next instance of that rank (a replacement, or the instances of a
resumed run), which continues from it: the samples it produces follow on from the last ones trained.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

from runtime.devices import resolve_device, set_threads
from runtime.placement import rollout_device_index
from runtime.rollout.wire import STOP, set_trainer_pid
from runtime.spec import validate_spec
from runtime.weights.service import WeightSubscriber
from runtime.workloads.base import workload_for


def rollout_process(
    rank: int,
    spec_data: dict,
    shared: Any,
    work_q: Any,
    conn: Any,
    flags: Any,
    threads: int,
    state: bytes | None = None,
    trainer: int | None = None,
) -> None:
    """Entry point of one rollout instance process (see the module docstring for the protocol).

    Nothing here is shared with the other instances except the weight buffer (whose lock the
    trainer frees if we die holding it) and ``flags`` (no lock at all), so a process killed at any
    moment leaves the others and the trainer working. Exits on None, when ``flags[STOP]`` is set,
    or when the trainer process is gone.
    """
    # Our parent: the trainer, or the fork server, which exits when the trainer does (runtime.processes).
    parent = os.getppid()
    if trainer is not None:
        set_trainer_pid(trainer)

    def ended() -> bool:  # the run stops, or the trainer was killed (we are orphaned)
        return bool(flags[STOP]) or os.getppid() != parent

    instance = None
    try:
        set_threads(threads)
        spec = validate_spec(spec_data)
        device = resolve_device(spec.resources.device, rollout_device_index(spec, rank))
        sub = WeightSubscriber(shared, current_version=-1)
        instance = workload_for(spec).rollout_instance(rank, spec, device, sub, conn, flags, state)
        conn.send(("ready", rank, os.getpid()))
        instance.run(work_q, ended)
    except (BrokenPipeError, ConnectionResetError):
        return  # the trainer is gone: nobody to report to
    except BaseException:  # the trainer turns this into a clear error and stops the run
        try:
            conn.send(("error", rank, traceback.format_exc()))
        except OSError:
            pass
    finally:
        if instance is not None:
            instance.close()
        try:
            conn.send(("exit", rank, None))
        except OSError:
            pass
