"""The ingest API: idempotent bulk metric storage, events, checkpoints, heartbeats, and refusals that store nothing."""

from __future__ import annotations

import datetime

import pytest
from django.utils import timezone

from jobs.models import CheckpointRecord, MetricPoint, RoleHeartbeat, RunEvent, RunToken
from tests.ingest.helpers import batch, post, stored


def test_a_batch_stores_one_row_per_step_and_its_events(run, ingest):
    body = batch(run, [1, 2, 3], lambda s: {"reward": s / 10, "loss": 1.0 - s / 10})
    body["events"] = [{"seq": 3, "time": 1_700_000_003.5, "kind": "eval", "payload": {"step": 3, "acc": 0.5}}]

    resp = post(ingest, "metrics", body)

    assert resp.status_code == 200, resp.content
    assert resp.json() == {
        "points": {"inserted": 3, "merged": 0, "unchanged": 0},
        "events": 1,
        "commands": [],
    }
    assert stored(run) == {
        1: {"reward": 0.1, "loss": 0.9},
        2: {"reward": 0.2, "loss": 0.8},
        3: {"reward": 0.3, "loss": 0.7},
    }
    point = MetricPoint.objects.get(run=run, step=2)
    assert point.time == datetime.datetime.fromtimestamp(1_700_000_002.0, tz=datetime.UTC)
    (event,) = RunEvent.objects.filter(run=run)
    assert (event.attempt, event.role, event.seq, event.kind, event.payload) == (
        0,
        "trainer-0",
        3,
        "eval",
        {"step": 3, "acc": 0.5},
    )


def test_the_same_batch_twice_stores_each_point_once_with_equal_values(run, ingest):
    body = batch(run, range(10), lambda s: {"reward": s * 0.5, "kl": None})
    body["events"] = [{"seq": 10, "kind": "resume", "payload": {"step": 0}}]
    first = post(ingest, "metrics", body)

    second = post(ingest, "metrics", body)

    assert first.status_code == second.status_code == 200
    assert second.json()["points"] == {"inserted": 0, "merged": 0, "unchanged": 10}
    assert MetricPoint.objects.filter(run=run).count() == 10
    assert stored(run) == {s: {"reward": s * 0.5, "kl": None} for s in range(10)}
    assert RunEvent.objects.filter(run=run).count() == 1


def test_partly_overlapping_batches_merge_new_keys_and_keep_first_values(run, ingest):
    post(ingest, "metrics", batch(run, [1, 2, 3], lambda s: {"reward": float(s)}))

    # Steps 2 and 3 again (a retry), with a changed reward (ignored) and a new key at 3; steps 4, 5 new.
    resp = post(
        ingest,
        "metrics",
        batch(run, [2, 3, 4, 5], lambda s: {"reward": 100.0 + s} | ({"eval/acc": 0.75} if s == 3 else {})),
    )

    assert resp.json()["points"] == {"inserted": 2, "merged": 1, "unchanged": 1}
    assert stored(run) == {
        1: {"reward": 1.0},
        2: {"reward": 2.0},
        3: {"reward": 3.0, "eval/acc": 0.75},
        4: {"reward": 104.0},
        5: {"reward": 105.0},
    }


def test_one_step_twice_in_a_batch_is_one_row(run, ingest):
    body = batch(run, [7])
    body["points"].append({"seq": 9, "step": 7, "metrics": {"reward": 9.9, "lr": 0.001}})

    assert post(ingest, "metrics", body).status_code == 200
    assert stored(run) == {7: {"reward": 0.7, "lr": 0.001}}


def test_attempts_are_kept_apart(run, client_for):
    post(client_for(run, 0), "metrics", batch(run, [1], attempt=0))
    post(client_for(run, 1), "metrics", batch(run, [1], lambda s: {"reward": -1.0}, attempt=1))

    assert stored(run, 0) == {1: {"reward": 0.1}}
    assert stored(run, 1) == {1: {"reward": -1.0}}


# --- refusals store nothing ---------------------------------------------------------------------------


def _nothing_stored():
    return (
        MetricPoint.objects.count(),
        RunEvent.objects.count(),
        CheckpointRecord.objects.count(),
        RoleHeartbeat.objects.count(),
    ) == (0, 0, 0, 0)


