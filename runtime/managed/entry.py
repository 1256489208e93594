"""The trainer role of a platform-managed run: ``python -m runtime role trainer --spec F --workdir D``.

Wiring only (docs/runtime-role.md; the contract is the platform's launcher's):
the environment names the platform, the run, the attempt and its token; the
pipeline (``runtime.pipeline.run``) does the work, reporting to a JSONL file
in the workdir and to the platform's ingest API (``HttpReporter``). Around it
this module runs

* a heartbeat thread: status and ``Control.status()`` to ``/api/ingest/heartbeat``;
* the command desk (``runtime.managed.command_desk``): commands riding on any ingest
  reply become :class:`runtime.control.Directive` s, each command id acted on
  once (persisted in ``<workdir>/commands.jsonl``), and their results are
  acknowledged to ``/api/ingest/command_result`` from a thread of their own;
* before the attempt reports anything, the spools earlier attempts left undelivered
  are drained with their own tokens.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.contract import (
    CHECKPOINT_DIR,
    COMMANDS_FILE,
    ENDPOINT_FILE,
    ENV_ATTEMPT,
    ENV_HEARTBEAT_S,
    ENV_HOST_NAME,
    ENV_PLATFORM_URL,
    ENV_RANKS,
    ENV_ROLE,
    ENV_RUN_ID,
    ENV_RUN_TOKEN,
    HEARTBEAT_PATH,
    MAX_ROLE_NAME,
    OUTCOME_COMPLETED,
    OUTCOME_PREEMPTED,
    ROLE_KINDS,
    SPOOL_DIR,
    SPOOL_FILE,
    TOKEN_FILE,
    TRAINER_ROLE,
    spool_dir,
)
from runtime.control import Directive
from runtime.managed.command_desk import Acknowledger, CommandDesk, CommandLog, RoleControl, RoleInputError
from runtime.managed.command_desk import role_log as _log
from runtime.managed.reporter import HttpReporter, JsonPoster, PostError
from runtime.spec import RunSpec, check_http_url, parse_spec_text, validate_spec

DEFAULT_HEARTBEAT_S = 5.0
DRAIN_S = 60.0  # at most this long for older attempts' spools before the new attempt reports
ACK_DRAIN_S = 30.0  # at most this long for acknowledgements still owed when the run has ended
TERM_GRACE_S = 30.0  # after SIGTERM, cleanup gets this long before the process exits regardless


# ---------------------------------------------------------------------------------- input


@dataclass(frozen=True)
class RoleArgs:
    role: str
    spec: Path
    workdir: Path
    resume: str  # auto | never


@dataclass(frozen=True)
class RoleEnv:
    platform_url: str
    token: str
    run_id: str
    attempt: int
    role: str
    host: str
    heartbeat_s: float


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # One line naming the argument, not argparse's usage block.
        raise RoleInputError(message)


def parse_args(argv: list[str]) -> RoleArgs:
    parser = _Parser(prog="python -m runtime role", allow_abbrev=False, description="run one role of a platform run")
    parser.add_argument(
        "role",
        help="the role to run: trainer, trainer-ranks (its ranks on a further host), rollout or evaluator (remote)",
    )
    parser.add_argument("--spec", required=True, help="the run's resolved spec (YAML)")
    parser.add_argument("--workdir", required=True, help="checkpoints, metrics, spools and commands.jsonl go here")
    parser.add_argument(
        "--resume", choices=("auto", "never"), default="auto", help="continue from the newest checkpoint"
    )
    ns = parser.parse_args(argv)
    if ns.role not in ROLE_KINDS:
        raise RoleInputError(f"role: {ns.role!r} is not one of {', '.join(ROLE_KINDS)}")
    workdir = Path(ns.workdir).resolve()
    if workdir.exists() and not workdir.is_dir():
        raise RoleInputError(f"--workdir: {workdir} is not a directory")
    return RoleArgs(ns.role, Path(ns.spec), workdir, ns.resume)


def read_env(environ: Mapping[str, str]) -> RoleEnv:
    """The role's settings from ``TANDEM_*`` variables (the token never travels on the command line)."""

    def required(name: str) -> str:
        value = environ.get(name, "").strip()
        if not value:
            raise RoleInputError(f"{name}: required")
        return value

    url = required(ENV_PLATFORM_URL)
    try:
        check_http_url(url)
    except ValueError as exc:
        raise RoleInputError(f"{ENV_PLATFORM_URL}: {exc}") from None
    token = required(ENV_RUN_TOKEN)
    run_id = required(ENV_RUN_ID)
    attempt_text = required(ENV_ATTEMPT)
    try:
        attempt = int(attempt_text)
    except ValueError:
        attempt = -1
    if attempt < 0:
        raise RoleInputError(f"{ENV_ATTEMPT}: must be an integer >= 0, got {attempt_text!r}")
    role = environ.get(ENV_ROLE, "").strip() or TRAINER_ROLE
    if len(role) > MAX_ROLE_NAME:
        raise RoleInputError(f"{ENV_ROLE}: at most {MAX_ROLE_NAME} characters")
    host = environ.get(ENV_HOST_NAME, "").strip() or socket.gethostname()
    period_text = environ.get(ENV_HEARTBEAT_S, "").strip()
    try:
        period = float(period_text) if period_text else DEFAULT_HEARTBEAT_S
    except ValueError:
        period = -1.0
    if not (math.isfinite(period) and period > 0):
        raise RoleInputError(f"{ENV_HEARTBEAT_S}: must be a number of seconds > 0, got {period_text!r}")
    return RoleEnv(url.rstrip("/"), token, run_id, attempt, role, host, period)


