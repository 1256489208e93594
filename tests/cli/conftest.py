"""Fixtures of the CLI tests: a live server (pytest-django), a token, and a thread that drives runs."""

from __future__ import annotations

import threading
import time

import pytest


@pytest.fixture
def ci_token(owner, team_a):
    from rlplatform import tokens

    _token, raw = tokens.mint(owner, team_a, "ci")
    return raw


@pytest.fixture
def cli(live_server, ci_token):
    """cli(*args) -> (exit code, stdout, stderr) of ``python -m jobs.client`` run in-process against the live server."""
    import io

    from jobs import client

    def run(*args, token=ci_token, url=None):
        out, err = io.StringIO(), io.StringIO()
        code = client.main(["--url", url or live_server.url, "--token", token, *args], out=out, err=err)
        return code, out.getvalue(), err.getvalue()

    return run


@pytest.fixture
def drive_run():
    """drive_run(submission_id, steps) starts a thread that waits for the run with that
    submission id to exist, then applies ``steps`` [(state, reason), ...] through jobs.handler,
    as a worker would while the CLI waits."""
    threads = []
    failures = []

    def start(submission_id: str, steps, delay_s: float = 0.3):
        def work():
            from django.db import connection

            from jobs import handler
            from jobs.models import Run

            try:
                deadline = time.monotonic() + 30
                run = None
                while run is None and time.monotonic() < deadline:
                    run = Run.objects.filter(submission_id=submission_id).first()
                    time.sleep(0.05)
                assert run is not None, f"run {submission_id} never appeared"
                time.sleep(delay_s)  # let the client reach its long-poll first
                for state, reason in steps:
                    handler.transition(run, state, reason)
            except BaseException as exc:  # reported by the fixture teardown
                failures.append(exc)
            finally:
                connection.close()

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        threads.append(thread)
        return thread

    yield start
    for thread in threads:
        thread.join(timeout=30)
    assert not failures, failures