@pytest.mark.parametrize("how", ["missing", "garbage", "wrong secret", "expired", "revoked", "api token", "basic"])
def test_a_bad_token_gets_401_and_stores_nothing(run, how, owner, team_a):
    from rest_framework.test import APIClient

    from jobs.ingest.tokens import mint_run_token, revoke_run_tokens
    from rlplatform import tokens

    client = APIClient()
    raw = mint_run_token(run, 0)
    header = {
        "missing": None,
        "garbage": "Bearer nonsense",
        "wrong secret": f"Bearer {raw[:-4]}AAAA",
        "expired": f"Bearer {raw}",
        "revoked": f"Bearer {raw}",
        "api token": f"Bearer {tokens.mint(owner, team_a, 'ci')[1]}",
        "basic": "Basic b3duZXI6b3duZXItcGFzcy0xMjM=",
    }[how]
    if how == "expired":
        RunToken.objects.update(expires_at=timezone.now() - datetime.timedelta(seconds=1))
    if how == "revoked":
        revoke_run_tokens(run)
    if header:
        client.credentials(HTTP_AUTHORIZATION=header)
    body = batch(run, [1, 2])
    body["events"] = [{"seq": 2, "kind": "checkpoint", "payload": {"step": 2, "path": "/ckpt/step-2"}}]

    for endpoint, payload in [
        ("metrics", body),
        ("checkpoints", {"step": 2, "path": "/ckpt/step-2"}),
        ("heartbeat", {"role": "trainer-0"}),
    ]:
        resp = post(client, endpoint, payload)
        assert resp.status_code == 401, (endpoint, resp.content)
    assert _nothing_stored()


@pytest.mark.parametrize(
    ("mutate", "field", "message"),
    [
        (lambda b: b["points"][3].update(step=-1), "points[3].step", "must be a non-negative integer"),
        (lambda b: b["points"][3].update(step="4"), "points[3].step", "must be a non-negative integer"),
        (lambda b: b["points"][3].update(step=True), "points[3].step", "must be a non-negative integer"),
        (lambda b: b["points"][0].pop("metrics"), "points[0].metrics", "must be an object of name: number"),
        (
            lambda b: b["points"][1]["metrics"].update(reward="high"),
            "points[1].metrics.reward",
            "must be a finite number or null",
        ),
        (lambda b: b["points"][2].update(time="yesterday"), "points[2].time", "must be a Unix time in seconds"),
        (lambda b: b["points"][2].update(time=1e20), "points[2].time", "must be a Unix time in seconds"),
        (
            lambda b: b["points"][1]["metrics"].update(big=10**30),
            "points[1].metrics.big",
            "must be a finite number or null",
        ),
        (
            # NUL characters are refused by the API's input boundary (rlplatform/input_boundary.py), before the handler.
            lambda b: b["points"][1]["metrics"].update({"a\x00b": 1}),
            "points.1.metrics",
            r"a key contains a NUL character (\u0000)",
        ),
        (
            lambda b: b["events"].append({"seq": 1, "kind": "eval", "payload": {"note": "a\x00"}}),
            "events.0.payload.note",
            r"contains a NUL character (\u0000)",
        ),
        (lambda b: b.update(points={"step": 1}), "points", "must be a list"),
        (
            lambda b: b["events"].append({"seq": 1, "payload": {}}),
            "events[0].kind",
            "must be a string of 1 to 50 characters",
        ),
        (lambda b: b["events"].append({"seq": -3, "kind": "eval"}), "events[0].seq", "must be a non-negative integer"),
        (lambda b: b.update(attempt=-1), "attempt", "must be a non-negative integer"),
        (lambda b: b.update(role=7), "role", "must be a string of 0 to 100 characters"),
    ],
)
def test_a_malformed_batch_gets_400_naming_the_field_and_stores_nothing(run, ingest, mutate, field, message):
    body = batch(run, [1, 2, 3, 4, 5])
    body["events"] = []
    mutate(body)
    path = f"run-{run.pk}/checkpoints/step-5"  # inside the run's own directory: only the mutation is wrong
    body["events"].append({"seq": 99, "kind": "checkpoint", "payload": {"step": 5, "path": path}})

    resp = post(ingest, "metrics", body)

    assert resp.status_code == 400
    assert resp.json() == {"errors": [{"field": field, "message": message}]}
    assert _nothing_stored()


def test_a_body_that_is_not_an_object_or_not_json_gets_400(run, ingest):
    assert post(ingest, "metrics", [1, 2]).json() == {"errors": [{"field": "body", "message": "must be a JSON object"}]}
    resp = ingest.post(
        "/api/ingest/metrics", b'{"points": [{"step": 1, "metrics": {"x": NaN}}]}', content_type="application/json"
    )
    assert resp.status_code == 400
    assert _nothing_stored()


def test_a_token_of_one_run_cannot_write_to_another(run, other_run, client_for):
    token_a = client_for(run)

    resp = post(token_a, "metrics", batch(other_run, [1, 2]))
    wrong_attempt = post(token_a, "metrics", batch(run, [1, 2], attempt=1))
    ack = post(token_a, "heartbeat", {"run": other_run.pk, "role": "trainer-0"})

    assert resp.status_code == wrong_attempt.status_code == ack.status_code == 403
    message = f"this token writes to run {run.pk}, not run {other_run.pk}"
    assert resp.json() == {"detail": message, "errors": [{"field": "request", "message": message}]}
    assert _nothing_stored()


