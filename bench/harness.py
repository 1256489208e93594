"""What the benchmarks share: Django set-up against the benchmark's PostgreSQL, a real uvicorn serving
``rlplatform.asgi:application``, and interleaved rounds of variants (``interleaved``).

Imported as ``harness`` by the scripts in this folder (run as
``python bench/<name>.py``, which puts bench/ first on ``sys.path``).
"""

from __future__ import annotations

import os
import platform
import secrets
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[1]

Figure = TypeVar("Figure")


def interleaved(
    variants: Sequence[str],
    rounds: int,
    measure: Callable[[str, int], Figure],
    after_round: Callable[[int, dict[str, list[Figure]]], None] | None = None,
) -> dict[str, list[Figure]]:
    """``measure(variant, round)`` of every variant in each of ``rounds`` rounds, the order rotated per round
    (A B C, B C A, C A B, ...) so that drift on the machine falls on every variant alike; each variant's
    figures in round order. ``after_round(round, figures)`` is called once a round is done (progress lines)."""
    figures: dict[str, list[Figure]] = {v: [] for v in variants}
    for r in range(rounds):
        k = r % len(variants)
        for variant in [*variants[k:], *variants[:k]]:
            figures[variant].append(measure(variant, r))
        if after_round is not None:
            after_round(r, figures)
    return figures


def setup_django(redis_reason: str | None = None) -> None:
    """Configure Django on ``DATABASE_URL`` (PostgreSQL) and migrate; with ``redis_reason``, require ``REDIS_URL``."""
    if not os.environ.get("DATABASE_URL", "").startswith("postgres"):
        sys.exit("set DATABASE_URL to a PostgreSQL database (postgres://user:pass@host:port/name)")
    if redis_reason and not os.environ.get("REDIS_URL", "").startswith("redis"):
        sys.exit(f"set REDIS_URL ({redis_reason})")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "rlplatform.settings")
    os.environ.setdefault("SECRET_KEY", secrets.token_urlsafe(50))
    os.environ.setdefault("ALLOWED_HOSTS", "127.0.0.1,localhost")
    sys.path.insert(0, str(ROOT))
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def tree_cpu_s(root_pid: int) -> float | None:
    """CPU seconds (user + system) used so far by a process and its descendants (Linux /proc), or None."""
    ticks = os.sysconf("SC_CLK_TCK")
    parent_of: dict[int, int] = {}
    cpu_of: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        parent_of[int(entry.name)] = int(fields[1])
        cpu_of[int(entry.name)] = (int(fields[11]) + int(fields[12])) / ticks
    if root_pid not in cpu_of:
        return None
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parent_of.items() if parent == pid]
        tree.update(children)
        frontier.extend(children)
    return sum(cpu_of[pid] for pid in tree)


def children(pid: int) -> list[int]:
    """The pids of a process's children (Linux /proc); none once it has exited."""
    out: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass  # exited meanwhile
    return out


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages: the machine is shared, so figures come with its load."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


APPLICATION = "rlplatform.asgi:application"  # what docker-compose.yml serves


def start_server(
    port: int, workers: int = 1, env: dict[str, str] | None = None, *extra: str, app: str = APPLICATION
) -> subprocess.Popen:
    """uvicorn on ``app`` (default ``rlplatform.asgi:application``), quiet, as a subprocess of this benchmark.
    Pass ``"--factory"`` in ``extra`` when ``app`` names a function that returns the application."""
    cmd = [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--workers", str(workers), "--log-level", "warning", "--no-access-log", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})})


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=15)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def django_only_application():
    """``uvicorn --factory bench.harness:django_only_application``: Django's HTTP application without the
    run-status fast path that rlplatform/asgi.py mounts in front of it (api_load.py --compare-django)."""
    import rlplatform.asgi  # sets Django up

    return rlplatform.asgi.django_asgi_app


def server_figures(workers: int, quick: bool) -> dict:
    """The first figures of a benchmark against ``start_server``: the machine, the server, the load."""
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared with other work: figures are indicative)",
        "server": f"uvicorn rlplatform.asgi:application, {workers} worker(s)",
        "quick": quick,
        "loadavg_start": loadavg(),
    }
