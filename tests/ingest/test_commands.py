"""Commands: create (audited), delivery on ingest replies, the runtime's results, and what each kind does."""

from __future__ import annotations

import datetime
import time

import pytest
from django.utils import timezone

from jobs import commands
from jobs.handler import Conflict, InvalidInput
from jobs.models import CheckpointRecord, Command, ConfigVersion, MetricPoint, Run
from jobs.states import RunState
from rlplatform.models import AuditLog
from tests.ingest.helpers import batch, post, stored


def _checkpoint(run, step, path=None):
    return CheckpointRecord.objects.create(run=run, step=step, path=path or f"run-{run.pk}/checkpoints/step-{step}")


def _audit(command):
    return list(
        AuditLog.objects.filter(target_type="jobs.command", target_id=str(command.pk))
        .order_by("pk")
        .values_list("action", "actor_name", "team_id")
    )


def test_a_command_is_pending_then_delivered_once_then_done(run, ingest, owner):
    command = commands.create(owner, run, "pause")
    assert (command.state, command.deliveries) == ("pending", 0)

    first = post(ingest, "metrics", batch(run, [1]))
    second = post(ingest, "heartbeat", {"role": "trainer-0"})

    assert first.json()["commands"] == [{"id": command.pk, "kind": "pause", "args": {}}]
    assert second.json()["commands"] == []  # delivered, not yet due for redelivery
    command.refresh_from_db()
    assert (command.state, command.deliveries) == ("delivered", 1)

    done = post(ingest, "command_result", {"command": command.pk, "state": "done", "message": "paused at step 1"})

    assert done.status_code == 200
    assert done.json() == {"command": command.pk, "state": "done", "commands": []}
    command.refresh_from_db()
    assert (command.state, command.message) == ("done", "paused at step 1")
    assert command.finished_at is not None
    run.refresh_from_db()
    assert run.state == RunState.PAUSED
    assert _audit(command) == [
        ("command.create", "owner", run.experiment.team_id),
        ("command.complete", "system", run.experiment.team_id),
    ]


def test_an_unacknowledged_command_is_delivered_again_after_a_while(run, ingest, owner):
    command = commands.create(owner, run, "stop")
    post(ingest, "heartbeat", {"role": "trainer-0"})
    Command.objects.filter(pk=command.pk).update(
        delivered_at=timezone.now() - commands.REDELIVER_AFTER - datetime.timedelta(seconds=1)
    )

    resp = post(ingest, "heartbeat", {"role": "trainer-0"})

    assert [c["id"] for c in resp.json()["commands"]] == [command.pk]
    command.refresh_from_db()
    assert (command.state, command.deliveries) == ("delivered", 2)


def test_results_are_idempotent_and_cannot_be_contradicted(run, ingest, owner):
    # A pause: a stop's "done" ends the run, and with it the token that would repeat the result.
    command = commands.create(owner, run, "pause")
    post(ingest, "command_result", {"command": command.pk, "state": "done", "message": "paused at step 9"})

    again = post(ingest, "command_result", {"command": command.pk, "state": "done"})
    contradict = post(ingest, "command_result", {"command": command.pk, "state": "failed", "message": "oops"})

    assert again.status_code == 200
    assert contradict.status_code == 409
    command.refresh_from_db()
    assert (command.state, command.message) == ("done", "paused at step 9")
    run.refresh_from_db()
    assert run.state == RunState.PAUSED
    assert len(_audit(command)) == 2


def test_a_failed_command_keeps_the_run_as_it_was(run, ingest, owner):
    command = commands.create(owner, run, "pause")

    post(ingest, "command_result", {"command": command.pk, "state": "failed", "message": "trainer busy"})

    command.refresh_from_db()
    run.refresh_from_db()
    assert (command.state, command.message, run.state) == ("failed", "trainer busy", RunState.RUNNING)


def test_a_result_for_another_runs_command_is_404(run, other_run, ingest, owner):
    command = commands.create(owner, other_run, "pause")

    resp = post(ingest, "command_result", {"command": command.pk, "state": "done"})

    assert resp.status_code == 404
    command.refresh_from_db()
    assert command.state == "pending"


def test_a_bad_result_names_the_field(run, ingest, owner):
    command = commands.create(owner, run, "pause")

    resp = post(ingest, "command_result", {"command": command.pk, "state": "finished"})

    assert resp.status_code == 400
    assert resp.json() == {"errors": [{"field": "state", "message": "must be one of done, failed"}]}
    command.refresh_from_db()
    assert command.state == "pending"


def test_a_command_the_state_does_not_allow_is_refused_and_not_stored(run, owner):
    with pytest.raises(Conflict, match=f"cannot resume run {run.pk} while it is RUNNING"):
        commands.create(owner, run, "resume")
    with pytest.raises(InvalidInput) as exc:
        commands.create(owner, run, "explode")
    assert exc.value.errors[0]["field"] == "kind"
    with pytest.raises(InvalidInput) as exc:
        commands.create(owner, run, "pause", {"now": True})
    assert exc.value.errors == [{"field": "args.now", "message": "pause takes no arguments"}]
    assert Command.objects.count() == 0
    assert not AuditLog.objects.filter(action="command.create").exists()


