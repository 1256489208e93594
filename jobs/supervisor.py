"""The host side of role processes: start them, watch them, report their end.

``start_role`` (the ``jobs.tasks.start_role`` task on the host's queue ``host.<name>``):

1. claim the role's attempt with a conditional UPDATE pending -> launching, so a
   redelivered or duplicated task (``acks_late``: a worker restart redelivers)
   finds nothing to claim and neither loses nor doubles the role;
2. prepare the run directory, the spec file (``output_dir`` = the run directory)
   and a run token for this attempt (minted here: it never crosses the broker);
3. start ``python -m runtime role trainer`` (``role trainer-ranks`` for a further
   trainer role ``trainer-<h>``, ``role rollout`` for a ``rollout-<i>`` role)
   through jobs/rolewrap.py, detached from this worker, with device visibility,
   the platform URL and the token in its environment (and none of the
   platform's own secrets; trainer ranks over several hosts also get their
   ranks and trainer-0's rendezvous);
4. record its pid and move the run ADMITTED -> STARTING (the runtime's first
   ``running`` heartbeat moves it on to RUNNING, jobs.ingest.handler).

:class:`Supervisor` (a thread of the host agent's worker, every
``TANDEM_SUPERVISE_S``) looks at every role of its host that should be alive. It
reads the state from the database and the role's files, not from memory, so a
restarted worker adopts the roles its predecessor started:

* ``exit_code`` written -> ``jobs.lifecycle.apply.role_exited`` (complete, fail, restart...);
* the process is gone without one -> ``role_exited(None)``;
* another trainer role of its run failed (``stop_requested``: the trainer roles
  restart together), or the run stopped being active (cancelled, stopped, failed) more than
  ``STOP_GRACE_S`` ago (a rollout or evaluator role: ``ROLLOUT_STOP_GRACE_S`` after trainer-0,
  which releases it as it shuts down, exited — it has nothing to save) and the process still lives, or the attempt is left from an
  earlier admission of the run (``jobs.lifecycle.roles.superseded``) -> SIGTERM to its
  process group, SIGKILL ``KILL_GRACE_S`` later;
* the process lives but its runtime has not heartbeated for ``TANDEM_ROLE_HANG_S``
  -> hung: killed and reported, so it restarts from its last checkpoint. A slow
  heartbeat alone never restarts a live process before that: a late reply is
  not a death (the supervisor sees the process itself);
* otherwise its ``supervised_at`` lease is renewed (the role watchdog,
  jobs.tasks.watch_roles, treats a lapsed lease as a host that is gone).
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from django.conf import settings
from django.db import close_old_connections, connection
from django.utils import timezone

from jobs import checkpoints, commands, confinement, handler, launch
from jobs.ingest.tokens import mint_run_token
from jobs.lifecycle import role_states
from jobs.lifecycle.apply import role_exited
from jobs.lifecycle.events import record_event, stream_role
from jobs.lifecycle.files import read_tail, role_dir
from jobs.lifecycle.names import connects_to_trainer, is_rollout, is_trainer
from jobs.lifecycle.roles import placed_roles, resources_of, superseded, trainer_ranks, uses_link
from jobs.models import RoleHeartbeat, Run, RunRole
from jobs.models import RoleState as R
from jobs.states import ACTIVE_STATES, IllegalTransition, RunState
from rlplatform import shutdown
from rlplatform.agent import AgentConfig, on_host_ready
from rlplatform.models import Host
from runtime.contract import (
    ADAPTER_DIR,
    CHECKPOINT_DIR,
    ENV_ATTEMPT,
    ENV_HEARTBEAT_S,
    ENV_HOST_ADDRESS,
    ENV_HOST_NAME,
    ENV_LOCAL_RANKS,
    ENV_PLATFORM_URL,
    ENV_RANKS,
    ENV_ROLE,
    ENV_ROLLOUT_KEY,
    ENV_RUN_ID,
    ENV_RUN_TOKEN,
    EVALUATOR_ROLE,
    EXIT_BAD_INPUT,
    POLICY_DIR,
    TRAINER_ROLE,
)

logger = logging.getLogger(__name__)

ROLEWRAP = Path(__file__).resolve().with_name("rolewrap.py")
STOP_GRACE_S = 30.0  # a run that ended (stop acknowledged, cancelled) gets this long to exit by itself
ROLLOUT_STOP_GRACE_S = 5.0  # ... a rollout role less: it saves nothing, and exits by itself when released
KILL_GRACE_S = 10.0  # between SIGTERM and SIGKILL
# The platform's own secrets and settings never reach a role process.
WITHHELD_ENV_PREFIXES = ("DATABASE_", "REDIS_", "SECRET_KEY", "DJANGO_", "CELERY_", "TANDEM_", "ALLOWED_HOSTS")
VISIBILITY_VARIABLE = {"npu": "ASCEND_RT_VISIBLE_DEVICES", "gpu": "CUDA_VISIBLE_DEVICES"}


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def process_alive(pid: int | None, marker: str) -> bool:
    """Whether ``pid`` is a live (not zombie) process whose command line contains ``marker``
    (a recycled pid belongs to another command line)."""
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    proc = Path(f"/proc/{pid}")
    if not proc.exists():
        return True  # no procfs: trust the signal check
    try:
        if "\nState:\tZ" in (proc / "status").read_text():
            return False
        return marker in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False


# --- start ------------------------------------------------------------------------------------------


def _role_spec(run: Run, role: RunRole) -> dict[str, Any]:
    spec = copy.deepcopy(run.resolved_spec)
    spec["output_dir"] = role.workdir
    # The checkpoint policy travels as the user wrote it: the platform applies it (jobs.checkpoints), and the
    # trainer role's pipeline deletes no checkpoint itself (runtime.managed.entry switches its rotation off).
    # Live parameter changes survive a restart: the new attempt starts with the values in force.
    for dotted, value in commands.effective_params(run).items():
        section, _, name = dotted.partition(".")
        spec.setdefault(section, {})[name] = value
    fork_from = checkpoints.checkpoint_dir_for_path(run.parent_checkpoint) if run.parent_checkpoint else None
    if fork_from is not None and not (Path(role.workdir) / CHECKPOINT_DIR).exists():
        # A fork starts from the parent checkpoint's policy, under its own (edited) spec: an LLM from the
        # checkpoint's HF export, a gym learner from the checkpoint's networks.
        # A LoRA fork of a LoRA run keeps its base and starts from the parent's adapters.
        model = spec.get("model") or {}
        adapter = fork_from / POLICY_DIR / ADAPTER_DIR
        if spec.get("workload") == "gym":
            spec["agent"] = {**spec.get("agent", {}), "init_path": str(fork_from)}
        elif model.get("lora") is not None and adapter.is_dir():
            spec["model"] = {**model, "lora": {**model["lora"], "init_path": str(adapter)}}
        else:
            spec["model"] = {**model, "path": str(fork_from / POLICY_DIR)}
    return spec


def _role_env(run: Run, role: RunRole, token: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(WITHHELD_ENV_PREFIXES)}
    env.update(
        {
            ENV_PLATFORM_URL: settings.TANDEM_PLATFORM_URL,
            ENV_RUN_TOKEN: token,
            ENV_RUN_ID: str(run.pk),
            ENV_ATTEMPT: str(role.attempt),
            ENV_ROLE: role.name,
            ENV_HOST_NAME: role.host.name,
            ENV_HEARTBEAT_S: f"{settings.TANDEM_ROLE_HEARTBEAT_S:g}",
            "MASTER_ADDR": role.host.address or "127.0.0.1",
            "MASTER_PORT": str(29500 + run.pk % 10000),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if is_trainer(role.name):
        env.update(_trainer_group_env(run, role))
    # The trainer advertises this address to the remote rollout roles (its endpoint file).
    env[ENV_HOST_ADDRESS] = role.host.address or role.host.name
    if uses_link(run):
        env[ENV_ROLLOUT_KEY] = rollout_key(run.pk)
    variable = VISIBILITY_VARIABLE.get(role.host.group.kind)
    if variable:
        env[variable] = ",".join(str(i) for i in role.device_indices)
    return env


def _trainer_group_env(run: Run, role: RunRole) -> dict[str, str]:
    """Trainer ranks over several hosts: each trainer role's ranks, and the rendezvous at trainer-0's host."""
    placed = placed_roles(run)
    if isinstance(placed, str) or role.name not in placed:
        return {}
    ranks = trainer_ranks(placed, resources_of(run))
    if len(ranks) < 2:
        return {}  # all of them in trainer-0's process group on its host
    mine = ranks[role.name]
    leader = Host.objects.get(pk=placed[TRAINER_ROLE][0])
    variable = ENV_LOCAL_RANKS if role.name == TRAINER_ROLE else ENV_RANKS
    return {variable: f"{mine.start}-{mine.stop - 1}", "MASTER_ADDR": leader.address or leader.name}


def _trainer_exited_at(run: Run):
    """When trainer-0's latest attempt exited, or None while it lives."""
    return (
        RunRole.objects.filter(run=run, name=TRAINER_ROLE, state=R.EXITED)
        .order_by("-attempt")
        .values_list("exited_at", flat=True)
        .first()
    )


