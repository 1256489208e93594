"""Run controls, roles, events and config versions through the REST API; and what each change streams."""

from __future__ import annotations

import pytest

from jobs import commands
from jobs.ingest.tokens import mint_run_token
from jobs.models import Command, ConfigVersion, RoleHeartbeat, RunEvent, RunStreamEntry


def _stream(run, type_=None):
    qs = RunStreamEntry.objects.filter(run=run).order_by("seq")
    if type_:
        qs = qs.filter(type=type_)
    return [(e.type, e.data) for e in qs]


def test_editor_pauses_a_run(run, editor, api_as):
    response = api_as(editor).post(f"/api/runs/{run.pk}/commands/", {"kind": "pause"}, format="json")
    assert response.status_code == 201
    body = response.json()
    assert (body["kind"], body["state"], body["created_by"]) == ("pause", "pending", "editor")
    command = Command.objects.get(run=run)
    assert command.pk == body["id"]
    assert _stream(run, "command") == [
        ("command", {"id": command.pk, "kind": "pause", "state": "pending", "message": ""})
    ]


def test_viewer_cannot_command_and_nothing_changes(run, viewer, api_as):
    before = RunStreamEntry.objects.filter(run=run).count()
    response = api_as(viewer).post(f"/api/runs/{run.pk}/commands/", {"kind": "pause"}, format="json")
    assert response.status_code == 403
    assert Command.objects.filter(run=run).count() == 0
    assert RunStreamEntry.objects.filter(run=run).count() == before
    run.refresh_from_db()
    assert run.state == "RUNNING"


def test_other_team_cannot_see_or_command(run, outsider, api_as):
    client = api_as(outsider)
    assert client.post(f"/api/runs/{run.pk}/commands/", {"kind": "cancel"}, format="json").status_code == 404
    assert client.get(f"/api/runs/{run.pk}/commands/").status_code == 404
    for part in ("roles", "events", "config-versions", "checkpoints"):
        assert client.get(f"/api/runs/{run.pk}/{part}/").status_code == 404, part
    run.refresh_from_db()
    assert run.state == "RUNNING"
    assert Command.objects.count() == 0


@pytest.mark.parametrize(
    "payload, field",
    [
        ({"kind": "explode"}, "kind"),
        ({"kind": "pause", "args": {"now": True}}, "args.now"),
        ({"kind": "rollback", "args": {}}, "args.checkpoint"),
        ({"kind": "set_params", "args": {"params": {"trainer.lr": -1}}}, "args.params.trainer.lr"),
        ({"kind": "set_params", "args": {"params": {"model.name": "x"}}}, "args.params.model.name"),
        ({"args": {}}, "kind"),
    ],
)
def test_bad_command_is_400_naming_the_field(run, editor, api_as, payload, field):
    response = api_as(editor).post(f"/api/runs/{run.pk}/commands/", payload, format="json")
    assert response.status_code == 400
    assert field in [e["field"] for e in response.json()["errors"]]
    assert Command.objects.count() == 0


def test_illegal_command_is_409(run, editor, api_as):
    response = api_as(editor).post(f"/api/runs/{run.pk}/commands/", {"kind": "resume"}, format="json")
    assert response.status_code == 409
    assert Command.objects.count() == 0


def test_commands_list_newest_first(run, editor, viewer, api_as):
    commands.create(editor, run, "pause")
    commands.create(editor, run, "set_params", {"params": {"trainer.lr": 0.001}})
    body = api_as(viewer).get(f"/api/runs/{run.pk}/commands/").json()
    assert [c["kind"] for c in body["results"]] == ["set_params", "pause"]


