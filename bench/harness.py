"""What the platform benchmarks share: Django set-up against the benchmark's
PostgreSQL, and a real uvicorn serving ``rlplatform.asgi:application``.

Imported as ``harness`` by the scripts in this folder (run as
``python bench/<name>.py``, which puts bench/ first on ``sys.path``).
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int, workers: int = 1, env: dict[str, str] | None = None, *extra: str) -> subprocess.Popen:
    """uvicorn on ``rlplatform.asgi:application``, quiet, as a subprocess of this benchmark."""
    cmd = [sys.executable, "-m", "uvicorn", "rlplatform.asgi:application", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--workers", str(workers), "--log-level", "warning", "--no-access-log", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})})


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=15)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