def test_a_body_without_run_and_attempt_writes_to_the_tokens_run(run, other_run, client_for):
    resp = post(client_for(other_run, 2), "metrics", {"points": [{"step": 4, "metrics": {"reward": 1}}]})

    assert resp.status_code == 200
    assert stored(other_run, 2) == {4: {"reward": 1}}
    assert stored(run) == {}


# --- checkpoints and heartbeats --------------------------------------------------------------------------


def test_checkpoints_register_once_per_path_from_the_endpoint_and_from_events(run, ingest):
    step_10, step_20 = f"run-{run.pk}/checkpoints/step-10", f"run-{run.pk}/checkpoints/step-20"
    body = {"step": 10, "path": step_10, "weight_version": 10, "size": 4096, "metrics": {"reward": 0.5}}
    first = post(ingest, "checkpoints", body)
    again = post(ingest, "checkpoints", body | {"size": 5000})
    event = {"seq": 1, "kind": "checkpoint", "payload": {"step": 20, "path": step_20}}
    post(ingest, "metrics", batch(run, [20], events=[event]))
    post(ingest, "metrics", batch(run, [20], events=[event]))  # replayed

    assert first.status_code == again.status_code == 200
    assert first.json()["checkpoint"] == again.json()["checkpoint"]
    rows = list(CheckpointRecord.objects.filter(run=run).values_list("step", "path", "weight_version", "size"))
    assert rows == [(10, step_10, 10, 5000), (20, step_20, None, None)]


def test_a_bad_checkpoint_registration_names_the_field(run, ingest):
    resp = post(ingest, "checkpoints", {"step": 3, "path": "", "size": -1})

    assert resp.status_code == 400
    assert resp.json()["errors"] == [
        {"field": "path", "message": "must be a string of 1 to 500 characters"},
        {"field": "size", "message": "must be a number of bytes or null"},
    ]
    assert CheckpointRecord.objects.count() == 0


def test_heartbeats_keep_one_row_per_role_and_attempt(run, ingest):
    post(ingest, "heartbeat", {"role": "rollout-0", "status": "starting"})
    first = RoleHeartbeat.objects.get(run=run, role="rollout-0")

    resp = post(ingest, "heartbeat", {"role": "rollout-0", "status": "running", "info": {"step": 4}})

    assert resp.status_code == 200
    assert resp.json() == {"commands": []}
    (beat,) = RoleHeartbeat.objects.filter(run=run)
    assert (beat.role, beat.attempt, beat.status, beat.info) == ("rollout-0", 0, "running", {"step": 4})
    assert beat.first_seen == first.first_seen
    assert beat.last_seen >= first.last_seen


def test_a_heartbeat_without_a_role_is_refused(run, ingest):
    resp = post(ingest, "heartbeat", {"status": "running"})

    assert resp.status_code == 400
    assert resp.json() == {"errors": [{"field": "role", "message": "must be a string of 1 to 100 characters"}]}
    assert RoleHeartbeat.objects.count() == 0


def test_mint_run_token_stores_only_a_hash(run):
    from jobs.ingest.tokens import authenticate_run_token, mint_run_token

    raw = mint_run_token(run, 3)

    token = RunToken.objects.get(run=run)
    assert raw.startswith("tdr_") and raw not in (token.token_hash, token.prefix)
    assert authenticate_run_token(raw) == token and token.attempt == 3
    with pytest.raises(ValueError, match="attempt must be a non-negative integer"):
        mint_run_token(run, -1)


def test_the_portable_merge_used_on_sqlite_stores_what_the_postgresql_statement_stores(run, other_run, monkeypatch):
    from jobs import sql
    from jobs.ingest.handler import store_points
    from jobs.ingest.tokens import mint_run_token
    from jobs.models import RunToken

    mint_run_token(run, 0)
    mint_run_token(other_run, 0)
    first = {1: (1.0, {"a": 1}), 2: (2.0, {"a": 2}), 3: (3.0, {"a": 3})}
    second = {2: (2.0, {"a": 102}), 3: (3.0, {"a": 103, "b": 1}), 4: (4.0, {"a": 104})}
    pg_token, portable_token = RunToken.objects.get(run=run), RunToken.objects.get(run=other_run)

    pg_counts = [store_points(pg_token, first), store_points(pg_token, second)]
    monkeypatch.setattr(sql, "on_postgresql", lambda: False)  # as on SQLite: the portable merge, no chart store
    portable_counts = [store_points(portable_token, first), store_points(portable_token, second)]

    assert (
        pg_counts
        == portable_counts
        == [
            {"inserted": 3, "merged": 0, "unchanged": 0},
            {"inserted": 1, "merged": 1, "unchanged": 1},
        ]
    )
    assert stored(run) == stored(other_run) == {1: {"a": 1}, 2: {"a": 2}, 3: {"a": 3, "b": 1}, 4: {"a": 104}}
