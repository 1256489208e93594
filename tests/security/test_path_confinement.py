"""Paths are confined (issue 13, cross-team access 1 and 2).

A run token records checkpoints only inside its run's own directory; the checkpoint browser, delete
and retention act on nothing outside it, even for a record stored before ingest refused such paths;
a spec (and a fork's parent checkpoint) names only files its team may read, refused at submit with
one message whether or not the file exists.
"""

from __future__ import annotations

import os

import pytest

from jobs import checkpoints, confinement, handler
from jobs.handler import InvalidInput
from jobs.models import CheckpointRecord, MetricPoint, Run, RunEvent
from rlplatform.models import AuditLog
from tests.ingest.helpers import batch, post

OUTSIDE_RUN = "must be inside this run's own directory (run-<id> under the checkpoint root)"
OUTSIDE_TEAM = "is not inside this team's run directories, its data roots or the shared model root"


@pytest.fixture
def theirs(experiment_b, outsider, submit, start):
    """Team B's RUNNING run."""
    return start(submit(experiment_b, actor=outsider))


@pytest.fixture
def their_checkpoint(theirs, checkpoint_root):
    """Team B's checkpoint on disk: ``run-<id>/checkpoints/step-10`` with an exported policy."""
    directory = checkpoint_root / f"run-{theirs.pk}" / "checkpoints" / "step-10"
    (directory / "policy").mkdir(parents=True)
    (directory / "policy" / "config.json").write_text('{"secret": true}')
    (directory / "model.safetensors").write_bytes(b"their-weights")
    return directory


def _records():
    return sorted(CheckpointRecord.objects.values_list("run_id", "step", "path"))


# --- 1. checkpoint records stay inside the run's own directory -------------------------------------------


ESCAPES = {
    "relative into their run": "run-{theirs}/checkpoints/step-10",
    "absolute into their run": "{root}/run-{theirs}/checkpoints/step-10",
    "dot-dot out of ours": "run-{ours}/../run-{theirs}/checkpoints/step-10",
    "symlink out of ours": "run-{ours}/checkpoints/link/step-10",
    "a sibling named like ours": "run-{ours}0/step-10",
    "the checkpoint root itself": ".",
    "elsewhere": "/etc",
}


def _escape(name, run, theirs, root):
    own = root / f"run-{run.pk}" / "checkpoints"
    own.mkdir(parents=True, exist_ok=True)
    if not (own / "link").exists():
        os.symlink(root / f"run-{theirs.pk}" / "checkpoints", own / "link")
    return ESCAPES[name].format(ours=run.pk, theirs=theirs.pk, root=root)


@pytest.mark.parametrize("name", ESCAPES)
def test_a_checkpoint_outside_the_runs_directory_is_refused_and_nothing_is_stored(
    run, ingest, theirs, their_checkpoint, checkpoint_root, name
):
    path = _escape(name, run, theirs, checkpoint_root)

    response = post(ingest, "checkpoints", {"step": 99, "path": path})

    assert response.status_code == 400
    assert response.json() == {"errors": [{"field": "path", "message": OUTSIDE_RUN}]}
    assert _records() == []
    assert (their_checkpoint / "model.safetensors").read_bytes() == b"their-weights"


def test_a_checkpoint_event_outside_the_runs_directory_fails_the_whole_batch(
    run, ingest, theirs, their_checkpoint, checkpoint_root
):
    event = {"seq": 1, "kind": "checkpoint", "payload": {"step": 10, "path": f"run-{theirs.pk}/checkpoints/step-10"}}

    response = post(ingest, "metrics", batch(run, [10], events=[event]))

    assert response.status_code == 400
    assert response.json() == {"errors": [{"field": "events[0].payload.path", "message": OUTSIDE_RUN}]}
    assert (_records(), MetricPoint.objects.count(), RunEvent.objects.count()) == ([], 0, 0)


def test_a_rollback_cannot_move_a_checkpoint_record_into_another_run(run, ingest, theirs, checkpoint_root):
    # An own record whose path, set aside, would land in team B's run (``parents[2]`` of the new path).
    own = f"run-{run.pk}/checkpoints/../step-4"
    CheckpointRecord.objects.create(run=run, step=4, path=own)
    moved = f"run-{run.pk}/checkpoints/../../run-{theirs.pk}/step-4"
    event = {"seq": 1, "kind": "rollback", "payload": {"step": 2, "set_aside": [moved]}}

    response = post(ingest, "metrics", batch(run, [], events=[event]))

    assert response.status_code == 400
    assert response.json() == {"errors": [{"field": "events[0].payload.set_aside[0]", "message": OUTSIDE_RUN}]}
    assert _records() == [(run.pk, 4, own)]


