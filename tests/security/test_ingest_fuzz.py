"""Fuzzing the ingest API: generated bodies from a run token never reach a server error.

The ingest endpoints are not in the public OpenAPI schema (only role processes call them), so the
schema fuzz of tests/api/test_fuzz.py does not reach them. Here hypothesis generates two kinds of
body for each endpoint: arbitrary JSON (any shape, NUL characters, lone surrogates, huge and
non-finite numbers), and a valid body with one value replaced by arbitrary JSON, which gets past the
first checks and into the deep ones. Every reply must be a status the endpoint documents, and a 400
must carry the API's field errors.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs.models import MetricPoint

ENDPOINTS = ("metrics", "checkpoints", "heartbeat", "command_result")
# 200 stored; 400 bad input; 403 a body naming another run or attempt than the token's; 404 an unknown
# command id; 409 a command result contradicting an earlier one.
DOCUMENTED = {200, 400, 403, 404, 409}
EXAMPLES = 60

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(alphabet=st.characters(codec=None), max_size=12)  # NUL and lone surrogates included
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _valid_body(endpoint: str, run) -> dict:
    if endpoint == "metrics":
        return {
            "run": str(run.pk),
            "attempt": 0,
            "role": "trainer-0",
            "points": [{"seq": 0, "step": 1, "time": 1_700_000_000.0, "metrics": {"reward": 0.5}}],
            "events": [{"seq": 1, "time": 1_700_000_000.0, "kind": "note", "payload": {"a": 1}}],
        }
    if endpoint == "checkpoints":
        return {"step": 1, "path": f"run-{run.pk}/checkpoints/step-00000001", "metrics": {"reward": 0.5}}
    if endpoint == "heartbeat":
        return {"role": "trainer-0", "status": "running", "info": {"pid": 1}}
    return {"command": 1, "state": "done", "message": "ok"}


def _paths(value, prefix=()):
    """Every path into a JSON value (the places one replacement can go)."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*prefix, index))


def _replaced(value, path, new):
    if not path:
        return new
    head, rest = path[0], path[1:]
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[head] = _replaced(value[head], rest, new)
    return copy


def _encode(body) -> bytes:
    # allow_nan: the platform must refuse NaN / Infinity literals itself; surrogates stay \\u escapes
    return json.dumps(body, allow_nan=True).encode()


def _check(resp) -> None:
    assert resp.status_code in DOCUMENTED, (resp.status_code, resp.content[:500])
    if resp.status_code == 400:
        errors = resp.json()["errors"]
        assert errors and all(isinstance(e["field"], str) and isinstance(e["message"], str) for e in errors)


def _post(client, endpoint: str, raw: bytes):
    return client.post(f"/api/ingest/{endpoint}", data=raw, content_type="application/json")


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,  # no example database in the checkout: each run explores afresh
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@FUZZ
@given(body=json_values)
def test_arbitrary_json_never_reaches_a_server_error(ingest, endpoint, body):
    _check(_post(ingest, endpoint, _encode(body)))


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@FUZZ
@given(data=st.data(), new=json_values)
def test_a_valid_body_with_one_value_replaced_never_reaches_a_server_error(ingest, run, endpoint, data, new):
    valid = _valid_body(endpoint, run)
    path = data.draw(st.sampled_from(list(_paths(valid))[1:]))
    _check(_post(ingest, endpoint, _encode(_replaced(valid, path, new))))
    # whatever was accepted is stored as finite numbers (the series and charts read them as such)
    for metrics in MetricPoint.objects.filter(run=run).values_list("metrics", flat=True):
        assert all(isinstance(v, int | float) and math.isfinite(v) for v in metrics.values()), metrics
