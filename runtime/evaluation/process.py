"""The async mode's evaluator in a process of its own on the trainer's host, at the lowest CPU priority.

A thread (:class:`~runtime.evaluation.evaluator.BackgroundEvaluator`) shares the trainer's interpreter
lock: ``nice`` lowers the thread's share of the cores, not of the lock, so an evaluation that runs
Python code (a gym workload's episodes: an env step and a small forward pass at a time) slows the
trainer's steps even though the trainer never waits for it (measured: ``bench/gym.py --roles``). A
process has an interpreter of its own and, at ``nice`` 19, gets only the cores the trainer and the
sampling workers leave. A workload asks for it with ``Workload.evaluates_in_process`` (the gym's: a
small network and one env are cheap to build twice; an LLM evaluator would be a second model copy).

The same interface as the thread: ``submit(step, version, weights)``, ``results()``, ``close(wait)``,
``skipped``. One evaluation runs at a time and one waits; a newer request replaces a waiting older one.
Messages on the pipe: to the process ``("evaluate", (step, version, weights as bytes))`` and
``("stop", None)``; back ``("result", (step, metrics))`` or ``("error", traceback)``. The process exits
on ``stop`` or when the trainer is gone (its end of the pipe closes).
"""

from __future__ import annotations

import os
import threading
import traceback
from typing import Any

import torch

from runtime import processes
from runtime.rollout.wire import from_bytes, to_bytes

NICE = 19  # the lowest priority: below the trainer and the sampling workers
JOIN_S = 30.0  # how long close() waits for the process to exit before it kills it


class ProcessEvaluator:
    """The trainer's side (see the module docstring)."""

    def __init__(self, spec_data: dict[str, Any], device: str, nice: int = NICE):
        mp = processes.context()
        self._conn, child = mp.Pipe()
        self._proc = mp.Process(
            target=evaluator_process, args=(spec_data, device, child, nice), name="evaluator", daemon=True
        )
        self._proc.start()
        child.close()  # the process holds the only other end: its exit closes the pipe
        self._cond = threading.Condition()
        self._pending: tuple[int, int, bytes] | None = None  # waiting for the running evaluation
        self._busy = False  # an evaluation was sent and has not come back
        self._results: list[tuple[int, dict]] = []
        self._error: str | None = None
        self._closing = False
        self.skipped = 0
        self._reader = threading.Thread(target=self._read, name="evaluator-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def submit(self, step: int, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Evaluate ``weights`` for ``step`` once the running evaluation is done (bytes: a copy taken now)."""
        request = (step, version, to_bytes({k: v.detach().cpu() for k, v in weights.items()}))
        with self._cond:
            if not self._busy:
                self._send(request)
                return
            if self._pending is not None:
                self.skipped += 1  # an unstarted older request: the newer weights matter more
            self._pending = request

    def results(self) -> list[tuple[int, dict]]:
        """Finished evaluations since the last call, as (step, metrics)."""
        with self._cond:
            if self._error is not None:
                raise RuntimeError(f"evaluator failed: {self._error}")
            out, self._results = self._results, []
            return out

    def close(self, wait: bool = True) -> list[tuple[int, dict]]:
        """Stop the process; with ``wait`` the running and the waiting evaluation finish first (else the
        process is killed at once). Returns the last results."""
        with self._cond:
            self._closing = True
            if wait:
                self._cond.wait_for(lambda: (not self._busy and self._pending is None) or self._error is not None)
            else:
                self._pending = None
        if wait and self._proc.is_alive():
            try:
                self._conn.send(("stop", None))
            except OSError:
                pass
            self._proc.join(JOIN_S)
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join()
        self._reader.join()
        self._conn.close()
        return self.results()

    # ---- internals ----
    def _send(self, request: tuple[int, int, bytes]) -> None:
        """Hand a request to the process; the caller holds the condition."""
        self._busy = True
        try:
            self._conn.send(("evaluate", request))
        except OSError as exc:
            self._busy = False
            self._error = f"the evaluator process is gone ({exc})"

    def _read(self) -> None:
        """Reader thread: results in, the waiting request out when the process is free."""
        while True:
            try:
                kind, payload = self._conn.recv()
            except (EOFError, OSError):
                with self._cond:
                    if not self._closing:
                        self._error = f"the evaluator process exited (exit code {self._proc.exitcode})"
                    self._busy = False
                    self._cond.notify_all()
                return
            with self._cond:
                if kind == "error":
                    self._error = str(payload)
                    self._busy = False
                    self._cond.notify_all()
                    return
                self._results.append(payload)
                self._busy = False
                if self._pending is not None:
                    request, self._pending = self._pending, None
                    self._send(request)
                self._cond.notify_all()


def evaluator_process(spec_data: dict[str, Any], device: str, conn: Any, nice: int) -> None:
    """Entry point of the evaluator process: the workload's evaluation engine and task, then requests until
    ``stop`` or until the trainer is gone."""
    try:
        os.nice(nice)
    except OSError:
        pass  # not permitted here: the interpreter of its own is what matters most
    try:
        from runtime.devices import set_threads
        from runtime.spec import validate_spec
        from runtime.workloads.base import workload_for

        set_threads(1)
        spec = validate_spec(spec_data)
        workload = workload_for(spec)
        engine = workload.eval_engine(spec, torch.device(device))
        task = workload.build_task(spec)
        while True:
            kind, payload = conn.recv()
            if kind == "stop":
                return
            step, version, blob = payload
            engine.update_weights(from_bytes(blob), version)
            conn.send(("result", (step, workload.evaluate(spec, engine, task))))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the trainer is gone: nobody to report to
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
