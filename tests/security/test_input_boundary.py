"""No 500 from any input: every API endpoint refuses bad input with a 400 in the documented shape.

Each input below was a 500 (or an HTML 400, or a ``{"detail": ...}`` body) before the input boundary
(rlplatform/input_boundary.py): NUL bytes in list filters, deeply nested JSON bodies and YAML specs,
NUL and lone surrogates inside specs, bodies over the upload limit, malformed JSON. Every test asserts
the status, the exact ``{"errors": [...]}`` body naming the field or parameter, and that nothing was stored.
"""

from __future__ import annotations

import io
import json

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.test import AsyncClient

from jobs.models import CheckpointRecord, Command, Experiment, MetricPoint, RoleHeartbeat, Run, RunEvent
from rlplatform.input_boundary import BoundedJSONParser, InputRejected
from rlplatform.models import AuditLog, Quota

NUL = r"contains a NUL character (\u0000)"
SURROGATE = r"contains a lone surrogate (\ud800-\udfff), which is not valid Unicode"
TOO_DEEP = "nested deeper than 64 levels"
DEEP_JSON = "[" * 100_000 + "]" * 100_000
DEEP_YAML = "[" * 500 + "]" * 500  # 1 KB


def stored() -> dict[str, int]:
    """Row counts of everything an API request can write."""
    models = (Run, Experiment, Quota, AuditLog, Command, MetricPoint, RunEvent, CheckpointRecord, RoleHeartbeat)
    return {model.__name__: model.objects.count() for model in models}


def errors(*pairs: tuple[str, str]) -> dict:
    return {"errors": [{"field": field, "message": message} for field, message in pairs]}


@pytest.fixture
def owner_api(as_user, owner, team_a):
    return as_user(owner, team_a)


def post_json(client, path: str, body: str | bytes):
    return client.generic("POST", path, body, content_type="application/json")


# --- NUL in query parameters -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "param"),
    [
        ("/api/runs/?experiment=a%00b", "experiment"),
        ("/api/audit/?action=a%00b", "action"),
        ("/api/audit/?target_type=a%00b", "target_type"),
        ("/api/runs/{run}/events/?kind=a%00b", "kind"),
    ],
)
def test_a_nul_byte_in_a_list_filter_is_a_400_naming_the_parameter(owner_api, run, path, param):
    before = stored()

    response = owner_api.get(path.format(run=run.pk))

    assert response.status_code == 400
    assert response.json() == errors((param, NUL))
    assert stored() == before


def test_the_boundary_answers_on_the_asgi_path_too(owner, team_a, mint_token, run):
    # Django's AsyncClient runs the middleware chain in async mode, as under uvicorn.
    client = AsyncClient(headers={"Authorization": f"Bearer {mint_token(owner, team_a)}"})
    before = stored()

    response = async_to_sync(client.get)(f"/api/runs/{run.pk}/events/?kind=a%00b")

    assert response.status_code == 400
    assert response.json() == errors(("kind", NUL))
    assert stored() == before


# --- deeply nested JSON bodies ---------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/api/runs/", "/api/experiments/", "/api/runs/{run}/commands/"])
def test_a_deeply_nested_json_body_is_a_400(owner_api, run, path):
    before = stored()

    response = post_json(owner_api, path.format(run=run.pk), DEEP_JSON)

    assert response.status_code == 400
    assert response.json() == errors(("body", TOO_DEEP))
    assert stored() == before


@pytest.mark.parametrize("path", ["metrics", "events", "checkpoints", "heartbeat", "command_result"])
def test_a_deeply_nested_json_body_is_a_400_on_ingest(ingest, path):
    before = stored()

    response = post_json(ingest, f"/api/ingest/{path}", DEEP_JSON)

    assert response.status_code == 400
    assert response.json() == errors(("body", TOO_DEEP))
    assert stored() == before


def test_json_nested_65_levels_inside_an_object_is_refused_and_64_is_not(owner_api, experiment):
    before = stored()
    # The body's object is level 1, the spec object level 2: 62 more lists make 64, 63 make 65.
    allowed = {"experiment": experiment.name, "spec": {"x": json.loads("[" * 62 + "]" * 62)}}
    refused = {"experiment": experiment.name, "spec": {"x": json.loads("[" * 63 + "]" * 63)}}

    ok = post_json(owner_api, "/api/runs/", json.dumps(allowed))
    deep = post_json(owner_api, "/api/runs/", json.dumps(refused))

    assert ok.json() == errors(("x", "unknown field"))  # past the boundary, refused by the spec's schema
    assert deep.status_code == 400
    assert deep.json() == errors(("body", TOO_DEEP))
    assert stored() == before


# --- specs: nesting, NUL, lone surrogates, wrong types ----------------------------------------------


def submit_body(experiment, spec, **extra) -> str:
    return json.dumps({"experiment": experiment.name, "spec": spec, **extra})


def test_a_deeply_nested_yaml_spec_is_a_400(owner_api, experiment):
    before = stored()

    response = post_json(owner_api, "/api/runs/", submit_body(experiment, DEEP_YAML))

    assert response.status_code == 400
    assert response.json() == errors(("spec", TOO_DEEP))
    assert stored() == before


