"""Fixtures of the alert tests: a RUNNING run of team A (tests/conftest.py), a run token's ingest client
and a post of reporter batches."""

from __future__ import annotations

import pytest


@pytest.fixture
def ingest(run):
    """ingest(body) -> the reply of POST /api/ingest/metrics with a run token of the run (attempt 0)."""
    from rest_framework.test import APIClient

    from jobs.ingest.tokens import mint_run_token

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {mint_run_token(run, 0)}")

    def post(body):
        reply = client.post("/api/ingest/metrics", body, format="json")
        assert reply.status_code == 200, reply.content
        return reply.json()

    return post


@pytest.fixture
def other_runs(experiment, submit, start):
    """Two more RUNNING runs of team A, never silent for long: the no_step check must pass them by."""
    return [start(submit(experiment)) for _ in range(2)]
