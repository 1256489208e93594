"""runtime.contract's two whole rules: the ingest batch schema (the reporter's side of it) and checkpoint
retention (``retained``), which the runtime rotates by alone and the platform applies to managed runs.

The platform's side of the schema (field-named 400s, nothing stored) is tests/ingest/test_ingest_api.py.
"""

from __future__ import annotations

import json
import math

import pytest
import yaml

from runtime.contract import (
    MAX_METRIC_NAME,
    SPOOL_FILE,
    batch_body,
    best_checkpoint,
    read_batch,
    record_problems,
    retained,
)
from runtime.managed.reporter import HttpReporter
from runtime.metrics import ReporterError
from tests.http_stub import QuietHandler, StubServer, answer

# --- retention ------------------------------------------------------------------------------------------


def _ckpts(*rows):
    """``(key, step, metrics)`` rows from ``(step, value of "m" or None)``, keyed by step."""
    return [(step, step, {} if value is None else {"m": value}) for step, value in rows]


@pytest.mark.parametrize(
    ("checkpoints", "keep_last", "metric", "mode", "kept"),
    [
        (_ckpts(), 3, None, "max", set()),
        (_ckpts((1, None), (2, None)), 3, None, "max", {1, 2}),  # fewer than keep_last: all
        (_ckpts((1, None), (2, None), (3, None), (4, None)), 2, None, "max", {3, 4}),
        (_ckpts((4, None), (1, None), (3, None), (2, None)), 2, None, "max", {3, 4}),  # newest by step, not order
        (_ckpts((1, 0.9), (2, 0.1), (3, 0.2)), 1, "m", "max", {1, 3}),  # the best however old
        (_ckpts((1, 0.9), (2, 0.1), (3, 0.2)), 1, "m", "min", {2, 3}),
        (_ckpts((1, 0.9), (2, 0.9), (3, 0.1), (4, 0.2)), 1, "m", "max", {2, 4}),  # a tie: the newer
        (_ckpts((1, 0.9), (2, None), (3, 0.2)), 1, "other", "max", {3}),  # nobody has the metric
        (_ckpts((1, 5), (2, 0.5), (3, 0.2)), 1, "m", "max", {1, 3}),  # integers are numbers
        (_ckpts((1, 0.5), (2, True), (3, 0.2)), 1, "m", "max", {1, 3}),  # a bool is not
        (_ckpts((1, 0.5), (2, math.nan), (3, math.inf), (4, "high"), (5, 0.1)), 1, "m", "max", {1, 5}),
        (_ckpts((1, 0.5), (2, None), (3, 0.2)), 3, "m", "max", {1, 2, 3}),  # the best among the newest
    ],
)
def test_retained(checkpoints, keep_last, metric, mode, kept):
    assert retained(checkpoints, keep_last, metric, mode) == kept


def test_equal_steps_count_the_later_one_as_newer():
    rows = [("a", 5, {"m": 1.0}), ("b", 5, {"m": 1.0}), ("c", 4, {"m": 0.0})]
    assert retained(rows, 1) == {"b"}
    assert best_checkpoint(rows, "m") == "b"
    assert best_checkpoint(rows, "m", "min") == "c"
    assert best_checkpoint(rows, "absent") is None


@pytest.mark.parametrize(
    ("keep_last", "mode", "message"),
    [
        (0, "max", "keep_last must be an integer >= 1, got 0"),
        (True, "max", "keep_last must be an integer >= 1, got True"),
        (2, "best", "best_mode must be 'max' or 'min', got 'best'"),
    ],
)
def test_retained_refuses_a_policy_it_cannot_apply(keep_last, mode, message):
    with pytest.raises(ValueError, match=message):
        retained(_ckpts((1, 0.5)), keep_last, "m", mode)


# --- the batch schema --------------------------------------------------------------------------------------


