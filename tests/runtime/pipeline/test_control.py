"""Directives at step boundaries (runtime.control -> runtime.pipeline.driver) on a tiny model.

Directives are submitted from a reporter when a given step's metrics arrive, so they are
taken at exactly that step's boundary; a Control subclass logs each acknowledgement in the
same log as the reported events, so their order can be asserted.
"""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch

from runtime import metrics as M
from runtime.checkpoint import load_checkpoint
from runtime.control import Control, Directive
from runtime.pipeline import run
from runtime.pipeline.driver import CHECKPOINT_DIR, REWOUND_DIR
from tests.runtime.helpers import derived, tiny_spec

BASE = derived(pipeline={"mode": "sync", "steps": 5}, checkpoint={"interval": 1, "keep_last": 10})


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _spec(tmp_path, name, **over):
    return tiny_spec(tmp_path, name, BASE, **over)


class Log:
    """One ordered log of reported steps, events and acknowledgements."""

    def __init__(self):
        self.entries: list[tuple] = []

    def steps(self):
        return [e[1] for e in self.entries if e[0] == "step"]

    def events(self, kind):
        return [e[2] for e in self.entries if e[0] == "event" and e[1] == kind]


class LoggingControl(Control):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def finished(self, directive, ok, message=""):
        super().finished(directive, ok, message)
        self.log.entries.append(("ack", directive.id, ok, message))


class Trigger:
    """A reporter: submits ``plan[step]`` when that step's metrics are reported; logs steps and events."""

    def __init__(self, control, log, plan):
        self.control, self.log, self.plan = control, log, plan

    def report(self, step, metrics):
        if "loss/policy" in metrics:  # a training step (evaluations are reported too)
            self.log.entries.append(("step", step, metrics))
            for d in self.plan.pop(step, []):
                self.control.submit(d)

    def event(self, kind, payload):
        self.log.entries.append(("event", kind, dict(payload)))

    def close(self):
        pass


def _run(spec, plan, **kw):
    """Run with a JSONL reporter (the checkpoints' metrics cursor) plus the trigger."""
    log = Log()
    control = LoggingControl(log)
    jsonl = M.JsonlReporter(spec.resolved_output_dir() / M.METRICS_FILE)
    reporters = M.MultiReporter([jsonl, Trigger(control, log, dict(plan))])
    result = run(spec, reporters=reporters, control=control, **kw)
    return result, control, log


def _trainer_state(path):
    return load_checkpoint(path, keys=["trainer"])["trainer"]


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _same_optimizer(a, b):
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[k][n], sb[k][n]) for k in sa for n in ("exp_avg", "exp_avg_sq")
    )


def _ckpt(tmp_path, name, step):
    return tmp_path / name / CHECKPOINT_DIR / f"step-{step:08d}"


# ---- stop / preempt / cancel -------------------------------------------------------


@pytest.mark.parametrize(("kind", "outcome"), [("stop", "stopped"), ("preempt", "preempted")])
def test_stop_and_preempt_checkpoint_at_that_step_then_acknowledge(tmp_path, kind, outcome):
    spec = _spec(tmp_path, kind, checkpoint__interval=0)  # no periodic checkpoint: the stop must take one
    result, control, log = _run(spec, {2: [Directive(7, kind)]})
    assert result["outcome"] == outcome and result["steps"] == 2
    assert result["checkpoint"] == str(_ckpt(tmp_path, kind, 2))
    assert [p.name for p in (tmp_path / kind / CHECKPOINT_DIR).iterdir()] == ["step-00000002"]
    assert log.steps() == [1, 2]
    # acknowledged after the checkpoint was written and its event reported
    (checkpoint_at,) = [
        i
        for i, (kind_, *rest) in enumerate(log.entries)
        if (kind_, rest[0]) == ("event", "checkpoint")
        and (rest[1]["step"], rest[1]["path"]) == (2, result["checkpoint"])
    ]
    ack = (
        "ack",
        7,
        True,
        f"checkpoint at step 2: {result['checkpoint']}",
    )
    assert log.entries.index(ack) == checkpoint_at + 1
    assert control.status()["status"] == "finished"


