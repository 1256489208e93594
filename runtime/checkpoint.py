"""Checkpoints: the full training state, written atomically, with retention.

Layout of one checkpoint (``root/step-00000042/``)::

    manifest.json        written last: step, metrics, sha256 + size of every file
    state/<key>.pt       one torch file per top-level key of the saved state
    shards/              trainer.strategy fsdp: every trainer rank's shards of the models and optimizers,
                         written by ``write_shards(dir)`` through torch.distributed.checkpoint
                         (``__<rank>_0.distcp`` files and ``.metadata``)
    policy/              whatever ``hf_export(dir)`` wrote (safetensors, config, tokenizer)

How a save stays atomic: everything is written into ``root/.tmp-step-…``,
each file and directory is fsynced, the manifest (with per-file checksums) is
written and fsynced last, then the directory is renamed into place and the
root fsynced. A crash at any point leaves either a ``.tmp-`` directory (never
listed, removed by the next save) or a complete checkpoint. Deletions rename a
checkpoint to ``.del-…`` first, so a half-deleted one never looks complete.

Loading never unpickles arbitrary objects: state files are read with
``torch.load(weights_only=True)``, so a state may only hold tensors, dicts,
lists, tuples, str, int, float, bool and None. :func:`save` checks that before
writing and names the offending entry. Python objects the pipeline keeps
(samples, prompts, RNG states) have packers here that turn them into that form.

One writer per root is assumed (trainer rank 0); the other trainer ranks write only their shards,
into the temporary directory rank 0 names (so the ranks must share the file system).
"""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import random
import re
import shutil
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from runtime import sample_queue as queue_format
from runtime.contract import POLICY_DIR, best_checkpoint, retained
from runtime.samples import Prompt, Sample

FORMAT = "tandem-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STATE_DIR = "state"
SHARDS_DIR = "shards"
HF_DIR = POLICY_DIR  # the Hugging Face export inside a checkpoint (the platform serves it to forks)
_STEP_RE = re.compile(r"^step-(\d{8,})$")
_KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_TMP_PREFIX = ".tmp-"
_DEL_PREFIX = ".del-"
_CHUNK = 1 << 20


class CheckpointError(Exception):
    """A checkpoint is missing, partial, corrupt, or a state cannot be saved safely."""


@dataclass(frozen=True)
class CheckpointInfo:
    """One complete checkpoint as recorded in its manifest."""

    path: Path
    step: int
    metrics: dict[str, float] = field(default_factory=dict)
    created: float = 0.0
    size: int = 0  # bytes of the files its manifest lists

    @property
    def hf_dir(self) -> Path | None:
        """The HF-format policy directory, when the save exported one."""
        d = self.path / HF_DIR
        return d if d.is_dir() else None


def step_dir_name(step: int) -> str:
    """``step-00000042``: zero-padded so names sort like steps."""
    if step < 0:
        raise CheckpointError(f"step must be >= 0, got {step}")
    return f"step-{step:08d}"


# --------------------------------------------------------------------------- the manager