def test_checkpoints_inside_the_runs_own_directory_are_recorded_and_browsable(
    run, ingest, viewer, api_as, checkpoint_root
):
    step_10 = checkpoint_root / f"run-{run.pk}" / "checkpoints" / "step-10"
    step_10.mkdir(parents=True)
    (step_10 / "model.safetensors").write_bytes(b"ours")
    event = {"seq": 1, "kind": "checkpoint", "payload": {"step": 20, "path": f"run-{run.pk}/checkpoints/step-20"}}

    registered = post(ingest, "checkpoints", {"step": 10, "path": str(step_10)})
    reported = post(ingest, "metrics", batch(run, [20], events=[event]))

    assert (registered.status_code, reported.status_code) == (200, 200)
    assert _records() == [(run.pk, 10, str(step_10)), (run.pk, 20, f"run-{run.pk}/checkpoints/step-20")]
    record = CheckpointRecord.objects.get(step=10)
    response = api_as(viewer).get(f"/api/checkpoints/{record.pk}/files/model.safetensors/")
    assert b"".join(response.streaming_content) == b"ours"


def _foreign_record(run, theirs):
    """A record of team A's run pointing into team B's run, as ingest stored it before the fix."""
    return CheckpointRecord.objects.create(run=run, step=99, path=f"run-{theirs.pk}/checkpoints/step-10")


def test_a_stored_record_pointing_into_another_run_lists_serves_and_deletes_nothing(
    run, theirs, their_checkpoint, owner, api_as, django_capture_on_commit_callbacks
):
    record = _foreign_record(run, theirs)
    client = api_as(owner)

    listed = client.get(f"/api/runs/{run.pk}/checkpoints/").json()
    download = client.get(f"/api/checkpoints/{record.pk}/files/model.safetensors/")
    with django_capture_on_commit_callbacks(execute=True):
        deleted = client.delete(f"/api/checkpoints/{record.pk}/")

    assert [(c["step"], c["files"]) for c in listed] == [(99, [])]
    assert (download.status_code, deleted.status_code) == (404, 204)
    assert not CheckpointRecord.objects.filter(pk=record.pk).exists()
    assert sorted(p.name for p in their_checkpoint.iterdir()) == ["model.safetensors", "policy"]


def test_retention_drops_a_record_pointing_into_another_run_but_not_its_files(
    run, theirs, their_checkpoint, django_capture_on_commit_callbacks
):
    run.resolved_spec["checkpoint"] = {"keep_last": 1}
    run.save(update_fields=["resolved_spec"])
    record = _foreign_record(run, theirs)
    CheckpointRecord.objects.create(run=run, step=100, path=f"run-{run.pk}/checkpoints/step-100")

    with django_capture_on_commit_callbacks(execute=True):
        assert checkpoints.apply_retention(run) == [record.pk]

    assert (their_checkpoint / "model.safetensors").read_bytes() == b"their-weights"


# --- 2. spec paths name only what the team may read -------------------------------------------------------


def _spec(field, path):
    section, name = field.split(".")
    extra = {"model": "", "task": "  name: jsonl\n", "agent": ""}[section]
    if field == "task.eval_path":
        extra += "  path: /no-data-root/train.jsonl\n"  # refused too: the error list names both fields
    workload = "workload: gym\nenv:\n  id: CartPole-v1\n" if section == "agent" else ""
    return f"name: probe\n{workload}{section}:\n{extra}  {name}: {path}\n"


def _submit(as_user, owner, team_a, spec, **extra):
    return as_user(owner, team_a).post("/api/runs/", {"experiment": "exp-a", "spec": spec, **extra}, format="json")


@pytest.mark.parametrize("field", ["model.path", "task.path", "task.eval_path", "agent.init_path"])
def test_a_spec_path_into_another_teams_run_is_refused_alike_whether_it_exists_or_not(
    as_user, owner, team_a, experiment, their_checkpoint, field
):
    existing = their_checkpoint / ("policy" if field == "model.path" else "policy/config.json")
    missing = their_checkpoint / "no-such-file"
    runs_before = Run.objects.count()

    replies = [_submit(as_user, owner, team_a, _spec(field, path)) for path in (existing, missing)]

    assert [r.status_code for r in replies] == [400, 400]
    assert replies[0].content == replies[1].content
    assert {"field": field, "message": OUTSIDE_TEAM} in replies[0].json()["errors"]
    assert Run.objects.count() == runs_before


def test_paths_outside_every_root_are_refused_alike_whether_they_exist_or_not(
    as_user, owner, team_a, experiment, checkpoint_root
):
    replies = [_submit(as_user, owner, team_a, _spec("model.path", p)) for p in ("/etc", "/no-such-dir")]

    assert [r.json() for r in replies] == [{"errors": [{"field": "model.path", "message": OUTSIDE_TEAM}]}] * 2


def test_a_symlink_in_the_teams_data_root_into_another_teams_run_is_refused(
    as_user, owner, team_a, experiment, their_checkpoint, tmp_path
):
    data = tmp_path / "team-a-data"
    data.mkdir()
    os.symlink(their_checkpoint / "policy", data / "borrowed")
    team_a.data_roots = [str(data), str(tmp_path)]  # a root drawn around the checkpoint root opens no run
    team_a.save()
    runs_before = Run.objects.count()

    for path in (data / "borrowed", their_checkpoint / "policy"):
        response = _submit(as_user, owner, team_a, _spec("model.path", path))
        assert response.json() == {"errors": [{"field": "model.path", "message": OUTSIDE_TEAM}]}
    assert Run.objects.count() == runs_before


