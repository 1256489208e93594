"""Async mode survives rollout processes killed mid-run: work re-issued, nothing lost or trained twice.

The kills happen at a step boundary (from the ``stop`` hook, which runs there), with the pids the
pipeline publishes on its Control. With ``max_policy_lag=0`` under ``throttle`` and a queue of
two steps, the work issued for the step after next cannot be generated before the next weights
are published: at the boundary some work is certainly held by the rollout processes, so the
kill really loses work in progress that must be issued again.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

from runtime.control import Control
from runtime.metrics import read_jsonl
from runtime.pipeline import run
from runtime.pipeline.driver import PipelineError
from runtime.weights.service import WeightService, WeightSubscriber
from tests.runtime.helpers import derived, tiny_spec

BASE = derived(
    seed=5,
    pipeline={"mode": "async", "max_policy_lag": 0, "on_lag_exceeded": "throttle", "queue_capacity": 32},
    checkpoint={"interval": 0},
)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _spec(tmp_path, **over):
    return tiny_spec(tmp_path, "restart", BASE, **over)


def _killer(control, plan):
    """A stop hook that SIGKILLs the rollout processes of the ranks ``plan[step]`` at that boundary."""
    killed: list[tuple[int, int, int]] = []

    def stop(step, metrics):
        pids = control.status()["rollout_pids"]
        for rank in plan.get(step, []):
            os.kill(pids[rank], signal.SIGKILL)
            killed.append((step, rank, pids[rank]))
        return False

    return stop, killed


def _rollout_children():
    return [p for p in multiprocessing.active_children() if p.name.startswith("rollout-")]


@pytest.mark.slow
def test_killed_rollout_processes_are_replaced_and_no_sample_is_lost_or_duplicated(tmp_path):
    # results through shared memory: a killed process's segments are swept, read ones unlinked
    spec = _spec(
        tmp_path,
        pipeline__steps=6,
        pipeline__transfer_shm_min_bytes=1,
        resources__rollout_workers=2,
        resources__rollout_restarts=2,
    )
    control = Control()
    stop, killed = _killer(control, {2: [0, 1], 4: [0]})  # both at once, then rank 0 a second time
    before = {n for n in os.listdir("/dev/shm") if n.startswith("tandem-")}
    result = run(spec, control=control, stop=stop)

    assert result["outcome"] == "completed" and result["steps"] == 6
    assert [(step, rank) for step, rank, _ in killed] == [(2, 0), (2, 1), (4, 0)]
    _, events = read_jsonl(tmp_path / "restart" / "metrics.jsonl")
    restarted = [e["payload"] for e in events if e["event"] == "rollout_restarted"]
    assert sorted((e["rank"], e["restarts"], e["reason"]) for e in restarted) == [
        (0, 1, "killed by SIGKILL"),
        (0, 2, "killed by SIGKILL"),
        (1, 1, "killed by SIGKILL"),
    ]
    # the work the killed processes held was issued again (at least the step after next's)
    assert sum(e["reissued"] for e in restarted if e["restarts"] == 1) >= spec.pipeline.prompts_per_step
    status = control.status()
    assert status["rollout_restarts"] == 3 and status["status"] == "finished"
    assert not {pid for _, _, pid in killed} & set(status["rollout_pids"])
    # every issued group exactly once: trained on, or left over (queue, in flight, re-issue list)
    trace = result["trace"]
    consumed = [g for step in trace["consumed"] for g in step]
    assert [len(step) for step in trace["consumed"]] == [4] * 6
    everything = consumed + trace["dropped"] + trace["leftover"]
    assert len(everything) == len(set(everything))
    assert set(everything) == set(range(max(everything) + 1))
    assert trace["dropped"] == []  # throttle never gives a prompt up
    steps, _ = read_jsonl(tmp_path / "restart" / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert all(r["staleness/max"] == 0 for r in steps)
    assert _rollout_children() == []
    # none left under any trainer's name: the sweep looks under this one's, where the children must name them
    assert {n for n in os.listdir("/dev/shm") if n.startswith("tandem-")} - before == set()


@pytest.mark.slow
def test_a_rollout_process_dying_beyond_its_restart_budget_fails_the_run_with_the_reason(tmp_path):
    spec = _spec(tmp_path, pipeline__steps=6, resources__rollout_workers=1, resources__rollout_restarts=0)
    control = Control()
    stop, killed = _killer(control, {1: [0]})
    with pytest.raises(PipelineError) as err:
        run(spec, control=control, stop=stop)
    assert str(err.value) == (
        "rollout process 0 killed by SIGKILL; its restart budget resources.rollout_restarts=0 is spent"
    )
    assert len(killed) == 1
    _, events = read_jsonl(tmp_path / "restart" / "metrics.jsonl")
    assert [e for e in events if e["event"] == "rollout_restarted"] == []
    assert _rollout_children() == []  # nothing left running


def _hold_the_lock(shared, ready):
    """Subscriber that blocks inside ``switch`` (holding the buffer's lock) until it is killed."""
    import time

    sub = WeightSubscriber(shared)

    def apply(state, version):
        ready.set()
        time.sleep(600)

    sub.switch(apply)


def _a_reader_holding_the_lock():
    """A weight service with a shared buffer, and a live reader process blocked inside ``switch``."""
    ctx = torch.multiprocessing.get_context("spawn")
    svc = WeightService(keep=0)
    shared = svc.shared_handle(torch.nn.Linear(3, 2).state_dict(), ctx)
    ready = ctx.Event()
    proc = ctx.Process(target=_hold_the_lock, args=(shared, ready), daemon=True)
    proc.start()
    assert ready.wait(60)
    return svc, shared, proc


def test_the_weight_lock_of_a_reader_killed_while_copying_is_released():
    svc, shared, proc = _a_reader_holding_the_lock()
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    svc.reader_gone(proc.pid)
    # publish needs the lock; on a separate thread so that a regression fails instead of hanging
    done = threading.Thread(target=svc.publish, args=({"weight": torch.ones(2, 3), "bias": torch.ones(2)},))
    done.start()
    done.join(timeout=60)
    assert not done.is_alive()
    assert svc.version == 1 and int(shared.meta[0]) == 1
    assert torch.equal(shared.tensors["weight"], torch.ones(2, 3))
    svc.reader_gone(12345678)  # a pid that never held it: nothing is released twice
    assert shared.lock.acquire(timeout=5)
    shared.lock.release()


@pytest.mark.slow
def test_a_rollout_process_killed_while_paused_is_replaced_before_resume(tmp_path):
    """From a thread, as an operator would: pause, kill a rollout process, see it replaced, resume."""
    from runtime import metrics as M
    from runtime.control import Directive

    spec = _spec(tmp_path, pipeline__steps=4, resources__rollout_workers=2, resources__rollout_restarts=1)
    control = Control()
    steps: list[int] = []

    class Pauser:
        def report(self, step, metrics):
            if "loss/policy" in metrics:
                steps.append(step)
                if step == 2:
                    control.submit(Directive(1, "pause"))

        def event(self, kind, payload):
            pass

        def close(self):
            pass

    seen: dict = {}

    def operator():
        def wait_for(predicate):
            deadline = time.monotonic() + 120
            while not predicate(control.status()) and time.monotonic() < deadline:
                time.sleep(0.01)
            return dict(control.status())

        paused = wait_for(lambda s: s.get("status") == "paused")
        victim = paused["rollout_pids"][0]
        os.kill(victim, signal.SIGKILL)
        seen["replaced"] = wait_for(lambda s: s.get("rollout_restarts") == 1)
        seen["victim"], seen["steps"] = victim, list(steps)
        control.submit(Directive(2, "resume"))

    thread = threading.Thread(target=operator)
    thread.start()
    jsonl = M.JsonlReporter(tmp_path / "restart" / M.METRICS_FILE)
    result = run(spec, control=control, reporters=M.MultiReporter([jsonl, Pauser()]))
    thread.join()
    assert seen["replaced"]["status"] == "paused" and seen["steps"] == [1, 2]  # replaced while still paused
    assert seen["victim"] not in seen["replaced"]["rollout_pids"] and len(seen["replaced"]["rollout_pids"]) == 2
    assert [(r.directive.id, r.ok) for r in control.results] == [(1, True), (2, True)]
    assert result["outcome"] == "completed" and steps == [1, 2, 3, 4]
    trace = result["trace"]
    everything = [g for step in trace["consumed"] for g in step] + trace["dropped"] + trace["leftover"]
    assert len(everything) == len(set(everything))
    assert set(everything) == set(range(max(everything) + 1))


def test_a_publish_waiting_on_a_frozen_reader_asks_its_owner_to_deal_with_it():
    """A reader frozen while copying (SIGSTOP, a stuck device call) is alive and recorded as the holder:
    nothing frees its lock by itself. The publish hands its pid to ``on_wait`` until the owner kills it."""
    svc, shared, proc = _a_reader_holding_the_lock()
    os.kill(proc.pid, signal.SIGSTOP)
    asked: list[int] = []

    def on_wait(pid):
        asked.append(pid)
        if len(asked) == 3:  # the owner's verdict: hung
            os.kill(pid, signal.SIGKILL)
            proc.join()
            svc.reader_gone(pid)

    svc.on_wait = on_wait
    done = threading.Thread(target=svc.publish, args=({"weight": torch.ones(2, 3), "bias": torch.ones(2)},))
    done.start()
    done.join(timeout=60)
    assert not done.is_alive()
    assert asked == [proc.pid] * 3 and svc.version == 1 and torch.equal(shared.tensors["bias"], torch.ones(2))


def _take_the_lock_silently(shared, ready):
    """Dies (when killed) in the instant between taking the lock and recording itself as its holder."""
    import time

    shared.lock.acquire()
    ready.set()
    time.sleep(600)


def test_the_weight_lock_of_a_reader_killed_before_recording_itself_is_released_after_a_grace_period():
    ctx = torch.multiprocessing.get_context("spawn")
    svc = WeightService(keep=0)
    shared = svc.shared_handle({"w": torch.zeros(2)}, ctx)
    ready = ctx.Event()
    proc = ctx.Process(target=_take_the_lock_silently, args=(shared, ready), daemon=True)
    proc.start()
    assert ready.wait(60)
    assert not shared.lock.acquire(timeout=0.2)  # held, and nobody recorded as its holder
    assert int(shared.meta[1]) == 0
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    svc.reader_died(proc.pid)  # returns once the lock can be taken again
    svc.publish({"w": torch.ones(2)})
    assert int(shared.meta[0]) == 1 and torch.equal(shared.tensors["w"], torch.ones(2))
    assert shared.lock.acquire(timeout=5)
    shared.lock.release()