class CheckpointManager:
    """Saves checkpoints under ``root`` and applies retention after each save.

    ``keep_last`` newest checkpoints are kept; with ``keep_best_metric`` the
    best checkpoint by that metric (``keep_best_mode`` max or min; ties go to
    the newest) is kept as well, however old (``runtime.contract.retained``).

    ``rotate=False``: saves delete nothing. A platform-managed run's checkpoints
    are the platform's to delete (``jobs.checkpoints``, by the same policy): it
    also keeps pinned ones, fork parents and rollback targets, which the runtime
    cannot see, and deletes record and files together.
    """

    def __init__(
        self,
        root: str | Path,
        keep_last: int = 3,
        keep_best_metric: str | None = None,
        keep_best_mode: Literal["max", "min"] = "max",
        rotate: bool = True,
    ):
        if keep_last < 1:
            raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
        if keep_best_mode not in ("max", "min"):
            raise CheckpointError(f"keep_best_mode must be 'max' or 'min', got {keep_best_mode!r}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.keep_best_metric = keep_best_metric
        self.keep_best_mode = keep_best_mode
        self.rotate = rotate

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        hf_export: Callable[[Path], None] | None = None,
        metrics: Mapping[str, float] | None = None,
        write_shards: Callable[[Path], None] | None = None,
    ) -> Path:
        """Write a checkpoint for ``step`` atomically and return its path.

        ``state``'s top-level keys become file names (``state/<key>.pt``);
        values must be weights-only-safe (checked first, nothing is written
        otherwise). ``write_shards(dir)`` writes sharded state into ``dir``
        (``shards/``), checksummed like every other file. ``hf_export(dir)``
        writes the policy in HF format into ``dir``. An existing checkpoint of
        the same step is replaced.
        """
        name = step_dir_name(step)
        clean_metrics = _clean_metrics(metrics or {})
        for key, value in state.items():
            if not isinstance(key, str) or not _KEY_RE.match(key):
                raise CheckpointError(f"state key {key!r} is not usable as a file name (letters, digits, _ . -)")
            check_weights_only_safe(value, f"state[{key!r}]")

        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_leftovers()
        tmp = self.root / f"{_TMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            (tmp / STATE_DIR).mkdir()
            for key, value in state.items():
                with open(tmp / STATE_DIR / f"{key}.pt", "wb") as fh:
                    torch.save(value, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
            if write_shards is not None:
                write_shards(tmp / SHARDS_DIR)
            if hf_export is not None:
                (tmp / HF_DIR).mkdir()
                hf_export(tmp / HF_DIR)
            files = _fsync_and_hash_tree(tmp)
            manifest = {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "step": step,
                "created": time.time(),
                "metrics": clean_metrics,
                "state_keys": list(state.keys()),
                "hf_dir": HF_DIR if hf_export is not None else None,
                "shards_dir": SHARDS_DIR if write_shards is not None else None,
                "files": files,
            }
            _write_durable(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
            _fsync_dir(tmp)
            final = self.root / name
            if final.exists():
                _delete_dir(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if self.rotate:
            self.apply_retention()
        return final

    def list(self) -> list[CheckpointInfo]:
        """Complete checkpoints (final name and a readable manifest), oldest first."""
        if not self.root.is_dir():
            return []
        infos = []
        for entry in self.root.iterdir():
            match = _STEP_RE.match(entry.name)
            if not entry.is_dir() or not match:
                continue
            try:
                manifest = read_manifest(entry)
            except CheckpointError:
                continue
            if manifest["step"] != int(match.group(1)):
                continue  # renamed or copied by hand: not a checkpoint this manager wrote here
            infos.append(_info(entry, manifest))
        return sorted(infos, key=lambda i: i.step)

    def latest(self) -> Path | None:
        """The newest complete checkpoint; temp, deleted and manifest-less directories are ignored."""
        infos = self.list()
        return infos[-1].path if infos else None

    def best(self) -> CheckpointInfo | None:
        """The best checkpoint by ``keep_best_metric`` (ties: newest), or None."""
        if self.keep_best_metric is None:
            return None
        infos = self.list()
        best = best_checkpoint(
            ((n, i.step, i.metrics) for n, i in enumerate(infos)), self.keep_best_metric, self.keep_best_mode
        )
        return None if best is None else infos[best]

    def apply_retention(self) -> builtins.list[Path]:
        """Delete checkpoints outside keep-last and keep-best; return what was deleted."""
        infos = self.list()
        keep = retained(
            ((i.path, i.step, i.metrics) for i in infos), self.keep_last, self.keep_best_metric, self.keep_best_mode
        )
        removed = []
        for info in infos:
            if info.path not in keep:
                _delete_dir(info.path)
                removed.append(info.path)
        if removed:
            _fsync_dir(self.root)
        return removed

    def _remove_leftovers(self) -> None:
        # Temp and half-deleted directories of an earlier crashed process; safe
        # because there is one writer per root.
        for entry in self.root.iterdir():
            if entry.is_dir() and entry.name.startswith((_TMP_PREFIX, _DEL_PREFIX)):
                shutil.rmtree(entry, ignore_errors=True)


def _clean_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise CheckpointError(f"metric {key!r} is not a number: {value!r}") from None
        if number != number or number in (float("inf"), float("-inf")):
            continue  # JSON cannot hold it and it can never be "best"
        out[str(key)] = number
    return out


# --------------------------------------------------------------------------- loading and verification


def read_manifest(path: str | Path) -> dict[str, Any]:
    """Read and sanity-check a checkpoint's manifest (no checksums)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{mpath}: missing — the checkpoint is partial (a save did not finish)")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{mpath}: unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mpath}: not a {FORMAT} manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{mpath}: format version {manifest.get('version')!r}, this runtime reads {FORMAT_VERSION}"
        )
    if not isinstance(manifest.get("step"), int) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{mpath}: manifest lacks `step` or `files`")
    return manifest


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check every file the manifest lists: present, right size, right sha256.

    Returns the manifest; raises :class:`CheckpointError` naming the first bad file.
    """
    path = Path(path)
    manifest = read_manifest(path)
    for rel, entry in sorted(manifest["files"].items()):
        parts = Path(rel).parts
        if Path(rel).is_absolute() or ".." in parts or not parts:
            raise CheckpointError(f"{path / MANIFEST}: file entry {rel!r} points outside the checkpoint")
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("sha256"), str)
            or not isinstance(entry.get("bytes"), int)
        ):
            raise CheckpointError(f"{path / MANIFEST}: file entry {rel!r} lacks `sha256` or `bytes`")
        fpath = path / rel
        if not fpath.is_file():
            raise CheckpointError(f"{fpath}: missing (listed in the manifest)")
        size = fpath.stat().st_size
        if size != entry["bytes"]:
            what = "truncated" if size < entry["bytes"] else "too long"
            raise CheckpointError(f"{fpath}: {what}, {size} bytes where the manifest says {entry['bytes']}")
        digest = _sha256(fpath)
        if digest != entry["sha256"]:
            raise CheckpointError(
                f"{fpath}: checksum mismatch (sha256 {digest[:12]}…, manifest {entry['sha256'][:12]}…)"
            )
    return manifest


def load_checkpoint(path: str | Path, keys: Iterable[str] | None = None) -> dict[str, Any]:
    """Verify a checkpoint and return the state dict that was saved.

    ``keys`` limits loading to some top-level keys. Tensors land on the CPU.
    The HF policy directory, if any, is ``path / "policy"`` (see :func:`checkpoint_info`).
    """
    path = Path(path)
    manifest = verify_checkpoint(path)
    wanted = list(manifest.get("state_keys") or [])
    if keys is not None:
        keys = list(keys)
        missing = [k for k in keys if k not in wanted]
        if missing:
            raise CheckpointError(f"{path}: no state key(s) {missing}; it holds {wanted}")
        wanted = keys
    state = {}
    for key in wanted:
        fpath = path / STATE_DIR / f"{key}.pt"
        try:
            state[key] = torch.load(fpath, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises many kinds; the caller needs one
            raise CheckpointError(f"{fpath}: cannot be loaded safely ({type(exc).__name__}: {exc})") from None
    return state


def shards_dir(path: str | Path) -> Path | None:
    """The directory of a checkpoint's sharded trainer state (``write_shards``), or None when it has none."""
    manifest = read_manifest(path)
    name = manifest.get("shards_dir")
    if name is None:
        return None
    if name != SHARDS_DIR:
        raise CheckpointError(f"{Path(path) / MANIFEST}: shards_dir is {name!r}, expected {SHARDS_DIR!r}")
    return Path(path) / SHARDS_DIR


def checkpoint_info(path: str | Path) -> CheckpointInfo:
    """Step, metrics, creation time and size of a checkpoint (manifest only, no checksums)."""
    path = Path(path)
    return _info(path, read_manifest(path))


def _info(path: Path, manifest: Mapping[str, Any]) -> CheckpointInfo:
    files = manifest.get("files") or {}
    return CheckpointInfo(
        path=path,
        step=int(manifest["step"]),
        metrics=dict(manifest.get("metrics") or {}),
        created=float(manifest.get("created", 0.0)),
        size=sum(int(entry.get("bytes", 0)) for entry in files.values() if isinstance(entry, dict)),
    )


# --------------------------------------------------------------------------- weights-only safety

_SCALARS = (str, int, float, bool, type(None))


def check_weights_only_safe(value: Any, where: str = "state") -> None:
    """Raise :class:`CheckpointError` naming the first entry ``torch.load(weights_only=True)`` would refuse."""
    if isinstance(value, _SCALARS) or isinstance(value, torch.Tensor):
        if isinstance(value, torch.Tensor) and value.layout != torch.strided:
            raise CheckpointError(f"{where}: only dense tensors are supported, got layout {value.layout}")
        return
    if type(value) in (dict, OrderedDict):
        for k, v in value.items():
            if not isinstance(k, _SCALARS):
                raise CheckpointError(f"{where}: dict key {k!r} of type {type(k).__name__} is not a plain scalar")
            check_weights_only_safe(v, f"{where}[{k!r}]")
        return
    if isinstance(value, list | tuple) and type(value) in (list, tuple):
        for i, v in enumerate(value):
            check_weights_only_safe(v, f"{where}[{i}]")
        return
    if isinstance(value, torch.dtype | torch.device | torch.Size):
        return
    hint = ""
    if isinstance(value, Sample | Prompt):
        hint = "; pack lists of them with pack_samples() / pack_prompts()"
    elif isinstance(value, np.ndarray | np.generic):
        hint = "; convert it with torch.from_numpy() or .item()"
    raise CheckpointError(f"{where}: a {type(value).__name__} cannot be loaded with weights_only=True{hint}")


# --------------------------------------------------------------------------- RNG states


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as plain tensors/ints: python, numpy (legacy global), torch CPU, and
    cuda / npu when that accelerator is present. torch.Generator objects a caller owns are not
    included (save ``gen.get_state()`` yourself)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss},
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    npu = getattr(torch, "npu", None)  # present only once torch_npu was imported by devices.py
    if npu is not None and npu.is_available():
        state["npu"] = list(npu.get_rng_state_all())
    return state


def restore_rng(state: Mapping[str, Any], strict: bool = True) -> None:
    """Restore states from :func:`capture_rng`. With ``strict``, an accelerator state with no such
    accelerator here (or a different device count) is an error; otherwise it is skipped."""
    try:
        py = state["python"]
        random.setstate((int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
        nps = state["numpy"]
        np.random.set_state(
            (nps["kind"], nps["keys"].numpy().astype(np.uint32), nps["pos"], nps["has_gauss"], nps["cached_gaussian"])
        )
        torch.set_rng_state(state["torch"])
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise CheckpointError(f"RNG state is malformed ({type(exc).__name__}: {exc})") from None
    for kind in ("cuda", "npu"):
        if kind not in state:
            continue
        module = getattr(torch, kind, None)
        have = module.device_count() if module is not None and module.is_available() else 0
        if module is not None and have and have == len(state[kind]):
            module.set_rng_state_all(state[kind])
        elif strict:
            raise CheckpointError(
                f"RNG state has {len(state[kind])} {kind} device(s) but this process sees {have}; "
                "pass strict=False to skip accelerator RNG states"
            )


# --------------------------------------------------------------------------- packing samples and prompts


def pack_samples(samples: list[Sample]) -> dict[str, Any]:
    """Samples in the queue's packed format (:func:`runtime.sample_queue.pack_samples`), ready for ``save``."""
    try:
        return queue_format.pack_samples(samples)
    except queue_format.PackError as exc:
        raise CheckpointError(str(exc)) from None


def unpack_samples(packed: Mapping[str, Any]) -> list[Sample]:
    """Inverse of :func:`pack_samples`."""
    try:
        return queue_format.unpack_samples(dict(packed))
    except queue_format.PackError as exc:
        raise CheckpointError(str(exc)) from None


def pack_prompts(prompts: list[Prompt]) -> dict[str, Any]:
    """Prompts (e.g. in flight at checkpoint time) as weights-only-safe lists and tensors."""
    return {
        "kind": "prompts/v1",
        "prompt_id": torch.tensor([p.prompt_id for p in prompts], dtype=torch.int64),
        "size": torch.tensor([p.size for p in prompts], dtype=torch.int64),
        "text": [p.text for p in prompts],
        "answer": [p.answer for p in prompts],
    }


def unpack_prompts(packed: Mapping[str, Any]) -> list[Prompt]:
    """Inverse of :func:`pack_prompts`."""
    if packed.get("kind") != "prompts/v1":
        raise CheckpointError(f"not a packed prompt list (kind {packed.get('kind')!r})")
    ids, sizes = packed["prompt_id"].tolist(), packed["size"].tolist()
    return [
        Prompt(prompt_id=ids[i], text=packed["text"][i], answer=packed["answer"][i], size=sizes[i])
        for i in range(len(ids))
    ]


# --------------------------------------------------------------------------- file-system helpers


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_and_hash_tree(root: Path) -> dict[str, dict[str, Any]]:
    """fsync every file and directory under ``root`` (hf_export wrote some without it) and
    return ``{relative path: {sha256, bytes}}``."""
    files: dict[str, dict[str, Any]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            fpath = Path(dirpath) / name
            if fpath.is_symlink():
                raise CheckpointError(f"{fpath}: symbolic links are not allowed in a checkpoint")
            with open(fpath, "rb") as fh:
                os.fsync(fh.fileno())
            rel = fpath.relative_to(root).as_posix()
            files[rel] = {"sha256": _sha256(fpath), "bytes": fpath.stat().st_size}
        _fsync_dir(Path(dirpath))
    return files


def _delete_dir(path: Path) -> None:
    # Rename first: a crash during rmtree leaves a `.del-` directory, never a
    # complete-looking checkpoint with files missing.
    doomed = path.with_name(f"{_DEL_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)
