"""How the runtime starts its child processes (rollout instances, trainer ranks, the evaluator process).

Every child used to be *spawned*: a fresh interpreter that imports torch (and the model's libraries) again before
it does anything — seconds of start-up per child, paid after the parent had paid the same. Children now
come from a *fork server* (``multiprocessing``'s ``forkserver`` start method): one clean process, started
as early as the run starts (:func:`warm_up`, beside the parent's own imports and model building), imports
the modules every child needs once (:data:`PRELOAD`), and forks each child from that state. A child
begins with them imported, yet from a process that never touched an accelerator, opened a device or ran
a thread of the parent's — the reasons the runtime never forks a parent that has started running (see
Memory below for the one moment before that).

What a child gets is unchanged: its arguments are pickled to it as with spawn; only the environment is
the fork server's, taken when it started (the runtime passes children everything through arguments, and
devices are chosen inside the child). Where ``forkserver`` does not exist (Windows) children are spawned.

Memory. A fresh interpreter that imports torch holds about 145 MiB of heap of its own (torch's operator
registrations and the like) — a second copy of what the parent already holds. So the CLI's entry points
(``python -m runtime run`` and the platform's ``role`` processes) start the fork server as a *fork of
themselves* (:func:`fork_server_here`) at the one moment that is as clean as a fresh interpreter: their
imports done, before any thread is started, any device opened or any torch operation run. The fork server
and every child then share the parent's pages copy-on-write. Anywhere else (a library caller of
``runtime.pipeline.run``, a test) the fork server is a fresh interpreter, as before.
"""

from __future__ import annotations

import gc
import importlib
import inspect
import multiprocessing
import os
import signal
import socket
import sys
import threading
from typing import Any

# What every child imports anyway: torch and the runtime modules holding the children's entry points. A
# module that fails to import is skipped there. The built-in models are plain PyTorch
# (runtime.models.decoder), and so is a ``model.path`` checkpoint it computes exactly (hf_files.plain_config);
# a run of another Hugging Face checkpoint builds its model with transformers in every child as well, so its
# fork server imports those too (HF_PRELOAD).
PRELOAD = [
    "torch",
    "runtime.rollout.instance",
    "runtime.workloads.llm",
    "runtime.train.group",
    "runtime.evaluation.process",
]
HF_PRELOAD = [
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.llama.modeling_llama",
]
_with_hf = False  # set by warm_up_for a run whose model.path transformers loads


def _start_method() -> str:
    """``forkserver`` where it exists; ``TANDEM_START_METHOD=spawn`` brings back fresh interpreters (to compare,
    or should a library misbehave in a forked child)."""
    asked = os.environ.get("TANDEM_START_METHOD", "")
    if asked not in ("", "spawn", "forkserver"):
        raise ValueError(f"TANDEM_START_METHOD: {asked!r} is not spawn or forkserver")
    if asked == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    return "forkserver"


START_METHOD = _start_method()


def context() -> Any:
    """The multiprocessing context every child of the runtime is started from (torch's, so tensors passed
    to a child travel through shared memory)."""
    import torch.multiprocessing as torch_mp

    _set_preload()
    return torch_mp.get_context(START_METHOD)


def warm_up() -> None:
    """Start the fork server now, so its imports overlap the caller's own instead of delaying the first
    child (a no-op when it runs already, or with spawn). Imports nothing heavy itself."""
    if START_METHOD != "forkserver":
        return
    from multiprocessing import forkserver

    _set_preload()  # before the server starts: it imports the list once, when it starts
    forkserver.ensure_running()


def _set_preload() -> None:
    if START_METHOD == "forkserver":  # one fork server per process, shared by every context of that method
        modules = PRELOAD + HF_PRELOAD if _with_hf else PRELOAD
        multiprocessing.get_context("forkserver").set_forkserver_preload(modules)


def warm_up_for(spec: Any) -> None:
    """:func:`warm_up` when ``spec`` (a runtime.spec.RunSpec) will start children: async rollout processes or an
    evaluator process, data-parallel trainer ranks. Otherwise the fork server's imports would only compete
    with the run's own for the cores. A run whose ``model.path`` transformers loads gets it preloaded too."""
    if _starts_children(spec):
        warm_up()


def _starts_children(spec: Any) -> bool:
    """Whether a run of ``spec`` starts children; notes whether they need transformers (:data:`HF_PRELOAD`)."""
    global _with_hf
    if spec.pipeline.mode != "async" and spec.resources.trainer_devices <= 1:
        return False
    from runtime.models.implementation import choose_implementation

    model = getattr(spec, "model", None)
    device_type = str(getattr(getattr(spec, "resources", None), "device", "cpu")).split(":")[0]
    try:  # children build the model in transformers: preload it
        _with_hf = model is not None and choose_implementation(model, device_type) == "transformers"
    except ValueError:
        _with_hf = False  # a bad model spec fails where the run builds its model, with its field named
    return True


def fork_server_here(spec: Any) -> bool:
    """Start the fork server as a fork of this process when ``spec`` will start children (see the module
    docstring): import what the children need here, then fork. Only for an entry point at a clean moment — one
    thread, nothing run on a device; where that does not hold, or a fork server runs already, nothing is
    started here (:func:`warm_up_for` later starts a fresh-interpreter one). Returns whether it started one."""
    if START_METHOD != "forkserver" or not _starts_children(spec):
        return False
    for name in PRELOAD + HF_PRELOAD if _with_hf else PRELOAD:
        importlib.import_module(name)  # the parent builds from them too; the children start with them
    if threading.active_count() != 1 or _device_opened():
        return False
    from multiprocessing import connection, forkserver, resource_tracker, util

    server: Any = forkserver._forkserver  # the module's singleton that every forkserver context uses
    if server._forkserver_pid is not None or not _known_protocol(forkserver):
        return False
    # No lock taken (one thread): a lock held across the fork would stay held in every child.
    resource_tracker.ensure_running()  # before the fork, as ForkServer.ensure_running does
    sys.stdout.flush()
    sys.stderr.flush()  # nothing buffered is written twice
    gc.freeze()  # what exists now is never scanned by a collection again: its pages stay shared
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # EOF on alive_r when every client is gone: the server exits
        pid = os.fork()
        if pid == 0:
            _serve(listener.fileno(), alive_r, alive_w)  # never returns
        os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    return True


def _known_protocol(forkserver: Any) -> bool:
    """Whether the standard library's fork server is the one this module drives (Python 3.11's: a listener and an
    "alive" pipe, no authentication key); another version gets the fresh-interpreter fork server."""
    params = list(inspect.signature(forkserver.main).parameters)
    server = forkserver._forkserver
    fields = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")
    return (
        params[:3] == ["listener_fd", "alive_r", "preload"]
        and all(hasattr(server, f) for f in fields)
        and not hasattr(server, "_forkserver_authkey")
    )


def _device_opened() -> bool:
    """Whether this process has initialised an accelerator (a forked copy of its context would be unusable)."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


def _serve(listener_fd: int, alive_r: int, alive_w: int) -> None:
    """The forked fork server: multiprocessing's own loop, with nothing of the parent's but its memory."""
    from multiprocessing import forkserver

    code = 0
    try:
        os.close(alive_w)
        keep = {0, 1, 2, listener_fd, alive_r}
        for fd in map(int, os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ()):
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass  # the directory's own descriptor, closed already
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)  # the parent's handlers are not the children's
        forkserver.main(listener_fd, alive_r, [])
    except SystemExit:
        pass
    except BaseException:
        code = 1
    finally:
        os._exit(code)  # never the parent's atexit handlers or buffers