def test_cancel_ends_at_once_without_a_checkpoint(tmp_path):
    spec = _spec(tmp_path, "cancel")  # a checkpoint every step: the cancelled step must not get one
    result, control, log = _run(spec, {2: [Directive(1, "cancel"), Directive(2, "pause")]})
    assert result["outcome"] == "cancelled" and result["steps"] == 2
    assert [p.name for p in (tmp_path / "cancel" / CHECKPOINT_DIR).iterdir()] == ["step-00000001"]
    assert result["checkpoint"] == str(_ckpt(tmp_path, "cancel", 1))
    assert log.steps() == [1, 2]
    assert [(r.directive.id, r.ok, r.message) for r in control.results] == [
        (1, True, "cancelled at step 2"),
        (2, False, "the run is ending (cancelled)"),
    ]


def test_directives_after_a_stop_are_refused_and_late_ones_left_to_the_controller(tmp_path):
    spec = _spec(tmp_path, "late", checkpoint__interval=0)
    plan = {1: [Directive(1, "stop"), Directive(2, "set_params", {"params": {"trainer.lr": 0.5}})]}
    result, control, _ = _run(spec, plan)
    assert result["outcome"] == "stopped"
    late = Directive(3, "pause")
    control.submit(late)  # after the run: left pending, for the controller to answer (or redeliver)
    assert [(r.directive.id, r.ok) for r in control.results] == [(2, False), (1, True)]
    assert control.take() == [late]
    assert control.results[0].message == "the run is ending (stopped)"
    assert _trainer_state(result["checkpoint"])["optimizer"]["param_groups"][0]["lr"] == 1e-3  # nothing changed


# ---- pause / resume / set_params ---------------------------------------------------


def test_pause_holds_the_trainer_at_the_boundary_until_resume(tmp_path):
    spec = _spec(tmp_path, "pause", checkpoint__interval=0)
    log = Log()
    control = LoggingControl(log)
    seen: dict = {}

    def operator():
        deadline = time.monotonic() + 120
        while control.status().get("status") != "paused" and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["status"] = dict(control.status())
        seen["steps_while_paused"] = log.steps()
        control.submit(Directive(2, "pause"))
        control.submit(Directive(3, "set_params", {"params": {"trainer.lr": 0.002, "pipeline.eval_interval": 2}}))
        control.submit(Directive(4, "resume"))

    thread = threading.Thread(target=operator)
    thread.start()
    reporters = M.MultiReporter([Trigger(control, log, {2: [Directive(1, "pause")]})])
    result = run(spec, reporters=reporters, control=control)
    thread.join()
    assert seen["status"]["status"] == "paused" and seen["status"]["step"] == 2
    assert seen["steps_while_paused"] == [1, 2]  # no step while paused
    assert [(r.directive.id, r.ok, r.message) for r in control.results] == [
        (1, True, "paused at step 2"),
        (2, True, "already paused"),
        (3, True, "set trainer.lr=0.002, pipeline.eval_interval=2"),
        (4, True, "resumed at step 2"),
    ]
    assert log.steps() == [1, 2, 3, 4, 5] and result["outcome"] == "completed"
    # the new learning rate from step 3 on; evaluations every 2 steps from this boundary on, and the final one
    assert [e[2]["lr"] for e in log.entries if e[0] == "step"] == [1e-3, 1e-3, 0.002, 0.002, 0.002]
    assert [e["step"] for e in result["eval"]] == [2, 4, 5]
    assert log.events("params") == [{"step": 2, "params": {"trainer.lr": 0.002, "pipeline.eval_interval": 2}}]
    trainer = _trainer_state(result["checkpoint"])
    assert [g["lr"] for g in trainer["optimizer"]["param_groups"]] == [0.002]
    assert trainer["scheduler"]["base_lrs"] == [0.002]


