"""Fuzzing the REST API from its OpenAPI schema (schemathesis) against the live test server.

Every operation of the schema gets a bounded number of generated requests, sent over HTTP with a
team-admin token; each reply must not be a server error, must have a status code the schema documents,
and must match the schema's body for that code. A failure prints the request that reproduces it.
"""

from __future__ import annotations

import pytest
import schemathesis
from django.utils import timezone
from drf_spectacular.generators import SchemaGenerator
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from jobs.models import CheckpointRecord, MetricPoint, RunEvent
from rlplatform.models import APIToken

# Per operation: about 45 operations x this many requests keeps the test near a minute on two slow cores.
EXAMPLES_PER_OPERATION = 8
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture
def fuzz_target(transactional_db, live_server, owner, team_a, experiment, run, mint_token):
    """(base URL, Authorization header, token id, {path prefix: id of a real object}) of the live server,
    with a team, an experiment, a run with a metric point, an event and a checkpoint."""
    now = timezone.now()
    MetricPoint.objects.create(run=run, attempt=0, step=1, time=now, metrics={"reward": 0.5})
    RunEvent.objects.create(run=run, attempt=0, role="trainer", seq=0, kind="step", payload={"step": 1}, time=now)
    checkpoint = CheckpointRecord.objects.create(
        run=run, step=1, path=f"run-{run.pk}/checkpoints/step-1", metrics={"reward": 0.5}
    )
    raw = mint_token(owner, team_a, name="fuzz")
    token = APIToken.objects.get(team=team_a, name="fuzz")
    real_ids = {
        "/api/runs/": run.pk,
        "/api/experiments/": experiment.pk,
        "/api/quotas/": experiment.quota_id,
        "/api/teams/": team_a.pk,
        "/api/resource-groups/": experiment.group_id,
        "/api/checkpoints/": checkpoint.pk,
        "/api/tokens/": token.pk,
    }
    return live_server.url, {"Authorization": f"Bearer {raw}"}, token.pk, real_ids


def aim_at_real_objects(case, real_ids: dict[str, int]) -> None:
    """Point a generated integer id at an object of the fixture (random ids are nearly always 404s).
    Ids that are not integers (negative cases) stay as generated."""
    for name in ("id", "run_id"):
        value = (case.path_parameters or {}).get(name)
        # run_id is typed as a string of digits (its route's pattern), the other ids as integers.
        if (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, str) and value.isdigit()):
            prefix = "/api/runs/" if name == "run_id" else next((p for p in real_ids if case.path.startswith(p)), None)
            if prefix is not None:
                case.path_parameters[name] = real_ids[prefix]


# Built at import (pytest-django has set Django up by then): schemathesis' lazy fixture loader relies on a
# pytest internal that pytest 9 no longer has. One test per operation.
schema = schemathesis.openapi.from_dict(SchemaGenerator().get_schema(request=None, public=True))


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,  # the same requests on every run: a CI failure reproduces locally
)
def test_no_operation_answers_a_generated_request_with_a_server_error_or_off_schema(case, fuzz_target):
    base_url, auth, token_id, real_ids = fuzz_target
    # The fuzzer may revoke the very token it uses (DELETE /api/tokens/{id}/): restore it for the next request.
    APIToken.objects.filter(pk=token_id).update(revoked_at=None)
    aim_at_real_objects(case, real_ids)
    if case.path.endswith("/wait/"):
        case.query = {**(case.query or {}), "timeout": "0"}  # a long-poll would otherwise wait 30 s per request
    case.call_and_validate(base_url=base_url, headers=auth, checks=CHECKS)
