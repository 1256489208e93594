"""Checkpoint browser: listing, streamed download, paths that leave the root, pin / unpin / delete, retention."""

from __future__ import annotations

import os

import pytest
from django.http import FileResponse

from jobs import checkpoints
from jobs.models import CheckpointRecord, Command
from jobs.tasks import apply_checkpoint_retention
from rlplatform.models import AuditLog


def _checkpoint(run, root, step, *, metrics=None, pinned=False, files=None):
    path = f"run-{run.pk}/step-{step}"
    directory = root / path
    directory.mkdir(parents=True)
    for name, content in (files or {"model.safetensors": b"weights-%d" % step}).items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(content)
    return CheckpointRecord.objects.create(
        run=run, step=step, path=path, weight_version=step, size=10, metrics=metrics or {}, pinned=pinned
    )


def test_list_shows_files_and_pins(run, viewer, api_as, checkpoint_root):
    _checkpoint(run, checkpoint_root, 10, metrics={"reward/mean": 0.5})
    _checkpoint(run, checkpoint_root, 20, files={"model.safetensors": b"abc", "optim/state.pt": b"12345"}, pinned=True)
    body = api_as(viewer).get(f"/api/runs/{run.pk}/checkpoints/").json()
    assert [(c["step"], c["pinned"]) for c in body] == [(20, True), (10, False)]
    assert body[0]["files"] == [{"path": "model.safetensors", "size": 3}, {"path": "optim/state.pt", "size": 5}]
    assert body[1]["metrics"] == {"reward/mean": 0.5}


def test_download_streams_the_file(run, viewer, api_as, checkpoint_root):
    record = _checkpoint(run, checkpoint_root, 10, files={"sub/model.safetensors": b"x" * 100_000})
    response = api_as(viewer).get(f"/api/checkpoints/{record.pk}/files/sub/model.safetensors/")
    assert response.status_code == 200
    assert isinstance(response, FileResponse) and response.streaming
    assert b"".join(response.streaming_content) == b"x" * 100_000
    assert 'filename="model.safetensors"' in response["Content-Disposition"]


def test_download_without_trailing_slash_redirects_to_it(run, viewer, api_as, checkpoint_root):
    record = _checkpoint(run, checkpoint_root, 10)
    response = api_as(viewer).get(f"/api/checkpoints/{record.pk}/files/model.safetensors", follow=True)
    assert response.status_code == 200
    assert b"".join(response.streaming_content) == b"weights-10"


@pytest.mark.parametrize("attack", ["../step-20/model.safetensors", "../../outside.txt", "%2e%2e/%2e%2e/outside.txt"])
def test_paths_leaving_the_checkpoint_are_404(run, viewer, api_as, checkpoint_root, attack):
    record = _checkpoint(run, checkpoint_root, 10)
    _checkpoint(run, checkpoint_root, 20)
    (checkpoint_root.parent / "outside.txt").write_text("secret")
    response = api_as(viewer).get(f"/api/checkpoints/{record.pk}/files/{attack}/")
    assert response.status_code == 404