def load_role_spec(path: Path, workdir: Path) -> RunSpec:
    """The run's spec with ``output_dir`` = the workdir and no progress bar (the role's output is a log)."""
    if not path.is_file():
        raise RoleInputError(f"--spec: no such file: {path}")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise RoleInputError(f"--spec: cannot read {path}: {exc}") from None
    data = parse_spec_text(text)
    data["output_dir"] = str(workdir).replace("{", "{{").replace("}", "}}")  # output_dir is a format string
    metrics = data.setdefault("metrics", {})
    if isinstance(metrics, dict):  # anything else is refused by validation, naming `metrics`
        metrics["progress_bar"] = False
    return validate_spec(data)


def find_resume(workdir: Path) -> Path | None:
    """The newest checkpoint under ``<workdir>/checkpoints`` that verifies (an older one if it is damaged)."""
    from runtime.checkpoint import CheckpointError, CheckpointManager, verify_checkpoint

    for info in reversed(CheckpointManager(workdir / CHECKPOINT_DIR).list()):
        try:
            verify_checkpoint(info.path)
        except CheckpointError as exc:
            _log(f"skipping a damaged checkpoint: {exc}")
            continue
        return info.path
    return None


# ---------------------------------------------------------------------------------- heartbeat


class Heartbeat:
    """``POST /api/ingest/heartbeat`` every ``period_s`` from a thread, and at once for every status change
    (in order, so the platform sees a pause even when it lasts less than a period). A failed heartbeat is
    retried next period."""

    def __init__(
        self,
        poster: JsonPoster,
        period_s: float,
        body: Callable[[str | None], dict[str, Any]],
        on_reply: Callable[[dict[str, Any]], None],
    ):
        self._poster = poster
        self.period_s = period_s
        self._body = body  # body(status): that status, or the current one when None
        self._on_reply = on_reply
        self._lock = threading.Lock()
        self._changes: deque[str] = deque()
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="role-heartbeat", daemon=True)
        self._last_error: str | None = None

    def beat(self, status: str | None = None) -> bool:
        """One heartbeat (``status``, or the current one); False when it failed. Never raises."""
        try:
            reply = self._poster.post(HEARTBEAT_PATH, self._body(status))
            if isinstance(reply, dict):
                self._on_reply(reply)
        except Exception as exc:  # PostError, or anything else: a heartbeat is never fatal
            error = f"{exc}" if isinstance(exc, PostError) else f"{type(exc).__name__}: {exc}"
            if error != self._last_error:  # log changes, not every period of an outage
                _log(f"heartbeat failed (retried every {self.period_s:g} s): {error}")
                self._last_error = error
            return False
        if self._last_error is not None:
            _log("heartbeat delivered again")
            self._last_error = None
        return True

    def changed(self, status: str) -> None:
        with self._lock:
            self._changes.append(status)
        self._wake.set()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread, then send the status changes it had not sent yet."""
        self._stopped = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        self._send_changes()

    def _send_changes(self) -> bool:
        with self._lock:
            changes = list(self._changes)
            self._changes.clear()
        for status in changes:
            self.beat(status)
        return bool(changes)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.period_s)
            self._wake.clear()
            if self._stopped:
                return
            if not self._send_changes():
                self.beat()


# ---------------------------------------------------------------------------------- spools


def save_token(directory: Path, token: str) -> None:
    """``<spool>/token``, mode 0600: a later attempt drains this spool with the token it was written for."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        os.fchmod(fh.fileno(), 0o600)  # an existing file keeps its mode through O_CREAT
        fh.write(token)