def rollout_key(run_id: int) -> str:
    """The secret the trainer and the rollout roles of a run authenticate each other with: derived from
    the platform's SECRET_KEY, so every host's worker computes the same value and none is stored."""
    return hmac.new(settings.SECRET_KEY.encode(), f"rollout:{run_id}".encode(), hashlib.sha256).hexdigest()


def role_command(spec_path: Path, workdir: str, kind: str = "trainer") -> list[str]:
    """The runtime's command line for a role of ``kind`` (``trainer``, ``trainer-ranks`` or ``rollout``)."""
    return [sys.executable, "-m", "runtime", "role", kind, "--spec", str(spec_path), "--workdir", workdir]


def _command(role: RunRole, spec_path: Path) -> list[str]:
    if is_rollout(role.name):
        return role_command(spec_path, role.workdir, "rollout")
    if role.name == EVALUATOR_ROLE:
        return role_command(spec_path, role.workdir, "evaluator")
    if role.name != TRAINER_ROLE:  # trainer ranks on a further host
        return role_command(spec_path, role.workdir, "trainer-ranks")
    return role_command(spec_path, role.workdir)  # two arguments: tests/launch/test_supervisor.py stands in for it


def _write_atomically(path: Path, text: str) -> None:
    """Every role of a run starts from the run directory's spec file, on its own host and at its own time:
    a role starting (or restarting) must never read a half-written file another role's start is writing."""
    partial = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}")
    partial.write_text(text)
    os.replace(partial, path)


