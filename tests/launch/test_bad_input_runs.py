"""A run whose input the runtime rejects fails once, with the role's message, and blames no host.

A real uvicorn and Celery host agent (tests/launch/conftest.py) start ``python -m runtime role trainer``
on a spec whose dataset has a malformed row: the runtime's preflight exits with the bad-input code (2),
and the platform must neither restart the role nor count the failure against the host. What the submit
can check from the spec alone (a dataset file's format, that its path lies where the team may read:
jobs.confinement) is a 400 instead; the submit reads no file on a worker host.
"""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest

from jobs.client import ClientError
from jobs.client import TandemClient as Client
from jobs.models import Run, RunEvent, RunRole
from jobs.states import RunState
from tests.launch.helpers import wait_for
from tests.launch.test_runs_e2e import RUN_S, spec_text

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _open_data_root(cluster, root: Path) -> None:
    team = cluster["team"]
    team.data_roots = [str(root)]  # the team may read its own data directory (path confinement)
    team.save(update_fields=["data_roots"])


def _fails_once(platform, cluster, spec: str, reason: str) -> Run:
    """Submit ``spec``; the run must fail with ``reason``, its trainer role exiting 2 on its first attempt, with
    no restart, no host failure and no host excluded."""
    created, body = Client(platform.url, cluster["token"]).submit("e2e", spec)
    assert created, body
    run = Run.objects.get(pk=body["id"])

    def failed() -> bool:
        run.refresh_from_db()
        return run.state == RunState.FAILED

    wait_for(failed, f"run {run.pk} to fail", RUN_S, platform.logs)
    assert run.reason == reason
    role = RunRole.objects.get(run=run, name="trainer-0")
    wait_for(lambda: RunRole.objects.get(pk=role.pk).exit_code is not None, "the role's exit code", RUN_S)
    role.refresh_from_db()
    assert (role.exit_code, role.attempt, role.restarts, role.host_failures) == (2, 0, 0, {})
    assert run.excluded_hosts == []
    assert not RunEvent.objects.filter(run=run, kind__in=["role_restarted", "host_excluded"]).exists()
    return run


def test_a_malformed_dataset_row_fails_the_run_once_with_its_message_and_blames_no_host(platform, cluster, tmp_path):
    data = tmp_path / "data" / "rows.jsonl"
    data.parent.mkdir()
    data.write_text('{"prompt": "ab", "answer": "ba"}\n{"prompt": "cd", "answer": "dc"}\n{"prompt": "ef"}\n')
    _open_data_root(cluster, data.parent)
    spec = spec_text("bad-row", task={"name": "jsonl", "path": str(data), "verifier": "exact"})
    _fails_once(platform, cluster, spec, f"trainer-0 rejected its input: {data}:3: missing `answer`")


def test_a_parquet_row_without_its_answer_fails_the_run_once_before_it_starts(platform, cluster, tmp_path):
    data = tmp_path / "data" / "train.parquet"
    data.parent.mkdir()
    rows = [{"question": f"{i}+1=", "answer": f"#### {i + 1}"} for i in range(20)]
    rows[16]["answer"] = None
    datasets.Dataset.from_list(rows).to_parquet(str(data))
    _open_data_root(cluster, data.parent)
    spec = spec_text("bad-parquet", task={"name": "dataset", "path": str(data)})
    reason = f"trainer-0 rejected its input: task.path: {data} row 17: no answer_key 'answer'"
    run = _fails_once(platform, cluster, spec, reason)
    assert run.started_at is None  # the preflight found it before the run started


def test_a_dataset_file_the_spec_shows_is_wrong_is_refused_at_submit(platform, cluster, tmp_path):
    _open_data_root(cluster, tmp_path)
    client = Client(platform.url, cluster["token"])
    before = Run.objects.count()

    def refused(spec: str) -> list[str]:
        with pytest.raises(ClientError) as err:
            client.submit("e2e", spec)
        assert err.value.status == 400
        return [e["field"] for e in err.value.body["errors"]]

    assert refused(spec_text("csv", task={"name": "dataset", "path": str(tmp_path / "train.csv")})) == ["task.path"]
    assert refused(spec_text("outside", task={"name": "dataset", "path": "/etc/train.parquet"})) == ["task.path"]
    assert Run.objects.count() == before  # nothing stored