def test_absolute_path_and_symlink_out_are_404(run, viewer, api_as, checkpoint_root, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("secret")
    record = _checkpoint(run, checkpoint_root, 10)
    os.symlink(secret, checkpoint_root / record.path / "link.txt")
    client = api_as(viewer)
    assert client.get(f"/api/checkpoints/{record.pk}/files/link.txt/").status_code == 404
    assert client.get(f"/api/checkpoints/{record.pk}/files/{secret}/").status_code == 404
    assert client.get(f"/api/checkpoints/{record.pk}/files//{secret}/").status_code == 404
    assert [f["path"] for f in checkpoints.files(record)] == ["model.safetensors"]  # the link is not listed


def test_checkpoint_recorded_outside_the_root_serves_nothing(run, viewer, api_as, checkpoint_root, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "model.safetensors").write_bytes(b"w")
    record = CheckpointRecord.objects.create(run=run, step=1, path=str(elsewhere))
    assert api_as(viewer).get(f"/api/checkpoints/{record.pk}/files/model.safetensors/").status_code == 404
    assert checkpoints.files(record) == []


def test_other_team_gets_404_for_everything(run, outsider, api_as, checkpoint_root):
    record = _checkpoint(run, checkpoint_root, 10)
    client = api_as(outsider)
    assert client.get(f"/api/checkpoints/{record.pk}/").status_code == 404
    assert client.get(f"/api/checkpoints/{record.pk}/files/model.safetensors/").status_code == 404
    assert client.post(f"/api/checkpoints/{record.pk}/pin/").status_code == 404
    assert client.delete(f"/api/checkpoints/{record.pk}/").status_code == 404
    record.refresh_from_db()
    assert record.pinned is False
    assert (checkpoint_root / record.path).is_dir()


def test_pin_unpin_delete(run, editor, api_as, checkpoint_root, django_capture_on_commit_callbacks):
    record = _checkpoint(run, checkpoint_root, 10)
    client = api_as(editor)
    assert client.post(f"/api/checkpoints/{record.pk}/pin/").json()["pinned"] is True
    # A pinned checkpoint cannot be deleted
    assert client.delete(f"/api/checkpoints/{record.pk}/").status_code == 409
    assert CheckpointRecord.objects.filter(pk=record.pk).exists()
    assert client.post(f"/api/checkpoints/{record.pk}/unpin/").json()["pinned"] is False
    with django_capture_on_commit_callbacks(execute=True):  # files go after commit
        response = client.delete(f"/api/checkpoints/{record.pk}/")
    assert response.status_code == 204
    assert not CheckpointRecord.objects.filter(pk=record.pk).exists()
    assert not (checkpoint_root / record.path).exists()
    assert list(
        AuditLog.objects.filter(target_type="jobs.checkpointrecord").order_by("pk").values_list("action", flat=True)
    ) == [
        "checkpoint.pin",
        "checkpoint.unpin",
        "checkpoint.delete",
    ]


def test_viewer_cannot_pin_or_delete(run, viewer, api_as, checkpoint_root):
    record = _checkpoint(run, checkpoint_root, 10)
    client = api_as(viewer)
    assert client.post(f"/api/checkpoints/{record.pk}/pin/").status_code == 403
    assert client.delete(f"/api/checkpoints/{record.pk}/").status_code == 403
    record.refresh_from_db()
    assert record.pinned is False
    assert (checkpoint_root / record.path / "model.safetensors").is_file()


def test_retention_keeps_last_n_best_and_pinned(run, checkpoint_root, django_capture_on_commit_callbacks):
    run.resolved_spec["checkpoint"] = {"keep_last": 2, "keep_best_metric": "reward/mean", "keep_best_mode": "max"}
    run.save(update_fields=["resolved_spec"])
    rewards = {10: 0.1, 20: 0.9, 30: 0.2, 40: 0.3, 50: 0.4, 60: 0.5}
    records = {s: _checkpoint(run, checkpoint_root, s, metrics={"reward/mean": r}) for s, r in rewards.items()}
    CheckpointRecord.objects.filter(pk=records[10].pk).update(pinned=True)
    # A pending rollback to step 30 keeps it too
    Command.objects.create(run=run, kind="rollback", args={"checkpoint": records[30].pk, "step": 30})

    with django_capture_on_commit_callbacks(execute=True):
        assert apply_checkpoint_retention() == 1
    kept = sorted(CheckpointRecord.objects.filter(run=run).values_list("step", flat=True))
    assert kept == [10, 20, 30, 50, 60]  # pinned, best, rollback target, last two
    assert not (checkpoint_root / records[40].path).exists()
    assert (checkpoint_root / records[20].path).is_dir()
    # Applying again deletes nothing more
    assert apply_checkpoint_retention() == 0


def test_retention_min_mode(run, checkpoint_root):
    run.resolved_spec["checkpoint"] = {"keep_last": 1, "keep_best_metric": "loss", "keep_best_mode": "min"}
    run.save(update_fields=["resolved_spec"])
    for step, loss in ((1, 0.5), (2, 0.1), (3, 0.7), (4, 0.9)):
        _checkpoint(run, checkpoint_root, step, metrics={"loss": loss})
    checkpoints.apply_retention(run)
    assert sorted(CheckpointRecord.objects.filter(run=run).values_list("step", flat=True)) == [2, 4]