def start_role(role_id: int, attempt: int) -> str:
    """Claim and start one attempt of a role on this host; returns what happened (idempotent)."""
    if not role_states.claim(role_id, attempt, worker_id()):
        return "not-claimed"  # already started (a redelivered task) or superseded by a newer attempt
    role = RunRole.objects.select_related("run", "run__experiment__team", "host", "host__group").get(pk=role_id)
    run = role.run
    if RunState(run.state) not in ACTIVE_STATES:
        role_exited(role.pk, attempt, None, why=f"not started: the run is {run.state}")
        return "run-inactive"
    if superseded(role, run):  # an attempt queued before its run was requeued and admitted again
        role_exited(role.pk, attempt, None, why="not started: its run was admitted again")
        return "superseded"
    # Checked at submit, and again now: a link under the team's own data root may lead elsewhere since.
    refused = confinement.refused_spec_paths(run.experiment.team, run.resolved_spec, run.parent_checkpoint)
    if refused:
        why = "; ".join(f"{error['field']}: {error['message']}" for error in refused)
        role_exited(role.pk, attempt, EXIT_BAD_INPUT, f"error: {why}\n")
        return "refused"
    directory = role_dir(role)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        spec_path = Path(role.workdir) / "spec.yaml"
        _write_atomically(spec_path, yaml.safe_dump(_role_spec(run, role), sort_keys=False))
        env = _role_env(run, role, mint_run_token(run, attempt))
        command = [sys.executable, str(ROLEWRAP), str(directory), "--", *_command(role, spec_path)]
        subprocess.run(command, env=env, cwd=settings.BASE_DIR, check=True, timeout=60)
        pid = _wait_for_pid(directory / "pid")
    except (OSError, subprocess.SubprocessError) as exc:
        role_exited(role.pk, attempt, None, why=f"could not start on {role.host.name}: {exc}")
        return "start-failed"
    role_states.mark_running(role.pk, attempt, pid, timezone.now())
    role.refresh_from_db()
    stream_role(role)
    record_event(run.pk, "role_started", {"role": role.name, "host": role.host.name, "attempt": attempt, "pid": pid})
    if run.state == RunState.ADMITTED:
        try:
            handler.transition(run, RunState.STARTING)
        except IllegalTransition:
            pass  # cancelled meanwhile: the supervisor stops the process
    return "started"


