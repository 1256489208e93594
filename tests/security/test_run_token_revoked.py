"""A run's tokens end with the run (issue 13, cross-team access 4).

A run token kept working after its run was cancelled: metrics and checkpoints
were still stored. Now jobs.handler.transition revokes the run's tokens when it
reaches COMPLETED, FAILED or CANCELLED, and ingest refuses any token of such a
run. What the runtime still reports after that (its last step, its final
checkpoint) stays in its spool and is stored by the platform itself when the
role exits (jobs.ingest.spool.replay_spool), so an ended run loses nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from django.utils import timezone

from jobs import commands, handler
from jobs.ingest.tokens import mint_run_token
from jobs.lifecycle import apply
from jobs.models import CheckpointRecord, MetricPoint, RoleHeartbeat, RunRole, RunToken
from jobs.models import RoleState as R
from jobs.states import RunState
from runtime.contract import spool_dir
from runtime.managed.reporter import HttpReporter, JsonPoster
from tests.ingest.helpers import batch, post, stored
from tests.launch.helpers import launch_captured, wait_for

# The API's body for a 401 (rlplatform.api: the errors shape, and detail); one message for every bad token.
REFUSED = {
    "detail": "invalid, expired or revoked run token",
    "errors": [{"field": "request", "message": "invalid, expired or revoked run token"}],
}


def _end(run, how, api_as, owner):
    if how == "cancelled through the API":
        resp = api_as(owner).post(f"/api/runs/{run.pk}/cancel/", {}, format="json")
        assert resp.status_code == 200, resp.content
    elif how == "failed":
        handler.transition(run, RunState.FAILED, "trainer-0 failed after 3 restarts")
    else:
        handler.transition(run, RunState.COMPLETED)
    run.refresh_from_db()


@pytest.mark.parametrize(
    "how, state",
    [
        ("cancelled through the API", RunState.CANCELLED),
        ("failed", RunState.FAILED),
        ("completed", RunState.COMPLETED),
    ],
)
def test_an_ended_runs_token_gets_401_on_every_ingest_endpoint_and_stores_nothing(
    run, ingest, api_as, owner, how, state
):
    # Given a token that has stored a step of its run
    assert post(ingest, "metrics", batch(run, [1])).status_code == 200
    # When the run ends
    _end(run, how, api_as, owner)
    assert run.state == state
    # Then the token writes nothing more
    path = f"run-{run.pk}/checkpoints/step-00000002"
    body = batch(run, [2, 3], events=[{"seq": 9, "kind": "checkpoint", "payload": {"step": 2, "path": path}}])
    for endpoint, payload in [
        ("metrics", body),
        ("checkpoints", {"step": 2, "path": path}),
        ("heartbeat", {"role": "trainer-0"}),
        ("command_result", {"command": 1, "state": "done"}),
    ]:
        resp = post(ingest, endpoint, payload)
        assert (endpoint, resp.status_code, resp.json()) == (endpoint, 401, REFUSED)
    assert stored(run) == {1: {"reward": 0.1}}
    assert not CheckpointRecord.objects.filter(run=run).exists()
    assert not RoleHeartbeat.objects.filter(run=run).exists()
    assert list(RunToken.objects.filter(run=run).values_list("revoked_at", flat=True)) != [None]
    assert not RunToken.objects.filter(run=run, revoked_at__isnull=True).exists()


def test_a_token_minted_after_its_run_ended_is_refused_too(run, client_for, api_as, owner):
    # Given a cancelled run
    _end(run, "cancelled through the API", api_as, owner)
    # When a token of it is minted afterwards (a start racing the cancel) and used
    late = client_for(run, 1)
    resp = post(late, "metrics", batch(run, [1], attempt=1))
    # Then ingest refuses it by the run's state, though its row is not revoked
    assert (resp.status_code, resp.json()) == (401, REFUSED)
    assert RunToken.objects.get(run=run, attempt=1).revoked_at is None
    assert not MetricPoint.objects.filter(run=run).exists()


def test_a_preempted_and_requeued_runs_attempt_token_still_delivers_its_spool(run, ingest):
    # Given a run preempted and back in the queue (its next attempt drains this attempt's spool with this token)
    handler.transition(run, RunState.PREEMPTED, "preempted by a higher-priority run")
    handler.requeue_run(run)
    # When the ended attempt's records are delivered with its token
    resp = post(ingest, "metrics", batch(run, [1, 2]))
    # Then they are stored: a requeued run has not ended
    assert resp.status_code == 200, resp.content
    assert sorted(stored(run)) == [1, 2]


@pytest.mark.django_db(transaction=True)
def test_a_stopped_runs_last_records_refused_over_http_are_stored_from_its_spool_when_it_exits(
    experiment, submit, owner, checkpoint_root, live_server, django_capture_on_commit_callbacks
):
    # Given a trainer running attempt 0 of a run, reporting over HTTP through its spool
    run = submit(experiment)
    role, _sent = launch_captured(run, django_capture_on_commit_callbacks)
    RunRole.objects.filter(pk=role.pk).update(state=R.RUNNING, pid=999999, launched_at=timezone.now())
    for state in (RunState.STARTING, RunState.RUNNING):
        handler.transition(run, state)
    raw = mint_run_token(run, 0)
    poster = JsonPoster(live_server.url, raw)
    reporter = HttpReporter(
        live_server.url,
        raw,
        spool_dir(Path(role.workdir), 0),
        run=str(run.pk),
        role="trainer-0",
        min_interval_s=0.0,
        backoff_s=0.05,
        backoff_max_s=0.1,
    )
    reporter.report(1, {"reward/mean": 0.1})
    assert reporter.flush(timeout=10)
    # When it is stopped: the command rides on a heartbeat's reply, and its acknowledgement completes the run
    command = commands.create(owner, run, "stop")
    assert [c["id"] for c in poster.post("/api/ingest/heartbeat", {"role": "trainer-0"})["commands"]] == [command.pk]
    poster.post("/api/ingest/command_result", {"command": command.pk, "state": "done"})
    run.refresh_from_db()
    assert run.state == RunState.COMPLETED
    # ... and the trainer still reports its last step and checkpoint: refused (the run's token ended), kept
    checkpoint = f"{role.workdir}/checkpoints/step-00000002"
    reporter.report(2, {"reward/mean": 0.2})
    reporter.event("checkpoint", {"step": 2, "path": checkpoint})
    wait_for(lambda: (reporter.last_error or "").startswith("HTTP 401"), "the ended run's token to be refused")
    reporter.close(timeout=0.0)
    assert reporter.pending() == 2
    assert sorted(MetricPoint.objects.filter(run=run).values_list("step", flat=True)) == [1]
    assert not CheckpointRecord.objects.filter(run=run).exists()
    # Then when the trainer exits, the platform stores them from its spool
    assert apply.role_exited(role.pk, 0, 0, '{"outcome": "stopped", "steps": 2}\n') == "ended"
    assert sorted(MetricPoint.objects.filter(run=run).values_list("step", "metrics")) == [
        (1, {"reward/mean": 0.1}),
        (2, {"reward/mean": 0.2}),
    ]
    assert list(CheckpointRecord.objects.filter(run=run).values_list("step", "path")) == [(2, checkpoint)]
    run.refresh_from_db()
    assert run.state == RunState.COMPLETED
