"""Browser end-to-end tests: a real uvicorn (HTTP + WebSockets) against the test database, driven by
Debian's Chromium through Playwright (its driver ships in the wheel; no browser is downloaded).

The server is a subprocess on the pytest-django test database, so tests use ``transactional_db``
(data must be committed to be seen) and ``REDIS_URL`` (the channel layer that carries a change made
in this process to the server's WebSocket consumers). Playwright's sync API keeps an event loop in
the main thread, where ``async_to_sync`` (the channel layer send after a commit) refuses to run;
``in_thread`` runs such changes on a worker thread instead.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "var" / "e2e-screenshots"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 15_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _database_url(settings_dict: dict) -> str:
    return (
        f"postgres://{settings_dict['USER']}:{settings_dict['PASSWORD']}@{settings_dict['HOST'] or '127.0.0.1'}"
        f":{settings_dict['PORT'] or 5432}/{settings_dict['NAME']}"
    )


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def server(django_db_setup, django_db_blocker, checkpoint_root):
    """Base URL of a uvicorn serving rlplatform.asgi on the test database."""
    from django.conf import settings
    from django.db import connection

    if not os.environ.get("REDIS_URL"):
        pytest.fail("the browser tests need REDIS_URL: the channel layer carries changes to the server process")
    if not (ROOT / "frontend" / "vendor" / "uplot" / "uPlot.esm.js").exists():
        pytest.fail("frontend/vendor/uplot is missing: run `make frontend` (npm ci + copy)")
    if connection.vendor != "postgresql":
        pytest.fail("the browser tests need PostgreSQL (DATABASE_URL=postgres://...)")
    port = _free_port()
    env = {
        **os.environ,
        "DATABASE_URL": _database_url(connection.settings_dict),
        "SECRET_KEY": settings.SECRET_KEY,  # sessions made here must be valid there
        "DEBUG": "false",
        "ALLOWED_HOSTS": "127.0.0.1",
        "TANDEM_CHECKPOINT_ROOT": str(checkpoint_root),
        "DJANGO_SETTINGS_MODULE": "rlplatform.settings",
    }
    log = open(ROOT / "var" / "e2e-server.log", "w") if (ROOT / "var").is_dir() else subprocess.DEVNULL
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "rlplatform.asgi:application", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{base}/login/", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"uvicorn did not start (exit code {proc.poll()}); see var/e2e-server.log")
                time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log is not subprocess.DEVNULL:
            log.close()


@pytest.fixture(scope="module")
def browser():
    """Chromium for one module. Module-scoped, not session: Playwright's event loop must be gone
    before other suites run, or their async_to_sync calls would find it and refuse."""
    from playwright.sync_api import sync_playwright

    before = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"  # fixtures still touch the ORM here (no async code)
    try:
        with sync_playwright() as p:
            chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
            yield chromium
            chromium.close()
    finally:
        if before is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = before


@pytest.fixture
def in_thread(transactional_db):
    """in_thread(fn, *args) runs fn on a worker thread (no event loop there) and returns its result."""
    from django.db import connections

    pool = ThreadPoolExecutor(max_workers=1)

    def run(fn, *args, **kwargs):
        return pool.submit(fn, *args, **kwargs).result(timeout=60)

    yield run
    pool.submit(connections.close_all).result()
    pool.shutdown()


@pytest.fixture
def login_as(browser, server):
    """login_as(user) -> a Playwright page whose context holds a session of ``user`` (no login form)."""
    from django.test import Client

    contexts = []

    def make(user):
        client = Client()
        client.force_login(user)
        context = browser.new_context(base_url=server, viewport={"width": 1400, "height": 1000})
        context.add_cookies([{"name": "sessionid", "value": client.cookies["sessionid"].value, "url": server}])
        context.set_default_timeout(TIMEOUT_MS)
        contexts.append(context)
        return context.new_page()

    yield make
    for context in contexts:
        context.close()


@pytest.fixture
def shot():
    """shot(page, name, part=None, full=True): save a screenshot of the page (whole, or the viewport),
    or of the locator ``part``, under var/e2e-screenshots/."""
    SHOTS.mkdir(parents=True, exist_ok=True)

    def take(page, name: str, part=None, full: bool = True) -> Path:
        path = SHOTS / f"{name}.png"
        if part is not None:
            part.screenshot(path=str(path))
        else:
            page.screenshot(path=str(path), full_page=full)
        return path

    return take