def test_a_link_changed_after_submit_is_refused_when_the_role_starts(
    owner, team_a, experiment, their_checkpoint, checkpoint_root, tmp_path, django_capture_on_commit_callbacks
):
    """The paths are checked again when a role starts: a link under the team's data root, re-pointed into
    another team's run after the submit, fails the run as bad input and starts no process."""
    from jobs import launch, supervisor
    from jobs.lifecycle import files
    from jobs.models import RoleState
    from jobs.states import RunState

    data = tmp_path / "team-a-data"
    (data / "model").mkdir(parents=True)
    (data / "model" / "config.json").write_text("{}")  # a model directory, so the submit's file check passes
    os.symlink(data / "model", data / "current")
    team_a.data_roots = [str(data)]
    team_a.save()
    run, _ = handler.submit_run(owner, experiment, _spec("model.path", data / "current"))
    assert run.state == RunState.ADMITTED
    with django_capture_on_commit_callbacks(execute=False):
        role = launch.launch_run(run.pk)
    os.remove(data / "current")
    os.symlink(their_checkpoint / "policy", data / "current")  # after the submit's check

    assert supervisor.start_role(role.pk, 0) == "refused"
    run.refresh_from_db()
    role.refresh_from_db()
    assert run.state == RunState.FAILED
    assert run.reason == f"trainer-0 rejected its input: model.path: {OUTSIDE_TEAM}"
    assert (role.state, role.exit_code, role.pid, role.restarts) == (RoleState.EXITED, 2, None, 0)
    assert not (files.role_dir(role) / "pid").exists()


def test_the_shared_model_root_the_teams_data_roots_and_its_own_runs_are_readable(
    as_user, owner, team_a, experiment, run, checkpoint_root, tmp_path, settings
):
    settings.TANDEM_SHARED_MODEL_ROOT = tmp_path / "shared"
    team_a.data_roots = [str(tmp_path / "team-a-data")]
    team_a.save()
    paths = {
        "shared": ("model.path", tmp_path / "shared" / "qwen"),
        "data root": ("task.path", tmp_path / "team-a-data" / "train.jsonl"),
        "own run": ("model.path", checkpoint_root / f"run-{run.pk}" / "checkpoints" / "step-5" / "policy"),
    }

    replies = {key: _submit(as_user, owner, team_a, _spec(*value)) for key, value in paths.items()}

    assert {key: r.status_code for key, r in replies.items()} == {"shared": 201, "data root": 201, "own run": 201}
    stored = Run.objects.exclude(pk=run.pk).order_by("pk")
    assert [(r.resolved_spec["model"]["path"], r.resolved_spec["task"]["path"]) for r in stored] == [
        (str(paths["shared"][1]), None),
        (None, str(paths["data root"][1])),
        (str(paths["own run"][1]), None),
    ]


def test_a_fork_from_the_teams_own_checkpoint_is_accepted(run, editor, api_as, checkpoint_root):
    record = CheckpointRecord.objects.create(run=run, step=8, path=f"run-{run.pk}/checkpoints/step-8")

    response = api_as(editor).post(
        f"/api/runs/{run.pk}/commands/", {"kind": "fork", "args": {"checkpoint": record.pk}}, format="json"
    )

    assert response.status_code == 201, response.content
    child = Run.objects.exclude(pk=run.pk).get()
    assert child.parent_checkpoint == record.path


def test_a_fork_from_another_teams_checkpoint_is_refused(owner, experiment, theirs, their_checkpoint):
    with pytest.raises(InvalidInput) as exc:
        handler.submit_run(owner, experiment, "name: fork\n", parent_checkpoint=f"run-{theirs.pk}/checkpoints/step-10")

    assert exc.value.errors == [{"field": "parent_checkpoint", "message": OUTSIDE_TEAM}]
    assert Run.objects.count() == 1


def test_every_path_field_of_the_spec_is_confined():
    assert confinement.SPEC_PATH_FIELDS == (
        "model.path",
        "model.lora.init_path",
        "task.path",
        "task.eval_path",
        "agent.init_path",
    )


def test_an_admin_sets_a_teams_data_roots_absolute_only_and_audited(team_a, superuser, client):
    client.force_login(superuser)
    url = f"/admin/rlplatform/team/{team_a.pk}/change/"
    form = {"name": "team-a", "description": "", "memberships-TOTAL_FORMS": 0, "memberships-INITIAL_FORMS": 0}

    refused = client.post(url, {**form, "data_roots": '["relative/data"]'})
    accepted = client.post(url, {**form, "data_roots": '["/data/team-a"]'})

    assert (refused.status_code, accepted.status_code) == (200, 302)  # 200: the form again, with its error
    assert "&#x27;relative/data&#x27; is not an absolute path" in refused.content.decode()
    team_a.refresh_from_db()
    assert team_a.data_roots == ["/data/team-a"]
    entry = AuditLog.objects.get(action="team.update")
    assert (entry.before["data_roots"], entry.after["data_roots"]) == ([], ["/data/team-a"])