def test_a_deeply_nested_override_is_a_400_naming_its_key(owner_api, experiment):
    before = stored()

    body = submit_body(experiment, "name: x\n", overrides=[f"trainer.lr={DEEP_YAML}"])
    response = post_json(owner_api, "/api/runs/", body)

    assert response.status_code == 400
    assert response.json() == errors(("trainer.lr", TOO_DEEP))
    assert stored() == before


@pytest.mark.parametrize(
    ("spec", "field"),
    [({"name": "a\u0000b"}, "spec.name"), ({"model": {"path": "/models/a\u0000b"}}, "spec.model.path")],
)
def test_a_nul_inside_a_json_object_spec_is_a_400_naming_the_field(owner_api, experiment, spec, field):
    before = stored()

    response = post_json(owner_api, "/api/runs/", submit_body(experiment, spec))

    assert response.status_code == 400
    assert response.json() == errors((field, NUL))
    assert stored() == before


def test_a_lone_surrogate_in_yaml_spec_text_is_a_400(owner_api, experiment):
    before = stored()

    # json.dumps writes the lone surrogate as the escape \ud800, as a client would send it.
    response = post_json(owner_api, "/api/runs/", submit_body(experiment, "name: a\ud800b\n"))

    assert response.status_code == 400
    assert response.json() == errors(("spec", SURROGATE))
    assert stored() == before


@pytest.mark.parametrize(("escape", "message"), [(r"\0", NUL), (r"\ud800", SURROGATE)])
def test_a_yaml_escape_that_makes_unstorable_text_is_a_400(owner_api, experiment, escape, message):
    before = stored()

    # The JSON body is clean; YAML's double-quoted escapes produce the NUL or the surrogate.
    response = post_json(owner_api, "/api/runs/", submit_body(experiment, f'name: "a{escape}b"\n'))

    assert response.status_code == 400
    assert response.json() == errors(("name", message))
    assert stored() == before


@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        ("trainer:\n  lr: true\n", "trainer.lr", "Value error, must be a number, not true/false"),
        ("pipeline:\n  steps: '5'\n", "pipeline.steps", "Input should be a valid integer"),
        ("pipeline:\n  steps: true\n", "pipeline.steps", "Input should be a valid integer"),
    ],
)
def test_a_spec_value_of_the_wrong_type_is_a_400_not_coerced(owner_api, experiment, spec, field, message):
    before = stored()

    response = post_json(owner_api, "/api/runs/", submit_body(experiment, spec))

    assert response.status_code == 400
    assert response.json() == errors((field, message))
    assert stored() == before


# --- body size, malformed JSON --------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/api/runs/", "/api/ingest/metrics"])
def test_a_body_over_the_upload_limit_is_a_400_in_the_errors_shape(owner_api, ingest, path):
    client = ingest if path.startswith("/api/ingest/") else owner_api
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    before = stored()

    response = post_json(client, path, json.dumps({"spec": "x" * limit}))

    assert response.status_code == 400
    assert response["Content-Type"] == "application/json"
    assert response.json() == errors(("body", f"larger than the limit of {limit} bytes"))
    assert stored() == before


def test_a_body_without_a_declared_length_is_held_to_the_limit_by_the_parser():
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    # A chunked body has no Content-Length for the middleware to check; the parser reads at most limit + 1.
    with pytest.raises(InputRejected) as refused:
        BoundedJSONParser().parse(io.BytesIO(b'"' + b"x" * limit + b'"'))

    assert refused.value.errors == [{"field": "body", "message": f"larger than the limit of {limit} bytes"}]


@pytest.mark.parametrize("path", ["/api/runs/", "/api/ingest/metrics"])
def test_malformed_json_is_a_400_in_the_errors_shape(owner_api, ingest, path):
    client = ingest if path.startswith("/api/ingest/") else owner_api
    before = stored()

    response = post_json(client, path, '{"experiment": ')

    assert response.status_code == 400
    assert response.json() == errors(("body", "malformed JSON: Expecting value: line 1 column 16 (char 15)"))
    assert stored() == before


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"experiment": "\xff"}', "not valid utf-8 text"),
        (b'{"priority": NaN}', "malformed JSON: NaN is not a JSON number"),
    ],
)
def test_a_body_that_is_not_utf8_or_not_standard_json_is_a_400(owner_api, experiment, body, message):
    before = stored()

    response = post_json(owner_api, "/api/runs/", body)

    assert response.status_code == 400
    assert response.json() == errors(("body", message))
    assert stored() == before


def test_a_nul_in_an_ingest_body_is_a_400_naming_the_field(ingest, run):
    before = stored()

    body = {"run": run.pk, "attempt": 0, "points": [], "events": [{"kind": "a\u0000b", "payload": {}}]}
    response = post_json(ingest, "/api/ingest/events", json.dumps(body))

    assert response.status_code == 400
    assert response.json() == errors(("events.0.kind", NUL))
    assert stored() == before
