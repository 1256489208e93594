"""What the runtime and the platform agree on, written down once.

A platform-managed run crosses the boundary between the two halves in a few
places: the role processes the platform launches (their names, the environment
they read, the exit codes they end with), the files they leave in the run
directory for the platform to read (the rollout endpoint, the reporter's
spool), the ingest API they report to, and the commands that ride back on its
replies. Each of those facts lives here and both halves import it: ``jobs``
imports only this module and ``runtime.spec`` from the runtime.

Standard library only (and no import of another runtime module), so the
platform's web processes import it without torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# --- role processes ------------------------------------------------------------------------------------

# The platform's names for a run's role processes (RunRole.name, the TANDEM_ROLE variable).
TRAINER_ROLE = "trainer-0"  # the leader: it runs the pipeline, reports, and takes the run's commands
TRAINER_PREFIX = "trainer-"  # + index: trainer-0, then the trainer ranks on further hosts
ROLLOUT_PREFIX = "rollout-"  # + index: the remote rollout roles (resources.rollout_hosts)
EVALUATOR_ROLE = "evaluator"  # the remote evaluator (resources.remote_evaluator)
MAX_ROLE_NAME = 100  # characters; the platform's column holds no more

# ``python -m runtime role <kind>``: what each platform role process runs.
ROLE_KINDS = ("trainer", "trainer-ranks", "rollout", "evaluator")

# How a runtime process ends; the platform decides from the code what happens next.
EXIT_OK = 0
EXIT_FAILED = 1  # the run failed while working (a restart may help)
EXIT_BAD_INPUT = 2  # bad input found before any work started: a restart cannot help
EXIT_NO_TRAINER = 3  # a rollout role found no trainer to serve for pipeline.rollout_reconnect_s

# The environment a role process reads (the token never travels on a command line).
ENV_PLATFORM_URL = "TANDEM_PLATFORM_URL"
ENV_RUN_TOKEN = "TANDEM_RUN_TOKEN"
ENV_RUN_ID = "TANDEM_RUN_ID"
ENV_ATTEMPT = "TANDEM_ATTEMPT"
ENV_ROLE = "TANDEM_ROLE"
ENV_HOST_NAME = "TANDEM_HOST_NAME"
ENV_HEARTBEAT_S = "TANDEM_HEARTBEAT_S"
ENV_HOST_ADDRESS = "TANDEM_HOST_ADDRESS"  # the address the trainer advertises to rollout roles
ENV_ROLLOUT_KEY = "TANDEM_ROLLOUT_KEY"  # the run's shared secret on the trainer <-> rollout link
ENV_RANKS = "TANDEM_RANKS"  # the global trainer ranks a trainer-ranks role runs
ENV_LOCAL_RANKS = "TANDEM_LOCAL_RANKS"  # the leader's own ranks when the group spans hosts

# --- the run directory -----------------------------------------------------------------------------------

ENDPOINT_FILE = "rollout-endpoint.json"  # where the trainer tells rollout roles its address
COMMANDS_FILE = "commands.jsonl"  # command ids a role has acted on (each is acted on once)
SPOOL_DIR = "spool"  # <workdir>/spool/attempt-<n>/: what an attempt's reporter has not delivered yet
SPOOL_FILE = "spool.jsonl"  # records, one JSON object a line, in the order they were reported
CURSOR_FILE = "cursor.json"  # {"offset": bytes of the spool acknowledged by the platform}
TOKEN_FILE = "token"  # the run token the spool was written with (mode 0600)


def spool_dir(workdir: Path, attempt: int) -> Path:
    return Path(workdir) / SPOOL_DIR / f"attempt-{attempt}"


def line_start(fh: Any, pos: int) -> int:
    """Offset just after the last newline before byte ``pos`` of a binary file (0 if none)."""
    while pos > 0:
        step = min(4096, pos)
        fh.seek(pos - step)
        chunk = fh.read(step)
        idx = chunk.rfind(b"\n")
        if idx >= 0:
            return pos - step + idx + 1
        pos -= step
    return 0


def end_of_last_line(path: Path) -> int:
    """Offset just after the last newline of ``path`` (0 if none): a torn last line is not a record."""
    with open(path, "rb") as fh:
        return line_start(fh, fh.seek(0, os.SEEK_END))


def undelivered(directory: str | Path) -> list[dict[str, Any]]:
    """What a reporter's spool still holds undelivered, read only (nothing moves): for a supervisor that
    replays the spool of a process that ended while the platform was unreachable."""
    spool, cursor = Path(directory) / SPOOL_FILE, Path(directory) / CURSOR_FILE
    if not spool.exists():
        return []
    try:
        offset = int(json.loads(cursor.read_text())["offset"]) if cursor.exists() else 0
    except (ValueError, KeyError, TypeError):
        offset = 0  # resending is safe (idempotent keys), skipping is not
    size = end_of_last_line(spool)
    if offset > size:
        offset = 0
    with open(spool, "rb") as fh:
        fh.seek(offset)
        return [json.loads(line) for line in fh.read(size - offset).splitlines() if line.strip()]


# --- the ingest API --------------------------------------------------------------------------------------

METRICS_PATH = "/api/ingest/metrics"
HEARTBEAT_PATH = "/api/ingest/heartbeat"
COMMAND_RESULT_PATH = "/api/ingest/command_result"


def batch_body(records: list[dict[str, Any]], run: str, attempt: int, role: str) -> dict[str, Any]:
    """The ingest body for spooled ``records`` (points carry ``step``, events ``kind``)."""
    return {
        "run": run,
        "attempt": attempt,
        "role": role,
        "points": [r for r in records if "step" in r],
        "events": [r for r in records if "kind" in r],
    }


# --- commands --------------------------------------------------------------------------------------------

# What the runtime acts on. The platform's own kinds add ``fork`` (a new run; the runtime never sees it).
RUNTIME_COMMANDS = ("pause", "resume", "stop", "preempt", "cancel", "rollback", "set_params")

# What a run may change between two steps without a restart (``set_params``).
LIVE_PARAMS = ("pipeline.max_policy_lag", "pipeline.eval_interval", "trainer.lr")


def live_param_problems(params: Any) -> list[dict[str, str]]:
    """Field errors of a ``set_params`` command's ``params`` (each field named from the command's ``args``):
    not a non-empty mapping, or names outside LIVE_PARAMS. The values are each side's to check against
    the spec (the platform validates the run's spec with them in place, the runtime its live spec)."""
    if not isinstance(params, dict) or not params:
        return [{"field": "params", "message": f"give at least one of {', '.join(LIVE_PARAMS)}"}]
    allowed = ", ".join(LIVE_PARAMS)
    return [
        {"field": f"params.{key}", "message": f"not a live parameter; allowed: {allowed}"}
        for key in params
        if key not in LIVE_PARAMS
    ]