def test_config_versions_with_diff(run, editor, viewer, api_as):
    lr = run.resolved_spec["trainer"]["lr"]
    commands.create(editor, run, "set_params", {"params": {"trainer.lr": 0.002}})
    commands.create(editor, run, "set_params", {"params": {"pipeline.eval_interval": 3}})
    body = api_as(viewer).get(f"/api/runs/{run.pk}/config-versions/").json()
    assert [v["number"] for v in body] == [0, 1, 2]
    assert body[1]["diff"] == {"trainer.lr": {"before": lr, "after": 0.002}}
    every = run.resolved_spec["pipeline"]["eval_interval"]
    assert body[2]["diff"] == {"pipeline.eval_interval": {"before": every, "after": 3}}
    assert body[2]["effective"]["trainer.lr"] == 0.002
    assert _stream(run, "config") == [
        ("config", {"number": 1, "params": {"trainer.lr": 0.002}}),
        ("config", {"number": 2, "params": {"pipeline.eval_interval": 3}}),
    ]


def test_a_failed_change_never_took_effect_in_the_api_or_on_the_run_page(run, editor, viewer, api_as, client):
    # Given two live changes of the learning rate, the first one failed on the runtime
    lr = run.resolved_spec["trainer"]["lr"]
    first = commands.create(editor, run, "set_params", {"params": {"trainer.lr": 0.002}})
    commands.create(editor, run, "set_params", {"params": {"trainer.lr": 0.003}})
    Command.objects.filter(pk=first.pk).update(state="failed")

    # Then both list it, and diff the second against the spec's value (jobs.config_history)
    body = api_as(viewer).get(f"/api/runs/{run.pk}/config-versions/").json()
    assert [(v["number"], v["state"], v["diff"]) for v in body[1:]] == [
        (1, "failed", {"trainer.lr": {"before": lr, "after": 0.002}}),
        (2, "pending", {"trainer.lr": {"before": lr, "after": 0.003}}),
    ]
    assert body[2]["effective"]["trainer.lr"] == 0.003
    client.force_login(viewer)
    page = client.get(f"/runs/{run.pk}/")
    assert page.status_code == 200
    assert [(v["number"], v["changes"]) for v in page.context["configs"]] == [
        (2, [{"param": "trainer.lr", "before": lr, "after": 0.003}]),
        (1, [{"param": "trainer.lr", "before": lr, "after": 0.002}]),
    ]


def _ingest(run, attempt=0):
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {mint_run_token(run, attempt)}")
    return client


def test_ingest_streams_metrics_events_checkpoints_once(run):
    client = _ingest(run)
    body = {
        "run": run.pk,
        "attempt": 0,
        "role": "trainer",
        "points": [{"step": 1, "time": 100.0, "metrics": {"reward/mean": 0.5}}],
        "events": [
            {"seq": 1, "kind": "checkpoint", "time": 101.0, "payload": {"step": 1, "path": f"run-{run.pk}/c/1"}}
        ],
    }
    assert client.post("/api/ingest/metrics", body, format="json").status_code == 200
    # A retried batch stores nothing new and streams nothing new
    assert client.post("/api/ingest/metrics", body, format="json").status_code == 200
    entries = [(t, d) for t, d in _stream(run) if t != "state"]
    assert [t for t, _ in entries] == ["metrics", "event", "checkpoint"]
    assert entries[0][1] == {"attempt": 0, "points": [{"step": 1, "time": 100.0, "values": {"reward/mean": 0.5}}]}
    assert entries[1][1]["kind"] == "checkpoint"
    assert entries[2][1]["step"] == 1 and entries[2][1]["id"] == run.checkpoints.get().pk
    assert RunEvent.objects.filter(run=run).count() == 1


def test_heartbeat_streams_role_news_only(run):
    client = _ingest(run)
    beat = {"run": run.pk, "attempt": 0, "role": "trainer", "status": "running", "info": {"host": "h1"}}
    for _ in range(3):
        assert client.post("/api/ingest/heartbeat", beat, format="json").status_code == 200
    assert client.post("/api/ingest/heartbeat", {**beat, "status": "stalled"}, format="json").status_code == 200
    roles = _stream(run, "role")
    assert [(d["role"], d["status"], d["host"]) for _, d in roles] == [
        ("trainer", "running", "h1"),
        ("trainer", "stalled", "h1"),
    ]


