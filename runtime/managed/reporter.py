"""HTTP reporter: metric points and events to the platform's ingest API, losing nothing.

Every record is first appended to a local spool (``<spool_dir>/spool.jsonl``,
one JSON object per line, fsynced) and only then sent; a background thread
POSTs what is not yet delivered, in order, in batches, and after each
acknowledged batch moves a durable cursor (``<spool_dir>/cursor.json``). So:

- platform down, slow or answering errors: records wait in the spool; the
  sender retries with exponential back-off (capped, jittered);
- the runtime crashes or restarts: a new reporter on the same ``spool_dir``
  replays the undelivered records first, in their original order;
- a batch whose reply was lost is sent again: every point carries its
  idempotency key ``(run, attempt, step)`` (events: ``(run, attempt, role, seq)``:
  each role process has its own reporter and so its own ``seq`` counter),
  so the platform stores it once.

Wire format (``POST <base_url><path>``, ``Authorization: Bearer <token>``;
the schema, limits included, is ``runtime.contract.IngestBatch``)::

    {"run": "...", "attempt": 0, "role": "trainer-0",
     "points": [{"seq": 7, "step": 12, "time": 1732960000.1, "metrics": {"reward/mean": 0.5}}],
     "events": [{"seq": 8, "time": ..., "kind": "checkpoint", "payload": {...}}]}

A record the platform would refuse (a metric name over the length limit, an
event kind too long, ...) is refused by ``report`` / ``event`` with a
ReporterError instead of being spooled: in the spool it would hold up every
record after it, retried for ever.

Any 2xx acknowledges the whole batch; the reply's JSON body (pending commands)
is passed to ``on_reply``. Anything else keeps the batch in the spool.
:class:`JsonPoster` is the one POST of a JSON body with the run token, shared
with the role's heartbeats and command acknowledgements (``runtime.managed.entry``).
Standard library only, besides the contract.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from runtime.contract import (
    CURSOR_FILE,
    METRICS_PATH,
    SPOOL_FILE,
    batch_body,
    end_of_last_line,
    line_start,
    record_problems,
)
from runtime.metrics import ReporterError, clean_metrics, plain_json

REFUSED_STATUSES = (401, 403)  # the token is no good (any more): retrying cannot help


class PostError(Exception):
    """A POST that got no 2xx: ``status`` is the HTTP status, or None when the platform was unreachable."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class JsonPoster:
    """POSTs JSON bodies to one platform with a bearer token; returns the parsed reply.

    Proxies from the environment are not used (the platform is on the cluster network).
    """

    def __init__(self, base_url: str, token: str, timeout_s: float = 10.0):
        if not base_url.startswith(("http://", "https://")):
            raise ReporterError(f"base_url must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def url(self, path: str) -> str:
        return self.base_url + "/" + path.lstrip("/")

    def post(self, path: str, body: Any) -> Any:
        """The reply's JSON (None when the body is empty or not JSON); :class:`PostError` unless 2xx."""
        url = self.url(path)
        request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=self._headers, method="POST")
        try:
            with self._opener.open(request, timeout=self.timeout_s) as resp:
                reply_bytes = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:200].decode(errors="replace")
            raise PostError(f"HTTP {exc.code} from {url}: {detail}", exc.code) from None
        except (urllib.error.URLError, OSError) as exc:
            raise PostError(f"{url} unreachable: {getattr(exc, 'reason', exc)}") from None
        if not reply_bytes.strip():
            return None
        try:
            return json.loads(reply_bytes)
        except json.JSONDecodeError:
            return None


