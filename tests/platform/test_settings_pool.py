"""The PostgreSQL connection pool: on by default for PostgreSQL, off for SQLite, sizes from the environment."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PG_URL = "postgres://u:p@127.0.0.1:1/db"
POOL_VARS = (
    "DATABASE_POOL",
    "DATABASE_POOL_MIN",
    "DATABASE_POOL_MAX",
    "DATABASE_POOL_TIMEOUT_S",
    "DATABASE_CONN_MAX_AGE",
)


def _database_settings(tmp_path, env):
    """DATABASES["default"] as the settings module builds it in a fresh interpreter, or its error."""
    clean = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DEBUG", *POOL_VARS)}
    clean.update({"SECRET_KEY": "x" * 50, "TANDEM_VAR_DIR": str(tmp_path), **env})
    code = "import json, rlplatform.settings as s; print(json.dumps(s.DATABASES['default'], default=str))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean, capture_output=True, text=True)
    return (json.loads(result.stdout) if result.returncode == 0 else None), result.stderr


def test_postgres_gets_a_pool_and_no_persistent_connections_by_default(tmp_path):
    db, err = _database_settings(tmp_path, {"DATABASE_URL": PG_URL})
    assert db is not None, err
    assert db["OPTIONS"]["pool"] == {"min_size": 2, "max_size": 16, "timeout": 10.0}
    assert db["CONN_MAX_AGE"] == 0


def test_pool_sizes_come_from_the_environment(tmp_path):
    env = {"DATABASE_URL": PG_URL, "DATABASE_POOL_MIN": "1", "DATABASE_POOL_MAX": "4", "DATABASE_POOL_TIMEOUT_S": "2.5"}
    db, err = _database_settings(tmp_path, env)
    assert db is not None, err
    assert db["OPTIONS"]["pool"] == {"min_size": 1, "max_size": 4, "timeout": 2.5}


def test_pool_off_keeps_persistent_connections(tmp_path):
    db, err = _database_settings(tmp_path, {"DATABASE_URL": PG_URL, "DATABASE_POOL": "false"})
    assert db is not None, err
    assert "pool" not in db["OPTIONS"]
    assert (db["CONN_MAX_AGE"], db["CONN_HEALTH_CHECKS"]) == (60, True)


def test_sqlite_has_no_pool(tmp_path):
    db, err = _database_settings(tmp_path, {"DEBUG": "true"})
    assert db is not None, err
    assert db["ENGINE"] == "django.db.backends.sqlite3"
    assert "pool" not in db["OPTIONS"]


@pytest.mark.parametrize(
    "env,message",
    [
        ({"DEBUG": "true", "DATABASE_POOL": "true"}, "DATABASE_POOL=true needs PostgreSQL"),
        ({"DATABASE_URL": PG_URL, "DATABASE_POOL_MIN": "8", "DATABASE_POOL_MAX": "4"}, "DATABASE_POOL_MIN=8 must not"),
        ({"DATABASE_URL": PG_URL, "DATABASE_POOL_MAX": "0"}, "DATABASE_POOL_MAX=0 is below the minimum 1"),
        ({"DATABASE_URL": PG_URL, "DATABASE_POOL": "sometimes"}, "DATABASE_POOL='sometimes' is not a boolean"),
    ],
)
def test_bad_pool_settings_stop_startup_naming_the_variable(tmp_path, env, message):
    db, err = _database_settings(tmp_path, env)
    assert db is None
    assert message in err


@pytest.mark.django_db(transaction=True)
def test_requests_reuse_pooled_connections():
    # Under ASGI each request runs in a new thread: with the pool, its connection comes from the
    # pool and goes back to it, so a stream of requests opens no new PostgreSQL connection.
    import threading

    from django.db import connection

    if connection.vendor != "postgresql" or connection.pool is None:
        pytest.skip("needs PostgreSQL with DATABASE_POOL on (its default there)")
    pool = connection.pool
    connection.ensure_connection()
    pool.wait(timeout=30)  # min_size connections are open
    before = pool.get_stats()
    backend_pids = []

    def one_request():
        from django.db import connection as thread_connection

        with thread_connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            backend_pids.append(cursor.fetchone()[0])
        thread_connection.close()  # what Django does at the end of every request: back to the pool

    for _ in range(5):
        thread = threading.Thread(target=one_request)
        thread.start()
        thread.join()
    after = pool.get_stats()
    assert len(backend_pids) == 5
    assert after.get("requests_num", 0) - before.get("requests_num", 0) == 5
    assert after.get("connections_num", 0) == before.get("connections_num", 0)  # none opened