def test_rollback_done_streams_command_and_rewound(run, editor):
    from jobs.models import CheckpointRecord

    record = CheckpointRecord.objects.create(run=run, step=5, path="ckpt/5")
    command = commands.create(editor, run, "rollback", {"checkpoint": record.pk})
    commands.complete(run.pk, command.pk, "done", "rolled back")
    tail = [(t, d) for t, d in _stream(run) if t != "state"]
    assert tail == [
        ("command", {"id": command.pk, "kind": "rollback", "state": "pending", "message": ""}),
        ("command", {"id": command.pk, "kind": "rollback", "state": "done", "message": "rolled back"}),
        ("rewound", {"after_step": 5}),
    ]


def test_state_changes_are_streamed_gap_free(experiment, submit, start):
    run = start(submit(experiment))
    seqs = list(RunStreamEntry.objects.filter(run=run).order_by("seq").values_list("seq", flat=True))
    states = [d["state"] for _, d in _stream(run, "state")]
    assert states == ["ADMITTED", "STARTING", "RUNNING"]
    assert seqs == [1, 2, 3]


def test_roles_table(run, viewer, api_as):
    RoleHeartbeat.objects.create(run=run, role="trainer", attempt=0, status="lost", info={"host": "h1"})
    RoleHeartbeat.objects.create(
        run=run, role="trainer", attempt=1, status="running", info={"host": "h2", "devices": [0], "log_tail": "ok"}
    )
    body = api_as(viewer).get(f"/api/runs/{run.pk}/roles/").json()
    assert [(r["role"], r["attempt"], r["host"], r["devices"], r["restarts"], r["log_tail"]) for r in body] == [
        ("trainer", 1, "h2", [0], 1, "ok")
    ]


def test_events_list(run, viewer, api_as):
    client = _ingest(run)
    events = [{"seq": i, "kind": "eval" if i % 2 else "note", "time": 100.0 + i, "payload": {"i": i}} for i in range(4)]
    client.post("/api/ingest/metrics", {"run": run.pk, "attempt": 0, "events": events}, format="json")
    body = api_as(viewer).get(f"/api/runs/{run.pk}/events/?kind=eval").json()
    assert [e["payload"]["i"] for e in body["results"]] == [1, 3]


def test_set_params_by_viewer_is_403_and_records_nothing(run, viewer, api_as):
    payload = {"kind": "set_params", "args": {"params": {"trainer.lr": 0.1}}}
    assert api_as(viewer).post(f"/api/runs/{run.pk}/commands/", payload, format="json").status_code == 403
    assert ConfigVersion.objects.count() == 0


def test_roles_table_shows_launched_roles_with_their_log_tail(run, viewer, api_as, settings, tmp_path):
    from jobs.lifecycle import files
    from jobs.models import RunRole

    settings.TANDEM_CHECKPOINT_ROOT = tmp_path
    device = run.allocations.get().device
    role = RunRole.objects.create(
        run=run,
        name="trainer-0",
        host=device.host,
        device_indices=[device.index],
        attempt=1,
        restarts=1,
        state="running",
        workdir=str(files.run_dir(run.pk)),
    )
    log = files.role_dir(role) / "log"
    log.parent.mkdir(parents=True)
    log.write_text("x" * 10_000 + "step 7 done\n")
    RoleHeartbeat.objects.create(run=run, role="trainer-0", attempt=1, status="paused", info={})
    body = api_as(viewer).get(f"/api/runs/{run.pk}/roles/").json()
    assert [
        (r["role"], r["attempt"], r["status"], r["process"], r["host"], r["devices"], r["restarts"]) for r in body
    ] == [("trainer-0", 1, "paused", "running", device.host.name, [device.index], 1)]
    assert body[0]["log_tail"].endswith("step 7 done\n") and len(body[0]["log_tail"]) == 4096
