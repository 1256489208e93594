"""Fixtures of the ingest tests: a RUNNING run, its run token, and clients posting with it."""

from __future__ import annotations

import pytest


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