def drain_older_spools(env: RoleEnv, workdir: Path, on_reply: Callable[[dict[str, Any]], None]) -> None:
    """Deliver what earlier attempts left in their spools, each with its own token, for at most ``DRAIN_S``."""
    deadline = time.monotonic() + DRAIN_S
    older = []
    for path in (workdir / SPOOL_DIR).glob("attempt-*"):
        match = re.fullmatch(r"attempt-(\d+)", path.name)
        if match and int(match.group(1)) < env.attempt and (path / SPOOL_FILE).is_file():
            older.append((int(match.group(1)), path))
    for attempt, path in sorted(older):
        token_file = path / TOKEN_FILE
        if not token_file.is_file():
            _log(f"{path}: no token file; its undelivered records stay there")
            continue
        reporter = HttpReporter(
            env.platform_url,
            token_file.read_text().strip(),
            path,
            run=env.run_id,
            attempt=attempt,
            role=env.role,
            min_interval_s=0.0,
            backoff_max_s=2.0,
            on_reply=on_reply,
        )
        left = reporter.pending()
        while reporter.pending() and time.monotonic() < deadline:
            if reporter.flush(timeout=min(1.0, max(0.0, deadline - time.monotonic()))):
                break
            if (reporter.last_error or "").startswith(("HTTP 401", "HTTP 403")):
                break  # that token no longer writes: waiting cannot help
        if left:
            _log(f"attempt {attempt}: delivered {left - reporter.pending()} of {left} spooled record(s)")
        reporter.close(timeout=0.0)


# ---------------------------------------------------------------------------------- the role