def test_cancel_ends_the_run_and_its_token_at_once(run, ingest, owner):
    command = commands.create(owner, run, "cancel")

    run.refresh_from_db()
    assert run.state == RunState.CANCELLED
    assert AuditLog.objects.filter(action="run.cancel", target_id=str(run.pk)).count() == 1
    # Nothing left to deliver: the runtime's token ended with the run; its host's supervisor stops it.
    assert (command.state, command.message) == ("done", "cancelled; the role processes are stopped by their hosts")
    assert post(ingest, "heartbeat", {"role": "trainer-0"}).status_code == 401


# --- set_params ----------------------------------------------------------------------------------------


def test_set_params_records_numbered_versions_of_validated_values(run, ingest, owner):
    first = commands.create(owner, run, "set_params", {"params": {"trainer.lr": "2e-5"}})
    second = commands.create(owner, run, "set_params", {"params": {"pipeline.eval_interval": 3}})

    assert first.args == {"params": {"trainer.lr": 2e-5}}
    versions = list(ConfigVersion.objects.filter(run=run).values_list("number", "params", "command_id", "created_by"))
    assert versions == [
        (1, {"trainer.lr": 2e-5}, first.pk, owner.pk),
        (2, {"pipeline.eval_interval": 3}, second.pk, owner.pk),
    ]
    # a sync run: pipeline.max_policy_lag acts on nothing there, so it is not one of its live parameters
    assert commands.effective_params(run) == {"pipeline.eval_interval": 3, "trainer.lr": 2e-5}
    delivered = post(ingest, "heartbeat", {"role": "trainer-0"}).json()["commands"]
    assert [c["args"] for c in delivered] == [
        {"params": {"trainer.lr": 2e-5}},
        {"params": {"pipeline.eval_interval": 3}},
    ]


def test_the_lag_bound_is_live_in_an_async_run_and_refused_where_it_acts_on_nothing(
    run, experiment, submit, start, owner
):
    # a sync run: refused naming the field, nothing recorded
    with pytest.raises(InvalidInput) as refused:
        commands.create(owner, run, "set_params", {"params": {"pipeline.max_policy_lag": 3}})
    assert [e["field"] for e in refused.value.errors] == ["args.params.pipeline.max_policy_lag"]
    assert "pipeline.mode async" in refused.value.errors[0]["message"]
    assert not ConfigVersion.objects.filter(run=run).exists()
    assert commands.live_params(run) == ("pipeline.eval_interval", "trainer.lr")
    # an async run: it is live
    async_run = start(submit(experiment, rollout_workers=2))
    assert commands.live_params(async_run) == ("pipeline.max_policy_lag", "pipeline.eval_interval", "trainer.lr")
    commands.create(owner, async_run, "set_params", {"params": {"pipeline.max_policy_lag": 3}})
    assert commands.effective_params(async_run)["pipeline.max_policy_lag"] == 3


@pytest.mark.parametrize(
    ("params", "errors"),
    [
        (
            {"resources.trainer_devices": 4, "trainer.lr": 1e-5},
            [
                {
                    "field": "args.params.resources.trainer_devices",
                    "message": "not a live parameter; allowed: pipeline.max_policy_lag, pipeline.eval_interval, trainer.lr",
                }
            ],
        ),
        ({"trainer.lr": -1}, [{"field": "args.params.trainer.lr", "message": "Input should be greater than 0"}]),
        (
            {"pipeline.max_policy_lag": "many"},
            [
                {
                    "field": "args.params.pipeline.max_policy_lag",
                    "message": "Input should be a valid integer",
                }
            ],
        ),
        (
            {},
            [
                {
                    "field": "args.params",
                    "message": "give at least one of pipeline.max_policy_lag, pipeline.eval_interval, trainer.lr",
                }
            ],
        ),
    ],
)
def test_unsafe_or_invalid_params_are_refused_naming_the_field(run, owner, params, errors):
    with pytest.raises(InvalidInput) as exc:
        commands.create(owner, run, "set_params", {"params": params})

    assert exc.value.errors == errors
    assert (Command.objects.count(), ConfigVersion.objects.count()) == (0, 0)


def test_a_failed_param_change_leaves_the_effective_params(run, ingest, owner):
    command = commands.create(owner, run, "set_params", {"params": {"pipeline.eval_interval": 5}})

    post(ingest, "command_result", {"command": command.pk, "state": "failed", "message": "evaluator gone"})

    assert commands.effective_params(run)["pipeline.eval_interval"] == 10


# --- rollback and fork ---------------------------------------------------------------------------------


def test_rollback_to_another_runs_checkpoint_is_refused(run, other_run, owner):
    foreign = _checkpoint(other_run, 5)

    with pytest.raises(InvalidInput) as exc:
        commands.create(owner, run, "rollback", {"checkpoint": foreign.pk})

    assert exc.value.errors == [
        {
            "field": "args.checkpoint",
            "message": f"checkpoint {foreign.pk} belongs to run {other_run.pk}, not run {run.pk}",
        }
    ]
    assert Command.objects.count() == 0