def test_resume_when_not_paused_is_ok_and_changes_nothing(tmp_path):
    result, control, log = _run(_spec(tmp_path, "r", pipeline__steps=2), {1: [Directive(1, "resume")]})
    assert [(r.ok, r.message) for r in control.results] == [(True, "not paused")]
    assert log.steps() == [1, 2] and result["outcome"] == "completed"


def test_set_params_keeps_the_warmup_schedule_on_the_new_base_rate(tmp_path):
    spec = _spec(tmp_path, "warm", trainer__warmup_steps=4, pipeline__steps=3)
    result, control, log = _run(spec, {1: [Directive(1, "set_params", {"params": {"trainer.lr": 0.004}})]})
    assert control.results[0].ok
    # warmup factor (update + 1) / 4: 1/4 at step 1 on the old rate, then 2/4 and 3/4 of the new one
    assert [e[2]["lr"] for e in log.entries if e[0] == "step"] == pytest.approx([2.5e-4, 2e-3, 3e-3])


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"trainer.lr": -1}, "args.params.trainer.lr: Input should be greater than 0"),
        ({"trainer.lr": "fast"}, "args.params.trainer.lr: must be a number > 0, got 'fast'"),
        ({"trainer.lr": float("nan")}, "args.params.trainer.lr: must be a number > 0, got nan"),
        (
            {"pipeline.eval_interval": 2, "pipeline.max_policy_lag": -1},
            "args.params.pipeline.max_policy_lag: must be an integer >= 0, got -1",
        ),
        (
            {"pipeline.max_policy_lag": 2},  # a sync run has no queue whose staleness it could bound
            "args.params.pipeline.max_policy_lag: does not act in pipeline.mode sync",
        ),
        (
            {"trainer.lr": 0.1, "pipeline.eval_interval": True},
            "args.params.pipeline.eval_interval: must be an integer >= 0, got True",
        ),
        ({"trainer.lr": 0.1, "algorithm.group_size": 2}, "args.params.algorithm.group_size: not a live parameter"),
        ({}, "args.params: give at least one of"),
    ],
)
def test_bad_set_params_fail_naming_the_key_and_change_nothing(tmp_path, params, message):
    spec = _spec(tmp_path, "bad", pipeline__steps=2, checkpoint__interval=0)
    result, control, log = _run(spec, {1: [Directive(1, "set_params", {"params": params})]})
    [res] = control.results
    assert not res.ok and res.message.startswith(message)
    assert [e[2]["lr"] for e in log.entries if e[0] == "step"] == [1e-3, 1e-3]
    assert result["eval"] == [] and log.events("params") == []
    trainer = _trainer_state(result["checkpoint"])
    assert trainer["optimizer"]["param_groups"][0]["lr"] == 1e-3 and trainer["scheduler"]["base_lrs"] == [1e-3]


