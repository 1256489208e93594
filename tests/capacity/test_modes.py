"""The modes against hand-computed step times (deterministic lengths: every figure is exact)."""

from __future__ import annotations

import pytest

from capacity import Bottleneck, LengthDistribution, Link, simulate
from capacity.result import SPLIT_KEYS
from tests.capacity.helpers import hand_config, hand_costs

B, P_TOKENS, L = 8, 3, 5  # samples per step, prompt tokens, response tokens of hand_config
# one engine batch: the first step prefills every prompt (each sequence's first token), then L - 1 decode steps
GENERATE = L * 0.01 + B * P_TOKENS * 0.0005 + (L - 1) * B * 0.001  # 0.094 s
TRAIN = B * (P_TOKENS + L) * 0.002 + 0.05  # 0.178 s: every token trained, one optimizer step
WEIGHT_COPY = 0.001 + 1e6 / 1e8  # 0.011 s: the local link's latency + bytes / bandwidth


def test_a_sync_step_is_generate_plus_train_plus_weight_sync_exactly():
    result = simulate(hand_config(mode="sync"), hand_costs())

    assert result.step_time_s == pytest.approx(GENERATE + TRAIN + WEIGHT_COPY, rel=1e-12)
    assert result.time_split == pytest.approx(
        {**dict.fromkeys(SPLIT_KEYS, 0.0), "generate": GENERATE, "train": TRAIN, "weight_sync": WEIGHT_COPY},
        rel=1e-12,
    )
    assert result.samples_per_s == pytest.approx(B / (GENERATE + TRAIN + WEIGHT_COPY), rel=1e-12)
    assert result.tokens_per_s == pytest.approx(B * L / (GENERATE + TRAIN + WEIGHT_COPY), rel=1e-12)
    assert (result.mean_staleness, result.max_staleness, result.dropped_samples) == (0.0, 0, 0)
    assert result.bottleneck is Bottleneck.TRAINING
    assert result.steps_measured == 4
    assert result.run_time_s == pytest.approx(50 * result.step_time_s)


def test_sync_generates_a_step_in_chunks_of_max_batch_size_over_group_size_prompts():
    # 4 slots: one prompt (4 sequences) at a time, so the step's generation is two batches in a row
    result = simulate(hand_config(mode="sync", max_batch_size=4), hand_costs())

    one_prompt = L * 0.01 + 4 * P_TOKENS * 0.0005 + (L - 1) * 4 * 0.001
    assert result.time_split["generate"] == pytest.approx(2 * one_prompt, rel=1e-12)


def test_colocated_pays_two_switches_and_the_optimizer_round_trip_and_no_weight_copy():
    costs = hand_costs(colocated_switch_s=0.2, optimizer_offload_s=0.3, optimizer_reload_s=0.4)

    result = simulate(hand_config(mode="colocated", offload_optimizer=True), costs)

    switch = 2 * 0.2 + 0.3 + 0.4
    assert result.time_split["switch"] == pytest.approx(switch, rel=1e-12)
    assert result.time_split["weight_sync"] == 0.0
    assert result.step_time_s == pytest.approx(GENERATE + TRAIN + switch, rel=1e-12)
    assert result.bottleneck is Bottleneck.SWITCH


def test_colocated_without_offload_pays_only_the_switches():
    result = simulate(hand_config(mode="colocated"), hand_costs(colocated_switch_s=0.2, optimizer_offload_s=0.3))

    assert result.time_split["switch"] == pytest.approx(0.4, rel=1e-12)


def test_data_parallel_ranks_split_the_tokens_and_all_reduce_each_update():
    config = hand_config(mode="sync", trainer_ranks=2, updates_per_step=2, devices_per_node=8)

    result = simulate(config, hand_costs())

    per_rank = B // 2 * (P_TOKENS + L) * 0.002  # interleaved shards of equal samples
    ring = 2 * (2 * 1 * 0.0001 + 2 * 1 / 2 * 1e6 / 1e8)  # two updates of 2(N-1) alpha + 2(N-1)/N n / beta, N = 2
    assert result.time_split["train"] == pytest.approx(per_rank + 2 * 0.05, rel=1e-12)
    assert result.time_split["allreduce"] == pytest.approx(ring, rel=1e-12)
    scatter = 0.0001 + B * (P_TOKENS + L) * 16.0 / 2 / 1e8  # the leader sends rank 1 its half of the batch
    assert result.time_split["transfer"] == pytest.approx(scatter, rel=1e-12)


def test_async_hides_generation_behind_training_when_training_is_longer():
    costs = hand_costs(train_s_per_token=0.01)  # training 0.69 s per step, generation 0.094 s
    config = hand_config(mode="async", max_policy_lag=1)

    result = simulate(config, costs)

    take = B * (P_TOKENS + L) * 16.0 / 1e8  # the leader's one request: the batch's bytes over the intra link
    train = B * (P_TOKENS + L) * 0.01 + 0.05
    assert result.time_split["wait"] == 0.0
    assert result.step_time_s == pytest.approx(take + train + WEIGHT_COPY, rel=1e-12)
    assert result.bottleneck is Bottleneck.TRAINING
    assert result.max_staleness <= 1


def test_async_with_lag_zero_is_lock_step_on_the_split_placement():
    result = simulate(hand_config(mode="async", max_policy_lag=0), hand_costs())

    assert (result.mean_staleness, result.max_staleness, result.dropped_samples) == (0.0, 0, 0)
    # the trainer waits for each step's generation, which waits for the previous step's weights
    assert result.time_split["wait"] > GENERATE
    assert result.bottleneck is Bottleneck.TRAINING


def test_drop_discards_samples_that_waited_past_the_lag_bound():
    # training far slower than generation: a queue of 5 steps fills, and its oldest samples go stale
    costs = hand_costs(train_s_per_token=0.05)

    result = simulate(hand_config(mode="async", max_policy_lag=1, on_lag_exceeded="drop"), costs)

    assert result.dropped_samples > 0
    assert result.max_staleness <= 1


def test_weight_delivery_that_starves_the_engines_is_named_the_bottleneck():
    # remote instances behind a 1 MB/s inter-node link: a 1 MB version takes a second to arrive
    costs = hand_costs(inter_node=Link(1e6, 1e-3), train_s_per_token=1e-5)
    config = hand_config(mode="async", max_policy_lag=1, rollout_instances=0, remote_rollout_instances=1)

    result = simulate(config, costs)

    assert result.bottleneck is Bottleneck.WEIGHT_SYNC
    assert result.rollout_split["await_weights"] > result.rollout_split["generate"]


def test_the_same_seed_gives_the_same_result_and_another_seed_other_lengths():
    config = hand_config(mode="async", lengths=LengthDistribution(median=8, max_new_tokens=32, sigma=0.8))

    first, again = simulate(config, hand_costs()), simulate(config, hand_costs())
    other = simulate(config.with_(seed=1), hand_costs())

    assert first == again
    assert other.tokens_per_s != first.tokens_per_s