class HttpReporter:
    """A :class:`runtime.metrics.Reporter` that delivers to the platform over HTTP.

    ``run`` and ``attempt`` form the idempotency key with each step; ``role`` names the
    reporting process (its events' ``seq`` numbers are its own). Knobs:
    ``batch_size`` records per POST; ``min_interval_s`` between POSTs (points
    arriving meanwhile share the next batch); back-off from ``backoff_s``
    doubling to ``backoff_max_s`` while the platform fails; ``timeout_s`` per
    request. Proxies from the environment are not used (the platform is on
    the cluster network).
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        spool_dir: str | Path,
        *,
        run: str = "",
        attempt: int = 0,
        role: str = "",
        path: str = METRICS_PATH,
        batch_size: int = 500,
        min_interval_s: float = 1.0,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
        timeout_s: float = 10.0,
        on_reply: Callable[[dict[str, Any]], None] | None = None,
    ):
        self._poster = JsonPoster(base_url, token, timeout_s)  # checks base_url
        if batch_size < 1:
            raise ReporterError(f"batch_size must be >= 1, got {batch_size}")
        if backoff_s <= 0 or backoff_max_s < backoff_s:
            raise ReporterError(f"need 0 < backoff_s <= backoff_max_s, got {backoff_s} and {backoff_max_s}")
        self.path = path
        self.url = self._poster.url(path)
        self.run = str(run)
        self.attempt = int(attempt)
        self.role = str(role)
        self.batch_size = batch_size
        self.min_interval_s = min_interval_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.timeout_s = timeout_s
        self.on_reply = on_reply
        # Jitter from a private generator: the run's global RNG streams must not move.
        self._jitter = random.Random()

        self.spool_dir = Path(spool_dir)
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self._spool_path = self.spool_dir / SPOOL_FILE
        self._cursor_path = self.spool_dir / CURSOR_FILE
        self._cond = threading.Condition()
        self._offset, self._next_seq = self._recover()
        self._spool = open(self._spool_path, "ab")
        self._size = self._spool.tell()

        self.last_error: str | None = None
        self.failures = 0  # consecutive failed POSTs
        # The platform refused the token (401/403): the run ended (its tokens end with it) or the token is
        # not its own. No retry can succeed, so the sender stops and the records stay in the spool, which
        # the platform replays when this role exits.
        self.refused = False
        self.posts = 0  # acknowledged POSTs
        self._closing = False
        self._wake = False
        self._thread = threading.Thread(target=self._sender, name="http-reporter", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ Reporter

    def report(self, step: int, metrics: Mapping[str, float]) -> None:
        self._append({"step": int(step), "time": time.time(), "metrics": clean_metrics(metrics)})

    def event(self, kind: str, payload: Mapping[str, Any]) -> None:
        self._append({"kind": str(kind), "time": time.time(), "payload": plain_json(payload)})

    def flush(self, timeout: float = 10.0) -> bool:
        """Ask the sender to deliver everything now; True when the spool is fully delivered in time."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._wake = True
            self._cond.notify_all()
            while self._offset < self._size:
                left = deadline - time.monotonic()
                if left <= 0 or self.refused or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
            # Everything is delivered: the wake-up is spent. Left set, it would cut the sender's next pause
            # short and send the next record at once, ignoring min_interval_s.
            self._wake = False
            return True

    def close(self, timeout: float = 10.0) -> None:
        """Deliver what can be delivered within ``timeout``, then stop. Undelivered records stay in
        the spool and are replayed by the next reporter on the same ``spool_dir``."""
        if self._closing:
            return
        delivered = self.flush(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        self._spool.close()
        if not delivered:
            print(
                f"http reporter: {self.pending()} record(s) not delivered yet ({self.last_error}); "
                f"kept in {self._spool_path} for replay",
                file=sys.stderr,
            )

    def pending(self) -> int:
        """Records in the spool not yet acknowledged by the platform."""
        with self._cond:
            return self._count_lines(self._offset, self._size)

    # ------------------------------------------------------------------ spool

    def _append(self, record: dict[str, Any]) -> None:
        with self._cond:
            if self._closing:
                raise ReporterError("the HTTP reporter is closed")
            record = {"seq": self._next_seq, **record}
            problems = record_problems(record)
            if problems:
                named = "; ".join(f"{p['field']}: {p['message']}" for p in problems)
                raise ReporterError(f"the platform would refuse this record ({named}): {json.dumps(record)[:200]}")
            line = json.dumps(record, allow_nan=False).encode() + b"\n"
            self._spool.write(line)
            self._spool.flush()
            os.fsync(self._spool.fileno())
            self._next_seq += 1
            self._size += len(line)
            self._cond.notify_all()

    def _recover(self) -> tuple[int, int]:
        """Delivered offset and next sequence number from what an earlier reporter left."""
        offset, next_seq = 0, 0
        if self._cursor_path.exists():
            try:
                cursor = json.loads(self._cursor_path.read_text())
                offset, next_seq = int(cursor["offset"]), int(cursor["next_seq"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ReporterError(f"{self._cursor_path}: unreadable spool cursor ({exc})") from None
        size = 0
        if self._spool_path.exists():
            # Drop a line torn by a crash mid-append: it was never acknowledged to the caller.
            size = end_of_last_line(self._spool_path)
            with open(self._spool_path, "r+b") as fh:
                fh.truncate(size)
        if offset > size:
            offset = 0  # the spool was replaced or cut; resending is safe (idempotent keys), skipping is not
        last = self._last_seq(size)
        if last is not None:
            next_seq = max(next_seq, last + 1)
        self._write_cursor(offset, next_seq)
        return offset, next_seq

    def _last_seq(self, size: int) -> int | None:
        if size == 0:
            return None
        with open(self._spool_path, "rb") as fh:
            fh.seek(0)
            start = line_start(fh, size - 1)
            fh.seek(start)
            return int(json.loads(fh.read(size - start))["seq"])

    def _write_cursor(self, offset: int, next_seq: int) -> None:
        tmp = self._cursor_path.with_suffix(".tmp")
        with open(tmp, "w") as fh:
            json.dump({"offset": offset, "next_seq": next_seq}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self._cursor_path)

    def _count_lines(self, start: int, end: int) -> int:
        if end <= start:
            return 0
        with open(self._spool_path, "rb") as fh:
            fh.seek(start)
            return fh.read(end - start).count(b"\n")

    def _read_batch(self) -> tuple[list[dict[str, Any]], int]:
        """Up to ``batch_size`` undelivered records and the offset after them."""
        records: list[dict[str, Any]] = []
        with open(self._spool_path, "rb") as fh:
            fh.seek(self._offset)
            pos = self._offset
            while len(records) < self.batch_size and pos < self._size:
                line = fh.readline()
                if not line.endswith(b"\n"):
                    break
                pos += len(line)
                records.append(json.loads(line))
        return records, pos

    def _commit(self, offset: int) -> None:
        """Persist the delivered offset; empty the spool when everything is delivered."""
        with self._cond:
            if offset == self._size and self._size > 0:
                # Cursor first, then truncate: a crash in between replays delivered records
                # (deduplicated by their keys) but never reuses a sequence number.
                self._write_cursor(0, self._next_seq)
                self._spool.truncate(0)
                self._spool.flush()
                os.fsync(self._spool.fileno())
                self._size = offset = 0
            else:
                self._write_cursor(offset, self._next_seq)
            self._offset = offset
            if offset >= self._size:
                # Everything is delivered: a flush's wake-up is spent here, under the lock, before the sender
                # decides on its pause. Left for flush() to clear after it wakes, the sender could see it
                # first, skip min_interval_s and send the next record at once.
                self._wake = False
            self._cond.notify_all()

    # ------------------------------------------------------------------ sending

    def _sender(self) -> None:
        while True:
            with self._cond:
                while not self._closing and self._offset >= self._size:
                    self._cond.wait()
                if self._closing:
                    return
                self._wake = False
            try:
                ok = self._send_one_batch()
            except Exception as exc:  # never let the thread die: records would stop moving
                self.last_error = f"{type(exc).__name__}: {exc}"
                ok = False
            if self.refused:
                with self._cond:
                    self._cond.notify_all()  # a waiting flush() sees the sender gone and returns at once
                return
            if ok:
                self.failures = 0
                pause = self.min_interval_s
            else:
                self.failures += 1
                base = min(self.backoff_max_s, self.backoff_s * 2 ** (self.failures - 1))
                pause = base * (0.8 + 0.4 * self._jitter.random())
            with self._cond:
                # Wait out the pause unless closing; a flush() cuts a post-success pause short.
                deadline = time.monotonic() + pause
                while not self._closing and not (ok and self._wake):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)

    def _send_one_batch(self) -> bool:
        with self._cond:
            records, end = self._read_batch()
        if not records:
            return True
        body = batch_body(records, self.run, self.attempt, self.role)
        try:
            reply = self._poster.post(self.path, body)
        except PostError as exc:
            self.last_error = str(exc)
            self.refused = exc.status in REFUSED_STATUSES
            return False
        self._commit(end)
        self.posts += 1
        self.last_error = None
        if self.on_reply is not None and isinstance(reply, dict):
            self.on_reply(reply)
        return True
