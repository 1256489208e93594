"""Metric names, reporters, the step timer and train-inference consistency.

Every key a runtime component reports is one of :data:`METRICS` (a name and
its one-line meaning, defined in :mod:`runtime.contract`); use the constants, not string literals. Reporters
implement :class:`Reporter`: a terminal progress line, a JSONL file, the
experiment trackers of ``metrics.reporters`` (:mod:`runtime.trackers`), and the
platform's HTTP reporter (``runtime.managed.reporter``). This module needs only
the standard library: each tracker imports its library when a run asks for it.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from runtime.contract import (
    ACCURACY,
    CONSISTENCY_DIFF_MAX,
    CONSISTENCY_DIFF_MEAN,
    CONSISTENCY_KL,
    EVAL_ACCURACY,
    GEN_TOKENS_PER_S,
    REWARD_MEAN,
    SAMPLES_PER_S,
    STALENESS_MAX,
    STALENESS_MEAN,
    end_of_last_line,
)
from runtime.metric_values import ReporterError, clean_metrics, plain_json
from runtime.trackers.factory import tracker_reporters

# --------------------------------------------------------------------------- the reporter interface


@runtime_checkable
class Reporter(Protocol):
    """Where per-step metrics and events go. Implementations must not raise on a
    flaky destination during a run; they buffer or drop with a message."""

    def report(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record the metrics of ``step`` (keys from :data:`METRICS`, or extra keys of a plug-in)."""

    def event(self, kind: str, payload: Mapping[str, Any]) -> None:
        """Record a one-off event: ``checkpoint``, ``eval``, ``resume``, ``error`` …"""

    def close(self) -> None:
        """Flush and release resources; further calls are errors."""


# --------------------------------------------------------------------------- terminal progress


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}"


def _fmt_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def format_progress(
    step: int, total: int | None, metrics: Mapping[str, Any], bar_width: int = 0, eta_s: float | None = None
) -> str:
    """One compact progress line, e.g.
    ``step 12/50 | reward 0.425 | acc 0.375 | stale 0.50/1 | gen 1234 tok/s | 2.5 samples/s``.
    Fields whose metric is absent are left out."""
    m = clean_metrics(metrics)
    head = f"step {step}/{total}" if total else f"step {step}"
    if bar_width and total:
        filled = min(bar_width, int(bar_width * step / total))
        head = f"[{'#' * filled}{'.' * (bar_width - filled)}] {head}"
    parts = [head]
    if REWARD_MEAN in m:
        parts.append(f"reward {_fmt(m[REWARD_MEAN])}")
    if ACCURACY in m:
        parts.append(f"acc {_fmt(m[ACCURACY])}")
    if EVAL_ACCURACY in m:
        parts.append(f"eval {_fmt(m[EVAL_ACCURACY])}")
    if STALENESS_MEAN in m or STALENESS_MAX in m:
        parts.append(f"stale {_fmt(m.get(STALENESS_MEAN), 2)}/{_fmt(m.get(STALENESS_MAX), 0)}")
    if GEN_TOKENS_PER_S in m:
        parts.append(f"gen {_fmt(m[GEN_TOKENS_PER_S], 0)} tok/s")
    if SAMPLES_PER_S in m:
        parts.append(f"{_fmt(m[SAMPLES_PER_S], 1)} samples/s")
    if eta_s is not None:
        parts.append(f"eta {_fmt_duration(eta_s)}")
    return " | ".join(parts)


