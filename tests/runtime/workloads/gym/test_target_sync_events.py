"""DQN's target sync as events (``target/sync_events``, one per sync, in the step that made it) and off the
update's critical path: a background sync gives the same learner bit for bit as an inline one, the update
waits for it before reading the target, and ``start`` returns before the sync is done."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from runtime.workloads.gym import metric_names as N
from runtime.workloads.gym import target_sync
from runtime.workloads.gym.envs import describe_spaces, make_env, make_vector_env
from runtime.workloads.gym.learners import DQNConfig, DQNLearner, sampling_policy
from runtime.workloads.gym.sampler import SegmentSampler
from runtime.workloads.gym.target_sync import TargetSync
from tests.runtime.workloads.gym.helpers import assert_same_state, sync_loop

# 32 env steps per training step: no update in steps 0-1 (64 env steps < learning_starts 65), then 2 updates
# a step (updates 1-2 in step 2, 3-4 in step 3, ...) and a sync after every 3rd update: 3, 6, 9, 12, 15.
CFG = DQNConfig(hidden=(16,), batch_size=8, learning_starts=65, updates_per_step=2, target_update_interval=3, tau=0.5)
EVENTS = [0, 0, 0, 1, 1, 0, 1, 1, 0, 1]

torch.set_num_threads(1)


def _run(background: bool, steps: int = len(EVENTS)):
    make = lambda: make_env("CartPole-v1")  # noqa: E731
    space = describe_spaces(make())
    learner = DQNLearner(space, CFG, seed=4, background_target_sync=background)
    sampler = SegmentSampler(make_vector_env(make, 2), space, 16, seed=4)
    return learner, sync_loop(learner, sampler, sampling_policy(space, CFG), range(steps))


@pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])
def test_each_sync_is_an_event_of_the_step_that_made_it(background):
    learner, metrics = _run(background)
    assert [m[N.TARGET_SYNC_EVENTS] for m in metrics] == EVENTS
    assert [m[N.TARGET_SYNCS] for m in metrics] == [sum(EVENTS[: i + 1]) for i in range(len(EVENTS))]
    assert learner.updates == 2 * (len(EVENTS) - 2) and learner.target_syncs == sum(EVENTS)
    # No update, so no sync to start or wait for: exactly no time held up.
    assert [m[N.TARGET_SYNC_WAIT] for m in metrics[:2]] == [0.0, 0.0]
    assert all(m[N.TARGET_SYNC_WAIT] >= 0.0 for m in metrics)


def test_a_background_sync_gives_the_inline_result_bit_for_bit():
    inline, inline_metrics = _run(background=False)
    background, background_metrics = _run(background=True)
    untimed = lambda ms: [{k: v for k, v in m.items() if not k.startswith("time/")} for m in ms]  # noqa: E731
    assert untimed(background_metrics) == untimed(inline_metrics)
    assert_same_state(background.state_dict(), inline.state_dict())


def _nets() -> tuple[nn.Module, nn.Module]:
    target, online = nn.Linear(3, 2), nn.Linear(3, 2)
    with torch.no_grad():
        for p in target.parameters():
            p.fill_(4.0)
        for p in online.parameters():
            p.fill_(2.0)
    return target, online


def test_start_returns_before_the_sync_is_done_and_wait_lands_it(monkeypatch):
    gate, entered = threading.Event(), threading.Event()
    real = target_sync.polyak_update_

    def held(target, online, tau):
        entered.set()
        assert gate.wait(60.0), "the test never opened the gate"
        real(target, online, tau)

    monkeypatch.setattr(target_sync, "polyak_update_", held)
    target, online = _nets()
    sync = TargetSync(target, online, tau=0.5, background=True)
    sync.start()  # an inline sync would stop here for good: the gate opens only below
    assert entered.wait(60.0)
    assert all(torch.equal(p, torch.full_like(p, 4.0)) for p in target.parameters())  # not yet synced
    gate.set()
    sync.wait()
    assert all(torch.equal(p, torch.full_like(p, 3.0)) for p in target.parameters())  # 0.5 * 2 + 0.5 * 4
    assert sync.take_step_stats()[0] == 1 and sync.take_step_stats() == (0, 0.0)
    sync.close()


def test_the_target_a_caller_reads_is_synced_and_a_failed_sync_is_raised(monkeypatch):
    target, online = _nets()
    sync = TargetSync(target, online, tau=1.0, background=True)
    sync.start()
    sync.start()  # a second sync waits for the first: at most one in flight
    sync.wait()
    assert all(torch.equal(p, torch.full_like(p, 2.0)) for p in target.parameters())

    def broken(target, online, tau):
        raise RuntimeError("sync failed")

    monkeypatch.setattr(target_sync, "polyak_update_", broken)
    sync.start()
    with pytest.raises(RuntimeError, match="sync failed"):
        sync.wait()
    sync.wait()  # the error is raised once; nothing is in flight after it
    sync.close()
