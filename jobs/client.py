"""Command-line client for CI: submit runs, wait for them, cancel, list.

It speaks only Tandem's HTTP API (standard-library ``urllib``), so it imports
without Django and runs anywhere Python 3.11 does::

    python -m jobs.client submit spec.yaml --experiment NAME --submission-id "$CI_JOB_ID" --wait
    python -m jobs.client status 42
    python -m jobs.client wait 42 --timeout 600
    python -m jobs.client cancel 42
    python -m jobs.client list --experiment NAME --state QUEUED

The server URL comes from ``--url`` or ``TANDEM_URL`` (default
``http://127.0.0.1:8000``), the API token from ``--token`` or ``TANDEM_TOKEN``.

Exit codes (``--wait`` and ``wait`` exit 0 only when the run COMPLETED, so a
stopped run can never pass a CI job by accident):

     0  success; for --wait / wait: the run COMPLETED
     1  other error (server error, unexpected reply)
     2  bad command line, unreadable spec file
     3  the server rejected the input (HTTP 400); field errors are printed
     4  missing, unknown, expired or revoked token (401), or role not allowed (403)
     5  no such run or experiment visible to this token (404)
     6  illegal state transition, e.g. cancelling a finished run (409)
     7  the server could not be reached
    10  the run ended FAILED
    11  the run ended CANCELLED
    12  the run ended PREEMPTED
    13  --timeout passed before the run reached a terminal state
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, TextIO

EXIT_OK = 0  # command succeeded; for --wait/wait: the run COMPLETED
EXIT_ERROR = 1  # any other error (server error, unexpected reply)
EXIT_USAGE = 2  # bad command line (argparse), unreadable spec file
EXIT_REJECTED = 3  # the server rejected the input (HTTP 400): field errors are printed
EXIT_AUTH = 4  # missing, bad, expired or revoked token (HTTP 401), or not allowed (HTTP 403)
EXIT_NOT_FOUND = 5  # no such run or experiment visible to this token (HTTP 404)
EXIT_CONFLICT = 6  # illegal state transition, e.g. cancelling a finished run (HTTP 409)
EXIT_CONNECTION = 7  # the server could not be reached
EXIT_FAILED = 10  # the run ended FAILED
EXIT_CANCELLED = 11  # the run ended CANCELLED
EXIT_PREEMPTED = 12  # the run ended PREEMPTED
EXIT_TIMEOUT = 13  # --timeout passed before the run reached a terminal state

TERMINAL_EXIT = {
    "COMPLETED": EXIT_OK,
    "FAILED": EXIT_FAILED,
    "CANCELLED": EXIT_CANCELLED,
    "PREEMPTED": EXIT_PREEMPTED,
}

DEFAULT_URL = "http://127.0.0.1:8000"
# One long-poll request never asks the server for more than this; the client
# loops until its own --timeout, so proxies with short idle limits are fine.
POLL_CHUNK_S = 60.0


class ClientError(Exception):
    """A request failed; ``exit_code`` says how the CLI should exit."""

    def __init__(self, message: str, exit_code: int, status: int | None = None, body: Any = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.status = status
        self.body = body


_STATUS_EXIT = {400: EXIT_REJECTED, 401: EXIT_AUTH, 403: EXIT_AUTH, 404: EXIT_NOT_FOUND, 409: EXIT_CONFLICT}


# The field of an error about the request as a whole (401, 403, 404, 409, ...): printed as the message alone.
WHOLE_REQUEST = "request"


def format_error_body(body: Any) -> str:
    """Render an API error body (``{"errors": [{"field", "message"}, ...]}``) as readable lines, one per error."""
    if isinstance(body, dict) and isinstance(body.get("errors"), list):
        lines = []
        for err in body["errors"]:
            if not isinstance(err, dict):
                lines.append(f"  {err}")
            elif err.get("field") == WHOLE_REQUEST:
                lines.append(f"  {err.get('message', '')}")
            else:
                lines.append(f"  {err.get('field', '?')}: {err.get('message', '')}")
        return "\n".join(lines)
    if isinstance(body, dict) and "detail" in body:  # a server from before every error had the errors shape
        return f"  {body['detail']}"
    if isinstance(body, dict | list):
        return "  " + json.dumps(body)
    return f"  {str(body)[:500]}"


class TandemClient:
    """Thin wrapper over the REST API; every method returns decoded JSON."""

    def __init__(self, url: str, token: str | None, request_timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.token = token
        self.request_timeout = request_timeout

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> tuple[int, Any]:
        url = f"{self.url}{path}"
        if query:
            url += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.request_timeout) as resp:
                return resp.status, _decode(resp.read())
        except urllib.error.HTTPError as exc:
            payload = _decode(exc.read())
            code = _STATUS_EXIT.get(exc.code, EXIT_ERROR)
            what = {
                401: "authentication failed (missing, unknown, expired or revoked token)",
                403: "not allowed (your role in this team cannot do that)",
                404: "not found",
                409: "conflict",
                400: "rejected",
            }.get(exc.code, "server error")
            raise ClientError(
                f"HTTP {exc.code} {what}:\n{format_error_body(payload)}", code, exc.code, payload
            ) from None
        except urllib.error.URLError as exc:
            raise ClientError(f"cannot reach {self.url}: {exc.reason}", EXIT_CONNECTION) from None
        except (TimeoutError, ConnectionError) as exc:
            raise ClientError(f"cannot reach {self.url}: {exc}", EXIT_CONNECTION) from None

    def submit(
        self, experiment: str, spec_text: str, submission_id: str | None = None, priority: int | None = None
    ) -> tuple[bool, dict]:
        """Submit a run; returns (created, run). ``created`` is False when the
        server returned an earlier run with the same submission id."""
        body: dict[str, Any] = {"experiment": experiment, "spec": spec_text}
        if submission_id:
            body["submission_id"] = submission_id
        if priority is not None:
            body["priority"] = priority
        status, run = self.request("POST", "/api/runs/", body)
        return status == 201, run

    def status(self, run_id: int) -> dict:
        return self.request("GET", f"/api/runs/{run_id}/")[1]

    def cancel(self, run_id: int) -> dict:
        return self.request("POST", f"/api/runs/{run_id}/cancel/")[1]

    def list_runs(self, experiment: str | None = None, state: str | None = None, limit: int = 50) -> dict:
        query = {"experiment": experiment, "state": state, "page_size": limit}
        return self.request("GET", "/api/runs/", query=query)[1]

    def wait(self, run_id: int, timeout: float | None = None) -> dict:
        """Long-poll until the run is terminal or ``timeout`` seconds pass
        (``None``: no limit); returns the last run seen."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = POLL_CHUNK_S if deadline is None else max(0.0, deadline - time.monotonic())
            chunk = min(POLL_CHUNK_S, remaining)
            run = self.request(
                "GET", f"/api/runs/{run_id}/wait/", query={"timeout": f"{chunk:.1f}"}, timeout=chunk + 30
            )[1]
            if run.get("terminal") or (deadline is not None and time.monotonic() >= deadline):
                return run


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw.decode() or "null")
    except (UnicodeDecodeError, json.JSONDecodeError):
        return raw.decode(errors="replace")