class ProgressReporter:
    """A progress line per step on ``stream`` (stderr by default).

    On a terminal the line is redrawn in place with a bar and an ETA; when the
    stream is not a TTY (logs, CI) each step is a plain line of its own.
    """

    def __init__(
        self,
        total_steps: int | None = None,
        stream: IO[str] | None = None,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total = total_steps
        self.stream = stream if stream is not None else sys.stderr
        self.tty = tty if tty is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self._clock = clock
        self._first: tuple[int, float] | None = None
        self._open_line = 0  # width of the redrawn line currently on screen (TTY)

    def _eta(self, step: int) -> float | None:
        now = self._clock()
        if self._first is None:
            self._first = (step, now)
            return None
        first_step, first_time = self._first
        if not self.total or step <= first_step:
            return None
        return (now - first_time) / (step - first_step) * max(0, self.total - step)

    def report(self, step: int, metrics: Mapping[str, float]) -> None:
        eta = self._eta(step)
        if self.tty:
            line = format_progress(step, self.total, metrics, bar_width=20, eta_s=eta)
            self.stream.write("\r" + line.ljust(self._open_line))
            self._open_line = len(line)
        else:
            self.stream.write(format_progress(step, self.total, metrics) + "\n")
        self.stream.flush()

    def event(self, kind: str, payload: Mapping[str, Any]) -> None:
        self._end_line()
        details = " ".join(f"{k}={v}" for k, v in payload.items())
        self.stream.write(f"[{kind}] {details}".rstrip() + "\n")
        self.stream.flush()

    def close(self) -> None:
        self._end_line()
        self.stream.flush()

    def _end_line(self) -> None:
        if self._open_line:
            self.stream.write("\n")
            self._open_line = 0


# --------------------------------------------------------------------------- JSONL file


class JsonlReporter:
    """One JSON object per line: ``{"step": …, "time": …, <metric>: …}`` per step and
    ``{"time": …, "event": kind, "payload": {…}}`` per event.

    The file is opened in append mode, so a resumed run continues it. Pass
    ``truncate_at`` (the :meth:`cursor` saved in the checkpoint) to first cut
    off what was written after that checkpoint, so resumed steps are not
    duplicated. Without it, only a torn last line (a crash mid-write) is removed.
    Each line is flushed as written.
    """

    RESERVED = ("step", "time", "event")

    def __init__(self, path: str | Path, truncate_at: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        size = self.path.stat().st_size if self.path.exists() else 0
        if truncate_at is not None:
            if truncate_at < 0 or truncate_at > size:
                raise ReporterError(
                    f"{self.path}: cannot resume at byte {truncate_at}; the file has {size} bytes "
                    "(was it replaced or lost after the checkpoint?)"
                )
            _truncate(self.path, truncate_at)
        elif size:
            _truncate(self.path, end_of_last_line(self.path))
        self._fh = open(self.path, "ab")  # binary: tell() is then a true byte offset (the cursor)

    def report(self, step: int, metrics: Mapping[str, float]) -> None:
        clash = [k for k in self.RESERVED if k in metrics]
        if clash:
            raise ReporterError(f"metric name(s) {clash} are reserved in the JSONL record")
        record: dict[str, Any] = {"step": int(step), "time": time.time()}
        record.update(clean_metrics(metrics))
        self._write(record)

    def event(self, kind: str, payload: Mapping[str, Any]) -> None:
        self._write({"time": time.time(), "event": kind, "payload": plain_json(payload)})

    def cursor(self) -> int:
        """Bytes written so far, flushed and fsynced so the offset is durable: store it in a checkpoint
        (the *metrics cursor*) and pass it back as ``truncate_at`` on resume."""
        self._fh.flush()
        os.fsync(self._fh.fileno())
        return self._fh.tell()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()

    def _write(self, record: Mapping[str, Any]) -> None:
        self._fh.write(json.dumps(record, allow_nan=False).encode() + b"\n")
        self._fh.flush()


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(size)
        fh.flush()
        os.fsync(fh.fileno())


def read_jsonl(path: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(step records, event records) of a metrics JSONL file, in file order; a torn last line is skipped."""
    steps: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # unterminated last line: a crash mid-write
                break
            raise ReporterError(f"{path}: line {i + 1} is not JSON") from None
        (events if "event" in record else steps).append(record)
    return steps, events


# --------------------------------------------------------------------------- fan-out and construction


class MultiReporter:
    """Sends every call to each reporter; ``close()`` closes all even if one fails."""

    def __init__(self, reporters: list[Reporter] | None = None):
        self.reporters: list[Reporter] = list(reporters or [])

    def report(self, step: int, metrics: Mapping[str, float]) -> None:
        for r in self.reporters:
            r.report(step, metrics)

    def event(self, kind: str, payload: Mapping[str, Any]) -> None:
        for r in self.reporters:
            r.event(kind, payload)

    def close(self) -> None:
        first: BaseException | None = None
        for r in self.reporters:
            try:
                r.close()
            except Exception as exc:  # close the rest, then surface the first failure
                first = first or exc
        if first is not None:
            raise first

    def find(self, kind: type) -> Any:
        """The first reporter of a type (e.g. the JsonlReporter, for its cursor), or None."""
        return next((r for r in self.reporters if isinstance(r, kind)), None)


METRICS_FILE = "metrics.jsonl"


def build_reporters(
    metrics_spec: Any,
    output_dir: str | Path,
    total_steps: int | None = None,
    jsonl_cursor: int | None = None,
    stream: IO[str] | None = None,
    run_spec: Any = None,
    resumed: bool = False,
) -> MultiReporter:
    """Reporters named by a ``MetricsSpec``: the experiment trackers of ``metrics.reporters``
    (:mod:`runtime.trackers`; each logs ``run_spec``'s resolved fields as parameters and continues its own
    run when ``resumed``), the progress line and ``<output_dir>/metrics.jsonl`` (resumed at ``jsonl_cursor``
    when given)."""
    output_dir = Path(output_dir)
    multi = MultiReporter()
    # Trackers first: closed first, a tracker's late failure still reaches the run's own reporters as an event.
    multi.reporters += tracker_reporters(metrics_spec, output_dir, run_spec, notify=multi.event, resumed=resumed)
    if metrics_spec.progress_bar:
        multi.reporters.append(ProgressReporter(total_steps, stream=stream))
    if metrics_spec.jsonl:
        multi.reporters.append(JsonlReporter(output_dir / METRICS_FILE, truncate_at=jsonl_cursor))
    return multi


# --------------------------------------------------------------------------- time split


STANDARD_SECTIONS = ("generate", "train", "weight_sync", "wait")


class StepTimer:
    """Accumulates seconds per named section within a step.

    ``with timer.section("generate"): …``; ``timer.split()`` gives
    ``{"time/generate": s, "time/train": s, "time/weight_sync": s, "time/wait": s, …}``
    (the four standard sections always present) and ``timer.lap()`` returns the
    split and starts the next step. Thread-safe: in async mode several roles
    time sections at once, so sections may overlap and their sum can exceed
    wall time.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._lock = threading.Lock()
        self._totals: dict[str, float] = {}

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        if not name or "/" in name:
            raise ValueError(f"section name {name!r} must be non-empty and contain no '/'")
        start = self._clock()
        try:
            yield
        finally:
            self.add(name, self._clock() - start)

    def add(self, name: str, seconds: float) -> None:
        """Add time measured elsewhere (e.g. reported by a rollout process)."""
        if seconds < 0:
            raise ValueError(f"section {name!r}: negative duration {seconds}")
        with self._lock:
            self._totals[name] = self._totals.get(name, 0.0) + seconds

    def split(self) -> dict[str, float]:
        with self._lock:
            out = {f"time/{n}": 0.0 for n in STANDARD_SECTIONS}
            out.update({f"time/{n}": s for n, s in self._totals.items()})
            return out

    def reset(self) -> None:
        with self._lock:
            self._totals.clear()

    def lap(self) -> dict[str, float]:
        """The split so far, then reset for the next step."""
        with self._lock:
            out = {f"time/{n}": 0.0 for n in STANDARD_SECTIONS}
            out.update({f"time/{n}": s for n, s in self._totals.items()})
            self._totals.clear()
            return out


Timer = StepTimer  # the name the runtime contract uses


def bubble_fraction(wait_s: float, step_s: float) -> float:
    """Share of a trainer step spent waiting for data, in [0, 1]; 0 for an empty step."""
    if wait_s < 0 or step_s < 0:
        raise ValueError(f"durations must be >= 0 (wait_s={wait_s}, step_s={step_s})")
    if step_s == 0:
        return 0.0
    return min(1.0, wait_s / step_s)


# --------------------------------------------------------------------------- train-inference consistency


def consistency_metrics(engine_logprobs: list[list[float]], trainer_logprobs: list[list[float]]) -> dict[str, float]:
    """How far the generation engine's log-probabilities are from the trainer's on the same tokens.

    Per response token t with engine log-prob ``e`` and trainer log-prob ``p``:
    ``|e - p|`` averaged (token mean over all sequences) and maximised, and the
    **k3 estimator** of KL(engine || trainer): with ``r = exp(p - e)``,
    ``k3 = (r - 1) - log r`` — unbiased because the tokens were sampled from
    the engine, never negative, and small-variance when the two agree (it is
    ~ (p - e)^2 / 2 for small differences). All three are 0 when there are no tokens.
    """
    if len(engine_logprobs) != len(trainer_logprobs):
        raise ValueError(
            f"engine_logprobs has {len(engine_logprobs)} sequences, trainer_logprobs {len(trainer_logprobs)}"
        )
    diffs: list[float] = []
    k3s: list[float] = []
    for i, (eng, trn) in enumerate(zip(engine_logprobs, trainer_logprobs, strict=True)):
        if len(eng) != len(trn):
            raise ValueError(f"sequence {i}: engine has {len(eng)} logprobs, trainer {len(trn)}")
        for e, p in zip(eng, trn, strict=True):
            delta = float(p) - float(e)
            diffs.append(abs(delta))
            if not math.isfinite(delta) or delta > 700:  # a zero-probability token on one side
                k3s.append(math.inf)
            else:
                # expm1 keeps (r - 1) exact for tiny deltas, where the two engines nearly agree.
                k3s.append(math.expm1(delta) - delta)
    if not diffs:
        return {CONSISTENCY_DIFF_MEAN: 0.0, CONSISTENCY_DIFF_MAX: 0.0, CONSISTENCY_KL: 0.0}
    return {
        CONSISTENCY_DIFF_MEAN: math.fsum(diffs) / len(diffs),
        CONSISTENCY_DIFF_MAX: max(diffs),
        CONSISTENCY_KL: math.fsum(k3s) / len(k3s),
    }
