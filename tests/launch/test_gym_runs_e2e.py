"""A gym run through the whole platform, as an LLM run goes: submitted through the API, admitted, launched
by a real Celery worker as ``python -m runtime role trainer`` with its sampling worker processes, reporting
to a real uvicorn; paused, resumed, rolled back and stopped by commands; its steps each stored once; then
forked from one of its checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from jobs.models import CheckpointRecord, MetricPoint, Run, RunEvent, RunRole
from jobs.states import RunState
from runtime.contract import ENV_STEPS, EPISODE_RETURN_MEAN, TRAINER_ROLE
from tests.launch.helpers import wait_for
from tests.launch.test_runs_e2e import RUN_S, _command, _live_steps, _state, _submit, _wait_state

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _gym_spec(name: str, **resources) -> str:
    return yaml.safe_dump(
        {
            "name": name,
            "seed": 1,
            "workload": "gym",
            "env": {"id": "CartPole-v1", "num_envs": 2, "segment_length": 32, "segments_per_step": 2},
            "agent": {"algorithm": "ppo"},
            "pipeline": {"mode": "async", "steps": 400, "eval_interval": 0, "max_policy_lag": 1},
            "resources": {"threads_per_process": 1, "rollout_workers": 2, **resources},
            "checkpoint": {"interval": 2, "keep_last": 400},
            "metrics": {"progress_bar": False},
        }
    )


def test_a_gym_run_is_launched_commanded_and_stopped_like_an_llm_run(platform, cluster):
    run = _submit(platform, cluster, _gym_spec("cartpole"))
    assert run.resolved_spec["workload"] == "gym" and "model" not in run.resolved_spec
    _wait_state(platform, run, RunState.RUNNING)
    wait_for(
        lambda: CheckpointRecord.objects.filter(run=run, step__gte=4).exists(), "checkpoints", RUN_S, platform.logs
    )

    assert _command(platform, cluster, run, "pause").state == "done"
    assert _state(run) == RunState.PAUSED
    assert _command(platform, cluster, run, "resume").state == "done"
    target = CheckpointRecord.objects.filter(run=run).order_by("step").first()
    reported = max(_live_steps(run))
    rollback = _command(platform, cluster, run, "rollback", {"checkpoint": target.pk})
    assert rollback.state == "done", rollback.message
    rewound = set(MetricPoint.objects.filter(run=run, rewound=True).values_list("step", flat=True))
    assert set(range(target.step + 1, reported + 1)) <= rewound

    assert _command(platform, cluster, run, "stop").state == "done"
    _wait_state(platform, run, RunState.COMPLETED)
    steps = _live_steps(run)
    assert steps == sorted(set(steps)) and max(steps) < 400  # each step once, stopped early
    last = MetricPoint.objects.filter(run=run).live().order_by("-step").first()
    assert last.metrics[ENV_STEPS] == last.step * 2 * 2 * 32  # the gym learner's own metrics were ingested
    assert any(EPISODE_RETURN_MEAN in p.metrics for p in MetricPoint.objects.filter(run=run).live())
    assert Run.objects.get(pk=run.pk).state == RunState.COMPLETED

    # a fork starts a new run whose learner starts from the checkpoint's networks
    fork = _command(platform, cluster, run, "fork", {"checkpoint": target.pk})
    assert fork.state == "done", fork.message
    child = Run.objects.get(pk=fork.args["run"])
    _wait_state(platform, child, RunState.RUNNING)
    wait_for(lambda: _live_steps(child), "the fork's first step", RUN_S, platform.logs)
    trainer = RunRole.objects.get(run=child, name=TRAINER_ROLE)
    role_spec = yaml.safe_load((Path(trainer.workdir) / "spec.yaml").read_text())
    assert role_spec["agent"]["init_path"].endswith(f"/run-{run.pk}/checkpoints/step-{target.step:08d}")
    assert "model" not in role_spec
    assert _command(platform, cluster, child, "stop").state == "done"
    _wait_state(platform, child, RunState.COMPLETED)


def test_a_gym_run_samples_on_a_rollout_role_of_its_own_like_an_llm_run(platform, cluster):
    """resources.remote_rollout_workers: the platform launches rollout-0 beside trainer-0; the sampling worker
    finds the learner through the run directory's endpoint file, authenticates and feeds it; a stop releases it."""
    run = _submit(platform, cluster, _gym_spec("cartpole-remote", rollout_workers=0, remote_rollout_workers=1))
    _wait_state(platform, run, RunState.RUNNING)
    wait_for(lambda: len(_live_steps(run)) >= 3, "three steps fed by the remote worker", RUN_S, platform.logs)
    assert _command(platform, cluster, run, "stop").state == "done"
    _wait_state(platform, run, RunState.COMPLETED)
    wait_for(lambda: all(r.exit_code is not None for r in RunRole.objects.filter(run=run)), "both roles to exit", RUN_S)
    assert {r.name: r.exit_code for r in RunRole.objects.filter(run=run)} == {TRAINER_ROLE: 0, "rollout-0": 0}
    connected = RunEvent.objects.filter(run=run, role=TRAINER_ROLE, kind="rollout_connected")
    assert [e.payload["rank"] for e in connected] == [0]
    steps = _live_steps(run)
    assert steps == list(range(1, steps[-1] + 1))
