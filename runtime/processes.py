"""How the runtime starts its child processes (rollout instances, trainer ranks, the evaluator process).

Every child used to be *spawned*: a fresh interpreter that imports torch (and the model's libraries) again before
it does anything — seconds of start-up per child, paid after the parent had paid the same. Children now
come from a *fork server* (``multiprocessing``'s ``forkserver`` start method): one clean process, started
as early as the run starts (:func:`warm_up`, beside the parent's own imports and model building), imports
the modules every child needs once (:data:`PRELOAD`), and forks each child from that state. A child
begins with them imported, yet from a process that never touched an accelerator, opened a device or ran
a thread of the parent's — the reasons the runtime never forks the parent itself.

What a child gets is unchanged: its arguments are pickled to it as with spawn; only the environment is
the fork server's, taken when it started (the runtime passes children everything through arguments, and
devices are chosen inside the child). Where ``forkserver`` does not exist (Windows) children are spawned.
"""

from __future__ import annotations

import multiprocessing
import os
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
    global _with_hf
    if spec.pipeline.mode == "async" or spec.resources.trainer_devices > 1:
        from runtime.models.hf_files import plain_config

        path = getattr(getattr(spec, "model", None), "path", None)
        _with_hf = bool(path) and plain_config(str(path)) is None  # a checkpoint the plain decoder does not load
        warm_up()
