"""The dataset task's bad input on the platform: what the submit can check is a 400, the rest fails the run once.

The submit reads no file on a worker host, so it checks what the spec alone shows: the file's format (its
name's extension) and that the path lies where the team may read (jobs.confinement). Whether the file is
there and what its rows hold is found by the trainer role's preflight, which exits with the bad-input code
(2): the platform fails the run at once with the role's error line, restarts nothing and blames no host.
A real uvicorn and Celery host agent (tests/launch/conftest.py) run ``python -m runtime role trainer``.
"""

from __future__ import annotations

import datasets
import pytest

from jobs.client import ClientError
from jobs.client import TandemClient as Client
from jobs.models import Run, RunEvent, RunRole
from jobs.states import RunState
from tests.launch.helpers import wait_for
from tests.launch.test_runs_e2e import RUN_S, spec_text

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _open_data_root(cluster, root) -> None:
    team = cluster["team"]
    team.data_roots = [str(root)]  # the team may read its own data directory (path confinement)
    team.save(update_fields=["data_roots"])


def _refused(client: Client, spec: str) -> list[dict]:
    with pytest.raises(ClientError) as err:
        client.submit("e2e", spec)
    assert err.value.status == 400
    return err.value.body["errors"]


def test_a_dataset_file_the_spec_shows_is_wrong_is_refused_at_submit(platform, cluster, tmp_path):
    _open_data_root(cluster, tmp_path)
    client = Client(platform.url, cluster["token"])
    before = Run.objects.count()
    csv = spec_text("csv", task={"name": "dataset", "path": str(tmp_path / "train.csv")})
    assert [e["field"] for e in _refused(client, csv)] == ["task.path"]
    outside = spec_text("outside", task={"name": "dataset", "path": "/etc/train.parquet"})
    assert [e["field"] for e in _refused(client, outside)] == ["task.path"]
    assert Run.objects.count() == before  # nothing stored


def test_a_parquet_row_without_its_answer_fails_the_run_once_with_its_message_and_blames_no_host(
    platform, cluster, tmp_path
):
    data = tmp_path / "data" / "train.parquet"
    data.parent.mkdir()
    rows = [{"question": f"{i}+1=", "answer": f"#### {i + 1}"} for i in range(20)]
    rows[16]["answer"] = None
    datasets.Dataset.from_list(rows).to_parquet(str(data))
    _open_data_root(cluster, data.parent)
    spec = spec_text("bad-parquet", task={"name": "dataset", "path": str(data)})
    created, body = Client(platform.url, cluster["token"]).submit("e2e", spec)
    assert created, body
    run = Run.objects.get(pk=body["id"])

    def failed() -> bool:
        run.refresh_from_db()
        return run.state == RunState.FAILED

    wait_for(failed, f"run {run.pk} to fail", RUN_S, platform.logs)
    assert run.reason == f"trainer-0 rejected its input: task.path: {data} row 17: no answer_key 'answer'"
    assert run.started_at is None  # the preflight found it before the run started
    role = RunRole.objects.get(run=run, name="trainer-0")
    wait_for(lambda: RunRole.objects.get(pk=role.pk).exit_code is not None, "the role's exit code", RUN_S)
    role.refresh_from_db()
    assert (role.exit_code, role.attempt, role.restarts, role.host_failures) == (2, 0, 0, {})
    assert run.excluded_hosts == []
    assert not RunEvent.objects.filter(run=run, kind__in=["role_restarted", "host_excluded"]).exists()
    assert list(RunRole.objects.filter(run=run).values_list("attempt", flat=True)) == [0]  # never launched again