def _run_line(run: dict) -> str:
    line = f"run {run.get('id')}  {run.get('state')}"
    if run.get("experiment_name"):
        line += f"  experiment={run['experiment_name']}"
    if run.get("queue_position") is not None:
        line += f"  queue_position={run['queue_position']}"
    if run.get("reason"):
        line += f"  reason: {run['reason']}"
    return line


def _finish_wait(run: dict, out: TextIO) -> int:
    print(_run_line(run), file=out)
    if not run.get("terminal"):
        print(f"timed out waiting for run {run.get('id')} (still {run.get('state')})", file=out)
        return EXIT_TIMEOUT
    return TERMINAL_EXIT.get(run.get("state", ""), EXIT_ERROR)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jobs.client",
        description="Tandem CLI for CI.",
        epilog=__doc__[__doc__.index("Exit codes") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", default=os.environ.get("TANDEM_URL", DEFAULT_URL), help="server URL (env TANDEM_URL)")
    parser.add_argument("--token", default=os.environ.get("TANDEM_TOKEN"), help="API token (env TANDEM_TOKEN)")
    parser.add_argument("--json", action="store_true", help="print the server's JSON instead of a summary line")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("submit", help="submit a run spec (YAML or JSON file, '-' for stdin)")
    p.add_argument("spec", help="spec file")
    p.add_argument("--experiment", required=True, help="experiment name (or id)")
    p.add_argument("--submission-id", help="idempotency key: a retry with the same id returns the same run")
    p.add_argument("--priority", type=int, help="run priority (higher first)")
    p.add_argument("--wait", action="store_true", help="wait for a terminal state; exit code tells which")
    p.add_argument("--timeout", type=float, help="seconds to wait at most (default: no limit)")

    for name, help_text in (("status", "show a run"), ("cancel", "cancel a run")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("run", type=int)

    p = sub.add_parser("wait", help="wait for a run to reach a terminal state")
    p.add_argument("run", type=int)
    p.add_argument("--timeout", type=float, help="seconds to wait at most (default: no limit)")

    p = sub.add_parser("list", help="list runs")
    p.add_argument("--experiment", help="only runs of this experiment (name or id)")
    p.add_argument("--state", help="only runs in this state, e.g. QUEUED")
    p.add_argument("--limit", type=int, default=50, help="most runs shown (default 50)")
    return parser


def main(argv: list[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    args = build_parser().parse_args(argv)
    client = TandemClient(args.url, args.token)
    show = (lambda data: print(json.dumps(data, indent=2), file=out)) if args.json else None
    try:
        if args.command == "submit":
            try:
                text = sys.stdin.read() if args.spec == "-" else Path(args.spec).read_text()
            except OSError as exc:
                print(f"cannot read spec file {args.spec}: {exc.strerror}", file=err)
                return EXIT_USAGE
            created, run = client.submit(args.experiment, text, args.submission_id, args.priority)
            if show:
                show(run)
            else:
                print(
                    ("submitted " if created else "already submitted (same submission id) ") + _run_line(run), file=out
                )
            if args.wait:
                return _finish_wait(client.wait(run["id"], args.timeout), out)
            return EXIT_OK
        if args.command == "wait":
            return _finish_wait(client.wait(args.run, args.timeout), out)
        if args.command == "status":
            run = client.status(args.run)
            show(run) if show else print(_run_line(run), file=out)
            return EXIT_OK
        if args.command == "cancel":
            run = client.cancel(args.run)
            show(run) if show else print("cancelled " + _run_line(run), file=out)
            return EXIT_OK
        if args.command == "list":
            page = client.list_runs(args.experiment, args.state, args.limit)
            if show:
                show(page)
            else:
                for run in page.get("results", []):
                    print(_run_line(run), file=out)
                print(f"({len(page.get('results', []))} of {page.get('count', 0)} runs)", file=out)
            return EXIT_OK
    except ClientError as exc:
        print(f"error: {exc}", file=err)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    return EXIT_USAGE  # unreachable: argparse requires a command


if __name__ == "__main__":
    sys.exit(main())
