"""A tracker on a thread of its own, so that it can neither slow nor fail the run.

A tracker talks to a library that may block (a server's retries take minutes) or raise (a server gone, a
full disk). :class:`BackgroundTracker` is what the run's :class:`~runtime.metrics.MultiReporter` holds: its
``report`` and ``event`` only queue the record; a thread starts the tracker and feeds it. When the tracker
fails, it takes nothing more and the run is told once, on its own thread, by a ``tracker_error`` event to
every reporter (so to metrics.jsonl and the platform, which still have every metric): the run goes on.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from runtime.contract import EVENT_CHECKPOINT
from runtime.metric_values import ReporterError, clean_metrics, plain_json

__all__ = ["CHECKPOINT_MANIFEST", "EVENT_CHECKPOINT", "TRACKER_ERROR", "BackgroundTracker", "Tracker"]

# runtime.checkpoint.MANIFEST (that module imports torch): a checkpoint's files with their sizes and sha256
CHECKPOINT_MANIFEST = "manifest.json"
TRACKER_ERROR = "tracker_error"  # payload tracker, error: a tracker stopped; the run and its other reporters go on
QUEUE_LIMIT = 10_000  # records waiting for a slow tracker before it drops them (and says so)
CLOSE_WAIT_S = 120.0  # at the end of the run, how long a tracker may take to send what is queued
_STOP = ("stop",)


def previous_run(path: Path, resumed: bool) -> dict[str, Any] | None:
    """What a tracker recorded in ``path`` about the run it logged this output directory to (the file it writes
    at start), when the run resumes; None when it does not, or the file is missing or unreadable."""
    if not resumed or not path.is_file():
        return None
    try:
        before = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return before if isinstance(before, dict) else None


class Tracker(Protocol):
    """One experiment tracker's side of a run; every method runs on the tracker's own thread."""

    name: str

    def start(self) -> None:
        """Import the library, open (or resume) the tracker's run, log the parameters."""

    def log_metrics(self, step: int, metrics: Mapping[str, float | int]) -> None:
        """One step's finite metric values."""

    def log_event(self, kind: str, payload: Mapping[str, Any]) -> None:
        """A run event (``checkpoint``: the tracker's artifact); kinds a tracker has no use for are ignored."""

    def finish(self) -> None:
        """End the tracker's run and release what it holds."""


Notify = Callable[[str, Mapping[str, Any]], None]


class BackgroundTracker:
    """The :class:`~runtime.metrics.Reporter` of a :class:`Tracker`: never raises, never blocks the run.

    ``notify(kind, payload)`` sends an event to the run's reporters (the MultiReporter's ``event``); it is
    called on the run's thread only, from ``report``, ``event`` or ``close``.
    """

    def __init__(
        self,
        tracker: Tracker,
        notify: Notify,
        queue_limit: int = QUEUE_LIMIT,
        close_wait_s: float = CLOSE_WAIT_S,
    ):
        self.tracker = tracker
        self._notify = notify
        self._close_wait_s = close_wait_s
        self._queue: queue.Queue[tuple[Any, ...]] = queue.Queue(maxsize=queue_limit)
        self._failure: str | None = None  # written by the thread once, read by the run's thread
        self._told = False
        self._dropped = 0
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=f"tracker-{tracker.name}", daemon=True)
        self._thread.start()

    @property
    def failure(self) -> str | None:
        """Why the tracker stopped, or None while it works."""
        return self._failure

    def report(self, step: int, metrics: Mapping[str, float]) -> None:
        try:
            values = {k: v for k, v in clean_metrics(metrics).items() if v is not None}
        except ReporterError:
            return  # the run's own reporters refuse the bad value loudly
        self._put(("metrics", int(step), values))

    def event(self, kind: str, payload: Mapping[str, Any]) -> None:
        self._put(("event", str(kind), plain_json(payload)))

    def close(self) -> None:
        """Send what is queued (waiting up to ``close_wait_s``) and end the tracker's run; twice is harmless."""
        if self._closed:
            return
        self._closed = True
        if self._failure is None:
            try:
                self._queue.put(_STOP, timeout=self._close_wait_s)
            except queue.Full:
                pass
            self._thread.join(self._close_wait_s)
            if self._thread.is_alive():
                self._fail(
                    f"still sending after {self._close_wait_s:g} s at the end of the run: its last records are missing"
                )
        self._tell()

    # ---- the run's thread ----------------------------------------------------------------------------
    def _put(self, item: tuple[Any, ...]) -> None:
        if self._closed:
            return
        self._tell()
        if self._failure is not None:
            return  # a failed tracker takes nothing more
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1:
                self._notify(
                    TRACKER_ERROR,
                    {
                        "tracker": self.tracker.name,
                        "error": f"{self._queue.maxsize} records behind: it drops records until it catches up",
                    },
                )

    def _tell(self) -> None:
        if self._failure is not None and not self._told:
            self._told = True  # first: the event below comes back through this tracker's own event()
            self._notify(TRACKER_ERROR, {"tracker": self.tracker.name, "error": self._failure})

    # ---- the tracker's thread ------------------------------------------------------------------------
    def _work(self) -> None:
        try:
            self.tracker.start()
            while (item := self._queue.get()) is not _STOP:
                if item[0] == "metrics":
                    self.tracker.log_metrics(item[1], item[2])
                else:
                    self.tracker.log_event(item[1], item[2])
            self.tracker.finish()
        except BaseException as exc:  # anything a library raises stops this tracker, never the run
            self._fail(f"{type(exc).__name__}: {exc}")
            try:
                self.tracker.finish()
            except BaseException:  # noqa: S110 - already failed; release what can be released
                pass

    def _fail(self, why: str) -> None:
        if self._failure is None:
            self._failure = why[:2000]