# ---- rollback ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "colocated"])
def test_rollback_restores_the_checkpoint_exactly_and_replays_the_steps(tmp_path, mode):
    spec = _spec(tmp_path, "rb", pipeline__mode=mode)
    target = _ckpt(tmp_path, "rb", 2)
    result, control, log = _run(spec, {4: [Directive(9, "rollback", {"path": str(target), "step": 2})]})
    # a fresh resume from the same checkpoint, taken before the rolled-back run could touch it
    fresh, _, _ = _run(_spec(tmp_path, "fresh", pipeline__mode=mode), {}, resume=target)

    assert [(r.ok, r.message) for r in control.results] == [(True, "restored step 2")]
    assert log.steps() == [1, 2, 3, 4, 3, 4, 5]  # steps 3.. are reported again
    versions = [e[2]["weights/version"] for e in log.entries if e[0] == "step"]
    assert versions == [1, 2, 3, 4, 6, 7, 8]  # forward: the restored weights were published as 5
    [event] = log.events("rollback")
    assert event["step"] == 2 and event["path"] == str(target.resolve()) and event["weight_version"] == 5
    # from the rollback on, the run is the fresh resume: same data, same weights, same optimizer
    assert result["trace"]["consumed"] == [[0, 1, 2, 3], [4, 5, 6, 7]] + fresh["trace"]["consumed"]
    assert result["trace"]["rewound"] == [{"step": 2, "consumed": [[8, 9, 10, 11], [12, 13, 14, 15]], "dropped": []}]
    for step in (3, 4, 5):
        ours, theirs = _trainer_state(_ckpt(tmp_path, "rb", step)), _trainer_state(_ckpt(tmp_path, "fresh", step))
        assert _equal(ours["policy"], theirs["policy"]) and _same_optimizer(ours, theirs)
        assert ours["scheduler"]["last_epoch"] == theirs["scheduler"]["last_epoch"]
        assert ours["version"] == theirs["version"] + 3
    # the abandoned timeline's checkpoints are set aside, out of resume's and retention's way
    rewound = tmp_path / "rb" / CHECKPOINT_DIR / REWOUND_DIR / "001-to-step-00000002"
    # (directives come before the boundary's own checkpoint: the abandoned step 4 never got one)
    assert sorted(p.name for p in rewound.iterdir()) == ["step-00000003"]
    assert event["set_aside"] == [str(rewound / "step-00000003")]
    assert result["outcome"] == "completed" and result["checkpoint"] == str(_ckpt(tmp_path, "rb", 5))


def test_rollback_while_paused_stays_paused_until_resume(tmp_path):
    spec = _spec(tmp_path, "rbp")
    target = str(_ckpt(tmp_path, "rbp", 1))
    plan = {3: [Directive(1, "pause"), Directive(2, "rollback", {"path": target}), Directive(3, "resume")]}
    result, control, log = _run(spec, plan)
    assert [(r.directive.id, r.ok) for r in control.results] == [(1, True), (2, True), (3, True)]
    assert control.results[2].message == "resumed at step 1"
    assert log.steps() == [1, 2, 3, 2, 3, 4, 5]


def _outside_copy(tmp_path):
    """A complete checkpoint of another run, and a symlink to it from inside this run's checkpoint dir."""
    other = run(_spec(tmp_path, "other", pipeline__steps=1))
    return other["checkpoint"]


@pytest.mark.parametrize(
    "where",
    ["other-run", "dotdot", "symlink", "incomplete", "root", "missing-path", "wrong-step"],
)
def test_rollback_outside_the_checkpoint_dir_or_incomplete_is_refused_and_changes_nothing(tmp_path, where):
    spec = _spec(tmp_path, "ref")
    ckdir = tmp_path / "ref" / CHECKPOINT_DIR
    args = {"step": 1}
    if where in ("other-run", "dotdot", "symlink"):
        other = _outside_copy(tmp_path)
        args["path"] = {
            "other-run": other,
            "dotdot": str(ckdir / ".." / ".." / "other" / CHECKPOINT_DIR / "step-00000001"),
            "symlink": str(ckdir / "step-00000009"),
        }[where]
        if where == "symlink":
            ckdir.mkdir(parents=True)
            (ckdir / "step-00000009").symlink_to(other)
    elif where == "incomplete":
        args["path"] = str(ckdir / "step-00000001")  # written at step 1, its manifest removed below
    elif where == "root":
        args["path"] = str(ckdir)
    elif where == "wrong-step":
        args = {"path": str(ckdir / "step-00000001"), "step": 2}

    class Breaker(Trigger):
        def report(self, step, metrics):
            if where == "incomplete" and step == 2 and "loss/policy" in metrics:
                (ckdir / "step-00000001" / "manifest.json").unlink()
            super().report(step, metrics)

    log = Log()
    control = LoggingControl(log)
    reporters = M.MultiReporter(
        [
            M.JsonlReporter(tmp_path / "ref" / M.METRICS_FILE),
            Breaker(control, log, {2: [Directive(5, "rollback", args)]}),
        ]
    )
    result = run(spec, reporters=reporters, control=control)
    [res] = control.results
    assert not res.ok
    expected = {
        "other-run": "args.path: ",
        "dotdot": "args.path: ",
        "symlink": "args.path: ",
        "incomplete": "args.path: ",
        "root": "args.path: ",
        "missing-path": "args.path: required",
        "wrong-step": "args.step: 2 does not match the checkpoint's step 1",
    }[where]
    assert res.message.startswith(expected)
    if where in ("other-run", "dotdot", "symlink", "root"):
        assert "is not inside this run's checkpoint directory" in res.message
    if where == "incomplete":
        assert "is not a complete checkpoint" in res.message
    # nothing changed: the same run as one without the directive
    assert log.steps() == [1, 2, 3, 4, 5] and log.events("rollback") == []
    plain = run(_spec(tmp_path, "plain"))
    assert _equal(_trainer_state(result["checkpoint"])["policy"], _trainer_state(plain["checkpoint"])["policy"])
    assert result["trace"]["consumed"] == plain["trace"]["consumed"] and result["trace"]["rewound"] == []
    assert not (ckdir / REWOUND_DIR).exists()