def test_a_completed_rollback_marks_later_points_rewound_and_later_steps_start_afresh(run, ingest, owner):
    post(ingest, "metrics", batch(run, range(1, 7)))
    checkpoint = _checkpoint(run, 3)
    command = commands.create(owner, run, "rollback", {"checkpoint": checkpoint.pk})
    assert command.args == {"checkpoint": checkpoint.pk, "step": 3, "path": checkpoint.path, "weight_version": None}

    post(ingest, "command_result", {"command": command.pk, "state": "done", "message": "restored step 3"})

    assert stored(run) == {s: {"reward": s / 10} for s in (1, 2, 3)}
    assert stored(run, rewound=True) == {s: {"reward": s / 10} for s in (4, 5, 6)}
    # The trainer goes on from step 3: step 4 gets a live row of its own beside the rewound one.
    post(ingest, "metrics", batch(run, [4], lambda s: {"reward": 0.44}))
    assert stored(run)[4] == {"reward": 0.44}
    assert MetricPoint.objects.filter(run=run, step=4).count() == 2
    assert list(MetricPoint.objects.filter(run=run).live().values_list("step", flat=True)) == [1, 2, 3, 4]
    run.refresh_from_db()
    assert run.state == RunState.RUNNING


def test_a_failed_rollback_marks_nothing(run, ingest, owner):
    post(ingest, "metrics", batch(run, range(1, 5)))
    command = commands.create(owner, run, "rollback", {"checkpoint": _checkpoint(run, 2).pk})

    post(ingest, "command_result", {"command": command.pk, "state": "failed", "message": "checkpoint unreadable"})

    assert MetricPoint.objects.filter(rewound=True).count() == 0


def test_fork_submits_a_run_from_the_checkpoint_with_the_edited_spec(run, owner):
    checkpoint = _checkpoint(run, 8)

    command = commands.create(
        owner, run, "fork", {"checkpoint": checkpoint.pk, "overrides": ["trainer.lr=3e-5"], "name": "fork-of-tiny"}
    )

    child = Run.objects.exclude(pk=run.pk).get()
    assert (child.parent_checkpoint, child.name, child.experiment_id) == (
        checkpoint.path,
        "fork-of-tiny",
        run.experiment_id,
    )
    assert child.resolved_spec["trainer"]["lr"] == 3e-5
    assert child.state == RunState.ADMITTED  # the CPU group has room
    assert (command.state, command.message) == ("done", f"forked as run {child.pk}")
    assert command.args == {
        "checkpoint": checkpoint.pk,
        "step": 8,
        "path": checkpoint.path,
        "run": child.pk,
        "overrides": ["trainer.lr=3e-5"],
    }
    assert _audit(command) == [("command.create", "owner", run.experiment.team_id)]


def test_fork_with_a_bad_spec_or_a_foreign_checkpoint_creates_nothing(run, other_run, owner):
    checkpoint = _checkpoint(run, 8)
    with pytest.raises(InvalidInput) as exc:
        commands.create(owner, run, "fork", {"checkpoint": checkpoint.pk, "overrides": ["trainer.lr=-2"]})
    assert exc.value.errors == [{"field": "args.spec.trainer.lr", "message": "Input should be greater than 0"}]
    with pytest.raises(InvalidInput) as exc:
        commands.create(owner, run, "fork", {"checkpoint": _checkpoint(other_run, 1).pk})
    assert exc.value.errors[0]["field"] == "args.checkpoint"

    assert Run.objects.count() == 2
    assert Command.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_a_rollback_completing_while_a_replay_merges_later_rows_does_not_deadlock(run, client_for, owner):
    # Ingest locks the metric rows it merges, then the run's stream counter. Completing a rollback marks the
    # rows after its step rewound and streams the result: it must take the rows first too, or each of the
    # two would hold what the other waits for.
    import threading

    from django.db import connection, transaction

    from jobs import stream

    post(client_for(run), "metrics", batch(run, range(1, 7)))
    command = commands.create(owner, run, "rollback", {"checkpoint": _checkpoint(run, 3).pk})
    holding, errors = threading.Event(), []

    def merge_then_stream():  # what a replay of steps 5 and 6 with a new key does, slowed down in the middle
        try:
            with transaction.atomic():
                list(MetricPoint.objects.select_for_update().filter(run=run, step__gt=4))
                holding.set()
                time.sleep(1.0)  # the rollback's completion runs meanwhile and reaches its first wait
                stream.append(run.pk, "metrics", {"steps": [5, 6]})
        except Exception as exc:  # a deadlock is detected by PostgreSQL and aborts one of the two
            errors.append(exc)
        finally:
            connection.close()

    replay = threading.Thread(target=merge_then_stream)
    replay.start()
    try:
        assert holding.wait(timeout=30)
        commands.complete(run.pk, command.pk, "done", "restored step 3")
    finally:
        replay.join(timeout=60)
    assert errors == []
    assert stored(run, rewound=True) == {s: {"reward": s / 10} for s in (4, 5, 6)}
