"""Fixtures of the ingest tests: a RUNNING run, its run token, and clients posting with it."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    # The personas are created with passwords; PBKDF2 costs ~1 s per user on this machine.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def start(db):
    """start(run): walk an ADMITTED run to RUNNING."""
    from jobs import handler
    from jobs.states import RunState

    def do(run):
        for state in (RunState.STARTING, RunState.RUNNING):
            handler.transition(run, state)
        return run

    return do


@pytest.fixture
def run(experiment, submit, start):
    """Team A's RUNNING run (one CPU device)."""
    return start(submit(experiment))


@pytest.fixture
def other_run(experiment, submit, start):
    return start(submit(experiment))


@pytest.fixture
def client_for(db):
    """client_for(run, attempt=0) -> an APIClient carrying a fresh run token of that attempt."""
    from rest_framework.test import APIClient

    from jobs.ingest.tokens import mint_run_token

    def make(run, attempt=0):
        c = APIClient()
        c.credentials(HTTP_AUTHORIZATION=f"Bearer {mint_run_token(run, attempt)}")
        return c

    return make


@pytest.fixture
def ingest(run, client_for):
    """The run's client (attempt 0)."""
    return client_for(run)
