"""A run with ``rollout.engine: vllm`` through the whole platform: submitted over REST, admitted, started by a
real Celery worker (this machine's host agent) as ``python -m runtime role trainer`` on vLLM's CPU build,
reporting to a real uvicorn, completed; and a model vLLM cannot serve refused at submit.

The platform fixtures are tests/launch's (a real server and worker over the suite's PostgreSQL and Redis).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from jobs.client import ClientError
from jobs.client import TandemClient as Client
from jobs.models import MetricPoint, Run, RunRole
from jobs.states import RunState
from tests.launch.conftest import cluster, platform  # noqa: F401  (fixtures)
from tests.launch.helpers import wait_for
from tests.vllm.helpers import vllm_spec

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

RUN_S = 300.0  # vLLM starts in 15-40 s on a loaded 2-core machine; the run itself is seconds


def _role_logs(run: Run) -> list[Path]:
    workdirs = RunRole.objects.filter(run=run).values_list("workdir", flat=True)
    return [log for workdir in workdirs for log in sorted(Path(workdir).glob("roles/*/attempt-*/log"))]


def _team_model(cluster, model: Path, tmp_path: Path) -> Path:  # noqa: F811
    """The model in a data root of the run's team (a run may read only what its team may)."""
    root = (tmp_path / "team-data").resolve()
    shutil.copytree(model, root / "policy")
    team = cluster["team"]
    team.data_roots = [str(root)]
    team.save(update_fields=["data_roots"])
    return root / "policy"


def test_a_vllm_run_launched_by_the_platform_completes_and_its_weights_land(platform, cluster, sft_model, tmp_path):  # noqa: F811
    model = _team_model(cluster, sft_model, tmp_path)
    spec = vllm_spec(tmp_path, "platform-vllm", model, pipeline={"steps": 4}, checkpoint={"interval": 2})
    del spec["output_dir"]  # the platform gives a run its directory
    api = Client(platform.url, cluster["token"])
    created, body = api.submit("e2e", yaml.safe_dump(spec))
    assert created, body
    run = Run.objects.get(pk=body["id"])

    def ended() -> str | None:
        run.refresh_from_db()
        return run.state if run.state in (RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED) else None

    state = wait_for(ended, f"run {run.pk} to end", RUN_S, platform.logs + _role_logs(run))
    logs = "".join(p.read_text()[-3000:] for p in _role_logs(run))
    assert state == RunState.COMPLETED, logs
    points = {p.step: p.metrics for p in MetricPoint.objects.filter(run=run).live()}
    steps = sorted(s for s, m in points.items() if "reward/mean" in m)
    assert steps == [1, 2, 3, 4]
    assert [points[s]["weights/version"] for s in steps] == [1, 2, 3, 4]
    gaps = [points[s]["consistency/logprob_diff_max"] for s in steps if "consistency/logprob_diff_max" in points[s]]
    assert gaps and max(gaps) < 1e-3  # vLLM scored its samples as the trainer does: every update landed
    whole = "".join(p.read_text() for p in _role_logs(run))
    assert "Initializing a V1 LLM engine" in whole  # the role really ran vLLM (its start-up line)


def test_a_model_vllm_cannot_serve_is_refused_at_submit_naming_the_head_size(platform, cluster, tmp_path):  # noqa: F811
    from runtime.__main__ import main

    base16 = tmp_path / "m16"
    assert main(["make-model", str(base16), "--from-task", "reverse"]) == 0  # 4 heads of 16
    model = _team_model(cluster, base16, tmp_path)
    spec = vllm_spec(tmp_path, "bad-vllm", model)
    del spec["output_dir"]
    runs_before = Run.objects.count()
    with pytest.raises(ClientError) as refused:
        Client(platform.url, cluster["token"]).submit("e2e", yaml.safe_dump(spec))
    assert refused.value.status == 400
    errors = refused.value.body["errors"]
    assert [e["field"] for e in errors] == ["model.path"] and "has head_dim 16" in errors[0]["message"]
    assert Run.objects.count() == runs_before  # nothing stored