class Platform:
    """An ingest endpoint that holds every body to the contract's schema and answers 200 either way."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.problems: list[dict] = []
        platform = self

        class Handler(QuietHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path.endswith("/metrics"):
                    platform.bodies.append(body)
                    platform.problems += read_batch(body)[1]
                answer(self, 200, {"commands": []})

        self.stub = StubServer(Handler)
        self.url = self.stub.url

    def points(self) -> list[dict]:
        return [p for body in self.bodies for p in body["points"]]

    def events(self) -> list[dict]:
        return [e for body in self.bodies for e in body["events"]]

    def stop(self):
        self.stub.stop()


@pytest.fixture
def platform():
    p = Platform()
    yield p
    p.stop()


def test_what_the_reporter_sends_is_a_batch_the_schema_accepts(platform, tmp_path):
    reporter = HttpReporter(platform.url, "token", tmp_path / "spool", run="7", attempt=1, role="trainer-0")
    reporter.report(1, {"reward/mean": 0.5, "samples": 12, "ok": True, "loss": math.nan, "grad": -math.inf})
    reporter.event("checkpoint", {"step": 1, "path": tmp_path / "ckpt", "metrics": {"reward/mean": math.nan}})
    reporter.report(2, {})
    assert reporter.flush(timeout=30)
    reporter.close()

    assert platform.problems == []
    assert [(p["step"], p["metrics"]) for p in platform.points()] == [
        (1, {"reward/mean": 0.5, "samples": 12, "ok": 1, "loss": None, "grad": None}),
        (2, {}),
    ]
    (event,) = platform.events()
    assert (event["kind"], event["payload"]["path"], event["seq"]) == ("checkpoint", str(tmp_path / "ckpt"), 1)
    assert {(b["run"], b["attempt"], b["role"]) for b in platform.bodies} == {("7", 1, "trainer-0")}


def test_batch_body_of_spooled_records_is_accepted():
    records = [
        {"seq": 0, "step": 3, "time": 1_700_000_000.5, "metrics": {"a": 1}},
        {"seq": 1, "kind": "eval", "time": 1_700_000_001, "payload": {"acc": 0.5}},
    ]
    batch, problems = read_batch(batch_body(records, "7", 0, "trainer-0"))
    assert problems == []
    assert (batch.points[0].step, batch.events[0].kind, batch.role) == (3, "eval", "trainer-0")


@pytest.mark.parametrize(
    ("record", "field", "message"),
    [
        ({"step": 1, "metrics": {"x" * (MAX_METRIC_NAME + 1): 1.0}}, "metrics", "metric names must have 1 to 200"),
        ({"step": 1, "metrics": {"big": 10**30}}, "metrics.big", "must be a finite number or null"),
        ({"step": -1, "metrics": {}}, "step", "must be a non-negative integer"),
        ({"seq": 1, "kind": "k" * 51, "payload": {}}, "kind", "must be a string of 1 to 50 characters"),
        ({"seq": 1, "kind": "note", "payload": {"text": "a\x00b"}}, "payload", "must be an object (no NUL"),
        ({"seq": 1, "kind": "note", "time": 1e20}, "time", "must be a Unix time in seconds"),
    ],
)
def test_a_record_the_platform_would_refuse_is_named(record, field, message):
    (problem,) = record_problems(record)
    assert problem["field"] == field and problem["message"].startswith(message)


def test_the_reporter_refuses_such_a_record_instead_of_spooling_it(platform, tmp_path):
    reporter = HttpReporter(platform.url, "token", tmp_path / "spool", run="7")
    with pytest.raises(ReporterError, match=r"the platform would refuse this record \(kind: must be a string of 1"):
        reporter.event("k" * 51, {})
    with pytest.raises(ReporterError, match=r"\(metrics: metric names must have 1 to 200 characters"):
        reporter.report(1, {"x" * 201: 0.5})
    reporter.report(1, {"ok": 0.5})
    assert reporter.flush(timeout=30)
    reporter.close()
    assert [p["seq"] for p in platform.points()] == [0]  # the refused ones took no sequence number
    assert (tmp_path / "spool" / SPOOL_FILE).read_text() == ""  # delivered: nothing else was spooled


# --- a platform-managed trainer: everything it reports is accepted, and it deletes no checkpoint ----------


@pytest.fixture
def managed_run(tmp_path, platform):
    """A 3-step trainer role (checkpoint every step, keep_last 1) reporting to ``platform``."""
    from runtime.managed.entry import TrainerRole
    from runtime.managed.entry import read_env as role_env
    from runtime.pipeline.driver import CHECKPOINT_DIR, RESOLVED_SPEC
    from tests.runtime.helpers import tiny_spec

    spec = tiny_spec(tmp_path, "managed", pipeline__steps=3, checkpoint__interval=1, checkpoint__keep_last=1)
    env = role_env(
        {"TANDEM_PLATFORM_URL": platform.url, "TANDEM_RUN_TOKEN": "t", "TANDEM_RUN_ID": "7", "TANDEM_ATTEMPT": "0"}
    )
    workdir = tmp_path / "managed"
    result = TrainerRole(spec, env, workdir, resume=None).run()
    assert result["outcome"] == "completed"
    resolved = yaml.safe_load((workdir / RESOLVED_SPEC).read_text())
    return sorted(p.name for p in (workdir / CHECKPOINT_DIR).glob("step-*")), resolved


def test_a_managed_trainer_reports_only_batches_the_schema_accepts_and_deletes_no_checkpoint(managed_run, platform):
    checkpoints, resolved = managed_run
    assert platform.problems == []
    assert {p["step"] for p in platform.points()} >= {1, 2, 3}
    assert [e["payload"]["step"] for e in platform.events() if e["kind"] == "checkpoint"] == [1, 2, 3]
    # The platform owns retention: the role's pipeline rotated nothing, and the spec it records is the user's.
    assert checkpoints == ["step-00000001", "step-00000002", "step-00000003"]
    assert resolved["checkpoint"]["keep_last"] == 1