class TrainerRole:
    """One attempt of the trainer: the pipeline with heartbeats, commands and reporting to the platform."""

    def __init__(self, spec: RunSpec, env: RoleEnv, workdir: Path, resume: Path | None):
        self.spec, self.env, self.workdir, self.resume = spec, env, workdir, resume
        self.poster = JsonPoster(env.platform_url, env.token)
        self.http: HttpReporter | None = None
        self.final_status: str | None = None
        self.terminating = False
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = CommandLog(workdir / COMMANDS_FILE)
        self.acks = Acknowledger(self.poster, self._on_reply, self._flush)
        self.control = RoleControl(self._finished, self._status_changed)
        self.desk = CommandDesk(self.control, self.log, self.acks)
        self.heartbeat = Heartbeat(self.poster, env.heartbeat_s, self._heartbeat_body, self._on_reply)

    # callbacks, bound late: the objects refer to each other
    def _on_reply(self, reply: dict[str, Any]) -> None:
        self.desk.receive(reply)

    def _finished(self, directive: Directive, ok: bool, message: str) -> None:
        self.desk.finished(directive, ok, message)

    def _status_changed(self, status: str) -> None:
        self.heartbeat.changed(status)

    def _flush(self, timeout: float) -> bool:
        return self.http is None or self.http.flush(timeout)

    def _heartbeat_body(self, state: str | None) -> dict[str, Any]:
        status = self.control.status()
        if state is not None:
            pass  # a status change of the pipeline, reported as it happened
        elif self.final_status is not None:
            state = self.final_status
        elif self.terminating or self.desk.stopping:
            state = "stopping"
        else:
            state = str(status.get("status", "starting"))
        info = {
            "host": self.env.host,
            "pid": os.getpid(),
            "step": status.get("step"),
            "weight_version": status.get("weight_version"),
            "rollout_pids": [int(p) for p in status.get("rollout_pids") or []],
            "rollout_restarts": int(status.get("rollout_restarts") or 0),
        }
        return {
            "run": self.env.run_id,
            "attempt": self.env.attempt,
            "role": self.env.role,
            "status": state,
            "info": info,
        }

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self.terminating:
            os._exit(128 + signum)
        self.terminating = True
        # Cleanup (rollout processes, reporter) runs in finally blocks; it must not keep the process alive.
        timer = threading.Timer(TERM_GRACE_S, os._exit, args=(128 + signum,))
        timer.daemon = True
        timer.start()
        raise SystemExit(128 + signum)

    def run(self) -> dict[str, Any]:
        from runtime import metrics as M
        from runtime.checkpoint import load_checkpoint
        from runtime.pipeline import run

        main_thread = threading.current_thread() is threading.main_thread()  # signals go to the main thread only
        previous = signal.signal(signal.SIGTERM, self._on_sigterm) if main_thread else None
        reporters = None
        steps: int | None = None
        outcome = OUTCOME_COMPLETED
        try:
            drain_older_spools(self.env, self.workdir, self._on_reply)
            spool = spool_dir(self.workdir, self.env.attempt)
            save_token(spool, self.env.token)
            cursor = None
            if self.resume is not None:  # cut metrics.jsonl back to the checkpoint, as `run --resume` does
                cursor = load_checkpoint(self.resume, keys=["pipeline"])["pipeline"].get("metrics_cursor")
            reporters = M.build_reporters(
                self.spec.metrics,
                self.workdir,
                self.spec.pipeline.steps,
                jsonl_cursor=cursor,
                run_spec=self.spec,
                resumed=self.resume is not None,
            )
            self.http = HttpReporter(
                self.env.platform_url,
                self.env.token,
                spool,
                run=self.env.run_id,
                attempt=self.env.attempt,
                role=self.env.role,
                on_reply=self._on_reply,
            )
            reporters.reporters.append(self.http)
            # The first heartbeat before any work: commands already pending reach the pipeline's first boundary.
            self.heartbeat.beat()
            self.heartbeat.start()
            # The platform owns retention of the run's checkpoints (jobs.checkpoints): it also keeps pinned
            # ones, fork parents and rollback targets, which the runtime cannot see. So the pipeline deletes none.
            result = run(
                self.spec, resume=self.resume, reporters=reporters, control=self.control, rotate_checkpoints=False
            )
            steps = int(result["steps"])
            # "outcome" arrives with the controllable pipeline; a pipeline without it only runs to completion.
            outcome = str(result.get("outcome", OUTCOME_COMPLETED))
            self.final_status = "finished"
        except BaseException:
            self.final_status = "stopping" if self.terminating else "failed"
            raise
        finally:
            self.heartbeat.stop()
            if reporters is not None:
                reporters.close()  # run() closes them too; closing twice is harmless
            over = (
                steps is not None and outcome != OUTCOME_PREEMPTED
            )  # a preempted run is requeued: another attempt follows
            self.desk.end(f"the run ended ({outcome}) at step {steps} before applying this command" if over else None)
            self.heartbeat.beat()  # the final status
            owed = self.acks.close(5.0 if self.terminating else ACK_DRAIN_S)
            if owed:
                _log(f"command result(s) {owed} not acknowledged; the platform redelivers them to the next attempt")
            self.log.close()
            if main_thread:
                signal.signal(signal.SIGTERM, previous)
        return {"outcome": outcome, "steps": steps, "checkpoint": result["checkpoint"]}


def run_trainer(spec: RunSpec, env: RoleEnv, workdir: Path, resume: Path | None) -> dict[str, Any]:
    """Run the trainer role; returns ``{"outcome", "steps", "checkpoint"}``."""
    return TrainerRole(spec, env, workdir, resume).run()


# ---------------------------------------------------------------------------------- roles beside the trainer


def _beside_the_trainer(env: RoleEnv, work: Callable[[Callable[[str], None]], int], spec: RunSpec) -> int:
    """Run ``work(changed)`` -> exit status as a role beside trainer-0 (a remote rollout instance, trainer
    ranks on a further host): it heartbeats its status — ``changed(status)`` reports a change at once —
    and takes no commands (they are trainer-0's: such a role's heartbeat reply carries none). Its device
    telemetry (runtime/telemetry.py) rides on the heartbeat as ``info.telemetry``, the newest sample."""
    from runtime.telemetry import start_for  # loads torch: after the role's input is checked

    status = {"now": "starting"}
    poster = JsonPoster(env.platform_url, env.token)
    telemetry = start_for(spec, env.role)

    def body(state: str | None) -> dict[str, Any]:
        info: dict[str, Any] = {"host": env.host, "pid": os.getpid()}
        if telemetry is not None:
            info["telemetry"] = telemetry.latest()
        return {
            "run": env.run_id,
            "attempt": env.attempt,
            "role": env.role,
            "status": state or status["now"],
            "info": info,
        }

    def changed(now: str) -> None:
        status["now"] = now
        heartbeat.changed(now)

    heartbeat = Heartbeat(poster, env.heartbeat_s, body, lambda reply: None)
    heartbeat.beat()
    heartbeat.start()
    final = "failed"
    try:
        code = work(changed)
        final = "finished" if code == 0 else "failed"
        return code
    finally:
        heartbeat.stop()
        heartbeat.beat(final)
        if telemetry is not None:
            telemetry.stop()


