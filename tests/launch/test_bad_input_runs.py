"""A run whose input the runtime rejects fails once, with the role's message, and blames no host.

A real uvicorn and Celery host agent (tests/launch/conftest.py) start ``python -m runtime role trainer``
on a spec whose JSONL dataset has a malformed row: the runtime exits with the bad-input code (2), and the
platform must neither restart the role nor count the failure against the host.
"""

from __future__ import annotations

import pytest

from jobs.client import TandemClient as Client
from jobs.models import Run, RunEvent, RunRole
from jobs.states import RunState
from tests.launch.helpers import wait_for
from tests.launch.test_runs_e2e import RUN_S, spec_text

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_a_malformed_dataset_row_fails_the_run_once_with_its_message_and_blames_no_host(platform, cluster, tmp_path):
    data = tmp_path / "data" / "rows.jsonl"
    data.parent.mkdir()
    data.write_text('{"prompt": "ab", "answer": "ba"}\n{"prompt": "cd", "answer": "dc"}\n{"prompt": "ef"}\n')
    team = cluster["team"]
    team.data_roots = [str(data.parent)]  # the team may read its own data directory (path confinement)
    team.save(update_fields=["data_roots"])
    spec = spec_text("bad-row", task={"name": "jsonl", "path": str(data), "verifier": "exact"})
    created, body = Client(platform.url, cluster["token"]).submit("e2e", spec)
    assert created, body
    run = Run.objects.get(pk=body["id"])

    def failed() -> bool:
        run.refresh_from_db()
        return run.state == RunState.FAILED

    wait_for(failed, f"run {run.pk} to fail", RUN_S, platform.logs)
    assert run.reason == f"trainer-0 rejected its input: {data}:3: missing `answer`"
    role = RunRole.objects.get(run=run, name="trainer-0")
    wait_for(lambda: RunRole.objects.get(pk=role.pk).exit_code is not None, "the role's exit code", RUN_S)
    role.refresh_from_db()
    assert (role.exit_code, role.attempt, role.restarts, role.host_failures) == (2, 0, 0, {})
    assert run.excluded_hosts == []
    assert not RunEvent.objects.filter(run=run, kind__in=["role_restarted", "host_excluded"]).exists()
