"""A run with ``rollout.engine: vllm`` through the whole platform: submitted over REST, admitted, started by a
real Celery worker (this machine's host agent) as ``python -m runtime role trainer`` (and, async, ``role
rollout``) on vLLM's CPU build, reporting to a real uvicorn, completed; and a model vLLM cannot serve refused at
submit.

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
from jobs.models import RoleState as R
from jobs.states import RunState
from tests.launch.conftest import cluster, platform  # noqa: F401  (fixtures)
from tests.launch.helpers import wait_for
from tests.vllm.helpers import vllm_spec

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

RUN_S = 300.0  # vLLM starts in 15-40 s on a loaded 2-core machine; the run itself is seconds
GAP = 1e-3  # engine vs trainer log-probs of the same tokens, fp32 on both sides
VLLM_STARTED = "Initializing a V1 LLM engine"  # vLLM's start-up line


def _role_logs(run: Run) -> list[Path]:
    workdirs = set(RunRole.objects.filter(run=run).values_list("workdir", flat=True))
    return [log for workdir in workdirs for log in sorted(Path(workdir).glob("roles/*/attempt-*/log"))]


def _role_log(run: Run, role: str) -> str:
    return "".join(log.read_text(errors="replace") for log in _role_logs(run) if log.parts[-3] == role)


def _team_model(cluster, model: Path, tmp_path: Path) -> Path:  # noqa: F811
    """The model in a data root of the run's team (a run may read only what its team may)."""
    root = (tmp_path / "team-data").resolve()
    shutil.copytree(model, root / "policy")
    team = cluster["team"]
    team.data_roots = [str(root)]
    team.save(update_fields=["data_roots"])
    return root / "policy"


def _run_to_the_end(platform, cluster, spec: dict) -> Run:  # noqa: F811
    """Submit ``spec`` over REST; wait until the run has ended and every one of its roles has exited."""
    del spec["output_dir"]  # the platform gives a run its directory
    created, body = Client(platform.url, cluster["token"]).submit("e2e", yaml.safe_dump(spec))
    assert created, body
    run = Run.objects.get(pk=body["id"])

    def ended() -> str | None:
        run.refresh_from_db()
        return run.state if run.state in (RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED) else None

    state = wait_for(ended, f"run {run.pk} to end", RUN_S, platform.logs + _role_logs(run))
    tails = "".join(f"--- {p}:\n{p.read_text(errors='replace')[-3000:]}" for p in _role_logs(run))
    assert state == RunState.COMPLETED, f"{run.reason}\n{tails}"
    wait_for(
        lambda: not RunRole.objects.filter(run=run).exclude(state=R.EXITED).exists(),
        "every role to exit",
        60,
        platform.logs + _role_logs(run),
    )
    return run


def _steps(run: Run) -> dict[int, dict]:
    """The live metric points of the run's training steps, by step."""
    points = {p.step: p.metrics for p in MetricPoint.objects.filter(run=run).live()}
    return {step: metrics for step, metrics in sorted(points.items()) if "reward/mean" in metrics}


def _assert_weights_landed(steps: dict[int, dict]) -> None:
    """vLLM scored its samples as the trainer does: every published version arrived in the engine."""
    gaps = [m["consistency/logprob_diff_max"] for m in steps.values() if "consistency/logprob_diff_max" in m]
    assert gaps and max(gaps) < GAP, gaps


def test_a_vllm_run_launched_by_the_platform_completes_and_its_weights_land(platform, cluster, sft_model, tmp_path):  # noqa: F811
    model = _team_model(cluster, sft_model, tmp_path)
    spec = vllm_spec(tmp_path, "platform-vllm", model, pipeline={"steps": 4}, checkpoint={"interval": 2})
    run = _run_to_the_end(platform, cluster, spec)
    steps = _steps(run)
    assert list(steps) == [1, 2, 3, 4]
    assert [m["weights/version"] for m in steps.values()] == [1, 2, 3, 4]
    _assert_weights_landed(steps)
    roles = {r.name: (r.attempt, r.restarts, r.exit_code) for r in RunRole.objects.filter(run=run)}
    assert roles == {"trainer-0": (0, 0, 0)}
    assert VLLM_STARTED in _role_log(run, "trainer-0")  # the role really ran vLLM


def test_an_async_vllm_run_with_a_platform_launched_rollout_role_completes_and_its_weights_land(  # noqa: F811
    platform,  # noqa: F811
    cluster,  # noqa: F811
    sft_model,
    tmp_path,
):
    """rollout-0 is a role of its own (``python -m runtime role rollout``) on the host's second device, vLLM
    generating there for the trainer; it is released when the trainer ends."""
    model = _team_model(cluster, sft_model, tmp_path)
    spec = vllm_spec(
        tmp_path,
        "platform-vllm-async",
        model,
        pipeline={"mode": "async", "steps": 4, "max_policy_lag": 1},
        resources={"rollout_workers": 0, "remote_rollout_workers": 1},
    )
    run = _run_to_the_end(platform, cluster, spec)
    steps = _steps(run)
    assert list(steps) == [1, 2, 3, 4]
    assert [m["weights/version"] for m in steps.values()] == [1, 2, 3, 4]
    assert max(m["staleness/max"] for m in steps.values()) <= 1
    assert sum(m["rollout/instance/0/busy_s"] for m in steps.values()) > 0  # the rollout role generated
    _assert_weights_landed(steps)
    roles = {r.name: (r.attempt, r.restarts, r.exit_code) for r in RunRole.objects.filter(run=run)}
    assert roles == {"trainer-0": (0, 0, 0), "rollout-0": (0, 0, 0)}
    assert VLLM_STARTED in _role_log(run, "rollout-0")  # vLLM ran in the rollout role
    assert VLLM_STARTED not in _role_log(run, "trainer-0")  # and only there: the trainer has no engine


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