def rollout_index(role: str) -> int:
    """``rollout-<i>`` -> i (which remote rollout instance of the run this role is)."""
    match = re.fullmatch(r"rollout-(\d+)", role)
    if match is None:
        raise RoleInputError(f"{ENV_ROLE}: a rollout role is named rollout-<index>, got {role!r}")
    return int(match.group(1))


def run_rollout(spec: RunSpec, env: RoleEnv, workdir: Path) -> int:
    """One attempt of a remote rollout instance (runtime.rollout.remote) under the platform: it finds the
    trainer through ``<workdir>/rollout-endpoint.json``. Returns the exit status."""
    from runtime.rollout.link import env_key
    from runtime.rollout.remote import RemoteInstance, RolloutRefused

    index = rollout_index(env.role)

    def work(changed: Callable[[str], None]) -> int:
        try:
            instance = RemoteInstance(spec, index, log=_log)
            return instance.serve(workdir / ENDPOINT_FILE, env_key(), changed)
        except RolloutRefused as exc:
            raise RoleInputError(str(exc)) from None

    return _beside_the_trainer(env, work, spec)


def run_evaluator(spec: RunSpec, env: RoleEnv, workdir: Path) -> int:
    """One attempt of the remote evaluator (runtime.evaluation.remote) under the platform: it finds the
    trainer through ``<workdir>/rollout-endpoint.json``. Returns the exit status."""
    from runtime.evaluation.remote import EvaluatorProcess, require_remote
    from runtime.rollout.link import env_key
    from runtime.rollout.remote import RolloutRefused

    try:
        require_remote(spec)  # before any heartbeat: bad input is one line
    except RolloutRefused as exc:
        raise RoleInputError(str(exc)) from None

    def work(changed: Callable[[str], None]) -> int:
        try:
            return EvaluatorProcess(spec, log=_log).serve(workdir / ENDPOINT_FILE, env_key(), changed)
        except RolloutRefused as exc:
            raise RoleInputError(str(exc)) from None

    return _beside_the_trainer(env, work, spec)


def trainer_ranks(spec: RunSpec, environ: Mapping[str, str]) -> range:
    """The ranks a further trainer role runs, from ``TANDEM_RANKS`` (``first-last``, rank 0 excluded)."""
    from runtime.placement import TrainerGroupError, parse_ranks

    text = environ.get(ENV_RANKS, "").strip()
    if not text:
        raise RoleInputError(f"{ENV_RANKS}: required (the trainer ranks this host runs, first-last)")
    try:
        ranks = parse_ranks(text, spec.resources.trainer_devices, ENV_RANKS)
    except TrainerGroupError as exc:
        raise RoleInputError(str(exc)) from None
    if ranks.start == 0:
        raise RoleInputError(f"{ENV_RANKS}: {text!r} includes rank 0, which is trainer-0's")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not environ.get(name, "").strip():
            raise RoleInputError(f"{name}: required (trainer-0's rendezvous)")
    return ranks


def run_trainer_ranks(spec: RunSpec, env: RoleEnv, ranks: range) -> int:
    """One attempt of trainer ranks on a further host (runtime.train.group.serve_ranks): they meet
    trainer-0 at ``MASTER_ADDR`` / ``MASTER_PORT`` and follow it until it stops them (exit 0) or fails."""
    from runtime.pipeline.driver import thread_plan
    from runtime.placement import TrainerGroupError
    from runtime.train.group import serve_ranks

    def work(changed: Callable[[str], None]) -> int:
        changed("running")
        try:
            return serve_ranks(spec, ranks, thread_plan(spec)[0])
        except TrainerGroupError as exc:
            raise RoleInputError(str(exc)) from None

    return _beside_the_trainer(env, work, spec)