def test_the_run_keeps_its_own_spec_untouched(tmp_path):
    spec = _spec(tmp_path, "own", pipeline__steps=1)
    _run(spec, {1: [Directive(1, "set_params", {"params": {"trainer.lr": 0.5}})]})
    assert spec.trainer.lr == 1e-3


@pytest.mark.slow
def test_async_rollback_discards_in_flight_work_and_loses_nothing(tmp_path):
    spec = _spec(
        tmp_path,
        "arb",
        pipeline__mode="async",
        pipeline__steps=6,
        pipeline__max_policy_lag=1,
        checkpoint__keep_last=10,
    )
    target = _ckpt(tmp_path, "arb", 2)
    plan = {
        4: [Directive(1, "rollback", {"path": str(target), "step": 2})],
        5: [Directive(2, "set_params", {"params": {"pipeline.max_policy_lag": 0}})],
    }
    saved = {}

    class Keep(Trigger):  # keep a copy of the step-2 checkpoint as it was when the rollback was submitted
        def report(self, step, metrics):
            if step == 4 and "loss/policy" in metrics and "copy" not in saved:
                saved["copy"] = shutil.copytree(target, tmp_path / "copy")
            super().report(step, metrics)

    log = Log()
    control = LoggingControl(log)
    reporters = M.MultiReporter(
        [M.JsonlReporter(tmp_path / "arb" / M.METRICS_FILE), Keep(control, log, {k: list(v) for k, v in plan.items()})]
    )
    result = run(spec, reporters=reporters, control=control)
    assert [(r.ok, r.message) for r in control.results] == [
        (True, "restored step 2"),
        (True, "set pipeline.max_policy_lag=0"),
    ]
    assert log.steps() == [1, 2, 3, 4, 3, 4, 5, 6]
    versions = [e[2]["weights/version"] for e in log.entries if e[0] == "step"]
    assert versions == sorted(set(versions))  # strictly increasing across the rollback
    # staleness is measured in the renumbered versions: within the bound before and after the change
    stale = [e[2]["staleness/max"] for e in log.entries if e[0] == "step"]
    assert all(s <= 1 for s in stale[:7]) and stale[7] == 0  # the change applies from the next step (6)
    # every issued group exactly once: consumed on the current timeline, dropped, or left over
    trace = result["trace"]
    consumed = [g for step in trace["consumed"] for g in step]
    everything = consumed + trace["dropped"] + trace["leftover"]
    assert len(everything) == len(set(everything))
    assert set(everything) == set(range(max(everything) + 1))
    # the rewound steps' groups come back: the checkpoint's queue and in-flight work are trained on again
    ck = load_checkpoint(saved["copy"], keys=["queue", "in_flight"])
    pending = set(ck["queue"]["items"]["group_id"].tolist()) | {d["index"] for d in ck["in_flight"]}
    assert pending <= set(everything) and pending.isdisjoint(g for s in trace["consumed"][:2] for g in s)
    assert len(trace["consumed"]) == 6 and len(trace["rewound"]) == 1
