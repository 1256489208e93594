"""Continuous batching in the simulated engine, step by step against hand-computed times."""

from __future__ import annotations

import pytest
import simpy

from capacity.engine import Group, RolloutEngine
from tests.capacity.helpers import hand_costs

# one engine step: 1 s fixed, 0.1 s per decoded sequence, 0.01 s per prefilled prompt token
COSTS = hand_costs(decode_step_s=1.0, decode_s_per_token=0.1, prefill_s_per_token=0.01)


def run_engine(groups_at: list[tuple[float, list[int]]], slots: int = 2, until: float = 100.0) -> dict[int, float]:
    """Submit one-prompt groups (2-token prompts) at the given times; when each group finished."""
    env = simpy.Environment()
    finished: dict[int, float] = {}
    engine = RolloutEngine(
        env,
        COSTS,
        max_batch_size=slots,
        max_batch_tokens=10_000,
        max_new_tokens=16,
        on_done=lambda g: finished.__setitem__(g.index, env.now),
    )

    def submit(index: int, at: float, lengths: list[int]):
        yield env.timeout(at)
        engine.submit(Group(index, lengths, prompt_tokens=2, predicted=0.0))

    for index, (at, lengths) in enumerate(groups_at):
        env.process(submit(index, at, lengths))
    env.run(until=until)
    return finished


def test_a_finished_sequence_frees_its_slot_for_the_next_request_and_step_time_follows_the_batch():
    # two slots; A (1 token) and B (5 tokens) start together, C (2 tokens) waits for A's slot
    finished = run_engine([(0.0, [1]), (0.0, [5]), (0.0, [2])])

    step1 = 1.0 + 2 * 2 * 0.01  # A and B prefilled: A done, B has 4 to go
    step2 = 1.0 + 0.1 * 1 + 2 * 0.01  # B decodes, C prefilled into A's slot
    step3 = 1.0 + 0.1 * 2  # B and C decode: C done
    step4 = step5 = 1.0 + 0.1 * 1  # B alone
    assert finished == {
        0: pytest.approx(step1),
        2: pytest.approx(step1 + step2 + step3),
        1: pytest.approx(step1 + step2 + step3 + step4 + step5),
    }


def test_a_request_arriving_mid_run_joins_at_the_next_step_boundary():
    # A runs alone (10 tokens); B arrives at 2.5 s, inside A's third step (2.12 .. 3.22 s)
    finished = run_engine([(0.0, [10]), (2.5, [1])])

    first = 1.0 + 2 * 0.01
    alone = 1.0 + 0.1
    joined = 1.0 + 0.1 * 1 + 2 * 0.01  # A decodes, B prefills (its only token)
    assert finished[1] == pytest.approx(first + 2 * alone + joined)
    assert finished[0] == pytest.approx(first + 2 * alone + joined + 6 * alone)  # tokens 5 to 10 alone again


def test_a_group_starts_whole_and_a_full_engine_makes_it_wait():
    # two slots: a group of two waits until both are free
    finished = run_engine([(0.0, [3]), (0.0, [1, 1])])

    three_alone = (1.0 + 2 * 0.01) + 2 * 1.1
    assert finished[0] == pytest.approx(three_alone)
    assert finished[1] == pytest.approx(three_alone + 1.0 + 2 * 2 * 0.01)


def test_throttled_work_waits_for_its_weights_without_holding_back_other_work():
    env = simpy.Environment()
    started: dict[int, int] = {}
    engine = RolloutEngine(
        env, COSTS, max_batch_size=4, max_batch_tokens=10_000, max_new_tokens=16, on_done=lambda g: None
    )
    late = Group(0, [2], prompt_tokens=2, predicted=0.0, min_version=1)
    now = Group(1, [2], prompt_tokens=2, predicted=0.0)

    def scenario():
        engine.submit(late)
        engine.submit(now)
        yield env.timeout(10.0)
        started[now.index] = now.version
        engine.offer_weights(1, load_s=0.5)
        yield env.timeout(10.0)
        started[late.index] = late.version

    env.process(scenario())
    env.run(until=30.0)
    assert started == {1: 0, 0: 1}
    assert engine.load_s == 0.5