def _wait_for_pid(path: Path, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = _read_int(path)
        if pid:
            return pid
        time.sleep(0.05)
    raise OSError(f"the role wrapper wrote no pid file at {path} within {timeout:g} s")


# --- supervise --------------------------------------------------------------------------------------


class Supervisor:
    """Watches the role processes of one host (see the module docstring)."""

    def __init__(self, host_name: str, period_s: float):
        self.host_name = host_name
        self.period_s = period_s
        self._terminating: dict[tuple[int, int], float] = {}  # (role, attempt) -> when SIGKILL is due
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def pass_once(self) -> dict[str, int]:
        """One look at every role of this host that should be alive; returns counts of what was done."""
        done = {"renewed": 0, "exited": 0, "killed": 0, "adopted": 0}
        roles = list(
            RunRole.objects.filter(host__name=self.host_name, state__in=[R.LAUNCHING, R.RUNNING]).select_related("run")
        )
        now = timezone.now()
        for role in roles:
            directory = role_dir(role)
            if role.state == R.LAUNCHING:
                self._check_launching(role, directory, now, done)
                continue
            code = _read_int(directory / "exit_code")
            if code is not None:
                role_exited(role.pk, role.attempt, code, read_tail(directory / "log"))
                self._terminating.pop((role.pk, role.attempt), None)
                done["exited"] += 1
                continue
            if not process_alive(role.pid, str(directory)):
                # The wrapper writes its exit code, then exits: it may have done both since the read above
                # (a busy host can pause this thread between the two looks). Read again before calling it
                # vanished, or a clean exit would be recorded without its code.
                code = _read_int(directory / "exit_code")
                role_exited(
                    role.pk,
                    role.attempt,
                    code,
                    read_tail(directory / "log"),
                    why="" if code is not None else "the process vanished",
                )
                done["exited"] += 1
                continue
            if self._should_stop(role, now):
                self._terminate(role, done)
            elif self._hung(role, now):
                self._kill_now(role)
                role_exited(
                    role.pk,
                    role.attempt,
                    None,
                    read_tail(directory / "log"),
                    why=f"hung: no heartbeat for {settings.TANDEM_ROLE_HANG_S:g} s",
                )
                done["killed"] += 1
                continue
            role_states.renew_lease(role.pk, role.attempt, now)
            done["renewed"] += 1
        return done

    def _check_launching(self, role: RunRole, directory: Path, now, done: dict[str, int]) -> None:
        """A start in progress here, or one its worker died in: adopt the process, or hand the start back."""
        if role.claimed_by == worker_id():
            return
        lease = role.supervised_at
        if lease is not None and (now - lease).total_seconds() < settings.TANDEM_LAUNCH_TIMEOUT_S:
            return
        pid = _read_int(directory / "pid")
        if pid and process_alive(pid, str(directory)):
            role_states.mark_running(role.pk, role.attempt, pid, now, claimed_by=worker_id())
            done["adopted"] += 1
        elif _read_int(directory / "exit_code") is not None or pid:
            role_exited(role.pk, role.attempt, _read_int(directory / "exit_code"), read_tail(directory / "log"))
            done["exited"] += 1
        else:  # claimed, never started: start it again
            role_states.hand_back(role.pk, role.attempt)
            launch.resend_start(role.pk)

    def _should_stop(self, role: RunRole, now) -> bool:
        run = role.run
        if role.stop_requested:  # another trainer role of its run failed: they restart together
            return True
        if RunState(run.state) in ACTIVE_STATES:
            return superseded(role, run)  # its run was admitted again: a new attempt replaces it
        if run.state == RunState.CANCELLED:
            return True
        ended = run.finished_at or run.updated_at
        if ended is None:
            return True
        if connects_to_trainer(role.name):
            # trainer-0 releases it when it shuts down, which may be well after the run's end (its last
            # checkpoint and export): the short grace counts from that release, not from the run's end
            released = _trainer_exited_at(run)
            if released is not None:
                return (now - released).total_seconds() >= ROLLOUT_STOP_GRACE_S
        return (now - ended).total_seconds() >= STOP_GRACE_S

    def _terminate(self, role: RunRole, done: dict[str, int]) -> None:
        key = (role.pk, role.attempt)
        due = self._terminating.get(key)
        try:
            if due is None:
                os.killpg(role.pid, signal.SIGTERM)
                self._terminating[key] = time.monotonic() + KILL_GRACE_S
                done["killed"] += 1
            elif time.monotonic() >= due:
                os.killpg(role.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # gone already: the next pass reports it

    def _kill_now(self, role: RunRole) -> None:
        try:
            os.killpg(role.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _hung(self, role: RunRole, now) -> bool:
        seen = (
            RoleHeartbeat.objects.filter(run_id=role.run_id, role=role.name, attempt=role.attempt)
            .values_list("last_seen", flat=True)
            .first()
        )
        since = seen or role.launched_at
        return since is not None and (now - since).total_seconds() > settings.TANDEM_ROLE_HANG_S

    # ---- the thread ----
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    close_old_connections()
                    self.pass_once()
                except Exception:  # a database outage must not end supervision
                    logger.exception("role supervisor %s: pass failed", self.host_name)
                self._stop.wait(self.period_s)
        finally:
            connection.close()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tandem-role-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            # A daemon: a pass still running (a slow database) must not hold the worker's shutdown.
            self._thread.join(timeout=shutdown.THREAD_JOIN_S)


_supervisor: Supervisor | None = None


def _start_supervisor(config: AgentConfig) -> None:
    """Every host agent (a worker with TANDEM_HOST_NAME) supervises its host's role processes."""
    global _supervisor
    if _supervisor is not None:
        return
    _supervisor = Supervisor(config.host_name, settings.TANDEM_SUPERVISE_S)
    _supervisor.start()


def _stop_supervisor() -> None:
    # The role processes live on (they are detached): the next worker on this host adopts them.
    global _supervisor
    if _supervisor is not None:
        _supervisor.stop()
        _supervisor = None


# Started and stopped by the host agent's own worker hooks (rlplatform.agent), after the agent itself.
on_host_ready("role supervisor", _start_supervisor, _stop_supervisor)
