"""Fitting costs from measurement records, the measured-lengths distribution, the bench mapping, and
the host cores the processes of a CPU machine share."""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from capacity import Config, InputError, fixed_lengths, simulate
from capacity.calibrate import (
    BenchRun,
    Copy,
    EmpiricalLengths,
    EngineStep,
    Measurements,
    TrainStep,
    bench_config,
    empirical_lengths,
    fit_costs,
    fit_engine,
    fit_link,
    fit_train,
    nonnegative_least_squares,
    relative_error,
)
from capacity.engine import HostCores

STEP_S, PER_SEQ_S, PREFILL_S = 5e-4, 2e-5, 1.5e-5
TRAIN_S, OPTIMIZER_S = 3e-5, 0.02


def engine_steps() -> list[EngineStep]:
    return [
        EngineStep(d, p, STEP_S + PER_SEQ_S * d + PREFILL_S * p)
        for d, p in [(64, 0), (48, 0), (8, 0), (0, 96), (16, 24), (1, 0), (33, 12)]
    ]


def train_steps(tokens=(1000, 2000, 4000, 2500)) -> list[TrainStep]:
    return [TrainStep(t, TRAIN_S * t + OPTIMIZER_S) for t in tokens]


def copies(bandwidth: float, latency: float) -> list[Copy]:
    return [Copy(n, latency + n / bandwidth) for n in (1e6, 4e6, 1.6e7)]


def measurements(**changes) -> Measurements:
    values = dict(
        engine_steps=engine_steps(),
        train_steps=train_steps(),
        weight_bytes=4e5,
        staging=[Copy(4e5, 4e5 / 2e9), Copy(4e5, 4e5 / 2e9)],
        intra_node=copies(8e9, 1e-6),
        inter_node=copies(2e9, 5e-5),
        queue_takes_s=[3e-4, 1e-4, 2e-4],
        sample_bytes_per_token=21.5,
        colocated_switch_s=[0.01, 0.03, 0.02],
    )
    values.update(changes)
    return Measurements(**values)


# ---- fits ----


def test_engine_fit_recovers_known_costs():
    values, fit = fit_engine(engine_steps())
    assert values["decode_step_s"] == pytest.approx(STEP_S, rel=1e-9)
    assert values["decode_s_per_token"] == pytest.approx(PER_SEQ_S, rel=1e-9)
    assert values["prefill_s_per_token"] == pytest.approx(PREFILL_S, rel=1e-9)
    assert fit.points == 7
    assert fit.rms_s < 1e-12


def test_train_fit_separates_the_fixed_part_when_tokens_vary():
    values, fit = fit_train(train_steps())
    assert values["train_s_per_token"] == pytest.approx(TRAIN_S, rel=1e-9)
    assert values["optimizer_step_s"] == pytest.approx(OPTIMIZER_S, rel=1e-9)
    assert fit.note == ""


def test_train_fit_goes_through_the_origin_when_tokens_barely_vary():
    steps = [TrainStep(t, TRAIN_S * t) for t in (1000, 1010, 1050)]
    values, fit = fit_train(steps)
    assert values == {"train_s_per_token": pytest.approx(TRAIN_S, rel=1e-9), "optimizer_step_s": 0.0}
    assert "through the origin" in fit.note


def test_train_fit_is_per_update():
    steps = [TrainStep(2 * t, 2 * (TRAIN_S * t + OPTIMIZER_S), updates=2) for t in (1000, 3000)]
    values, _ = fit_train(steps)
    assert values["train_s_per_token"] == pytest.approx(TRAIN_S, rel=1e-9)
    assert values["optimizer_step_s"] == pytest.approx(OPTIMIZER_S, rel=1e-9)


def test_link_fit_recovers_latency_and_bandwidth():
    link, _ = fit_link("intra_node", copies(8e9, 1e-6))
    assert link.bandwidth_bytes_per_s == pytest.approx(8e9, rel=1e-9)
    assert link.latency_s == pytest.approx(1e-6, rel=1e-6)


def test_link_fit_with_one_copy_size_has_no_latency():
    link, fit = fit_link("staging", [Copy(4e5, 2e-4), Copy(4e5, 2e-4)])
    assert link.bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-9)
    assert link.latency_s == 0.0
    assert "latency taken as 0" in fit.note


def test_nonnegative_least_squares_clamps_a_negative_coefficient():
    columns = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    y = np.array([3.0, 2.0, 1.0])  # unconstrained: intercept 4, slope -1
    x = nonnegative_least_squares(columns, y)
    assert x[1] == 0.0
    assert x[0] == pytest.approx(2.0, rel=1e-12)  # the mean, the best constant


def test_a_generators_work_per_sample_is_charged_to_admission():
    c = fit_costs(measurements(sample_overhead_s=1.2e-3, prompt_tokens=12.0)).costs
    assert c.prefill_s_per_token == pytest.approx(PREFILL_S + 1e-4, rel=1e-9)
    assert c.decode_s_per_token == pytest.approx(PER_SEQ_S, rel=1e-9)


def test_fit_costs_recovers_every_cost():
    calibrated = fit_costs(measurements())
    c = calibrated.costs
    assert (c.decode_step_s, c.decode_s_per_token, c.prefill_s_per_token) == pytest.approx(
        (STEP_S, PER_SEQ_S, PREFILL_S), rel=1e-9
    )
    assert (c.train_s_per_token, c.optimizer_step_s) == pytest.approx((TRAIN_S, OPTIMIZER_S), rel=1e-9)
    assert c.weight_bytes == 4e5
    assert c.local.bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-9)
    assert c.intra_node.bandwidth_bytes_per_s == pytest.approx(8e9, rel=1e-9)
    assert c.inter_node.bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-9)
    assert c.inter_node.latency_s == pytest.approx(5e-5, rel=1e-6)
    assert c.queue_op_s == 1e-4  # the least take: one that found its batch waiting
    assert c.colocated_switch_s == 0.02  # the median
    assert c.sample_bytes_per_token == 21.5
    assert [f["name"] for f in calibrated.diagnostics()] == [
        "engine step",
        "train step",
        "staging",
        "intra_node",
        "inter_node",
    ]


# ---- bad records ----


def test_bad_records_are_named():
    steps = engine_steps()
    steps[3] = EngineStep(16, 0, -0.1)
    steps[5] = EngineStep(2.5, 0, 0.1)  # type: ignore[arg-type]
    with pytest.raises(InputError) as info:
        fit_costs(
            measurements(
                engine_steps=steps,
                train_steps=[TrainStep(100, 0.1, updates=0)],
                queue_takes_s=[float("nan")],
                weight_bytes=0,
                prompt_tokens=0,
            )
        )
    assert info.value.fields == [
        "engine_steps[3].seconds",
        "engine_steps[5].decoded",
        "train_steps[0].updates",
        "weight_bytes",
        "queue_takes_s[0]",
        "prompt_tokens",
    ]


def test_too_few_records_are_named():
    with pytest.raises(InputError) as info:
        fit_costs(measurements(engine_steps=engine_steps()[:2], staging=[]))
    assert info.value.fields == ["engine_steps", "staging"]


def test_an_engine_whose_step_time_does_not_grow_is_refused():
    flat = [EngineStep(d, 0, 0.001) for d in (1, 8, 64)]
    with pytest.raises(InputError) as info:
        fit_engine(flat)
    assert info.value.fields == ["engine_steps"]


# ---- lengths ----


def test_empirical_lengths_replay_measured_groups():
    lengths = empirical_lengths([[3, 5], [7, 9], [2, 2]], max_new_tokens=9)
    assert isinstance(lengths, EmpiricalLengths)
    assert lengths.median == 4.0
    assert lengths.mean == pytest.approx(28 / 6)
    rng = np.random.default_rng(0)
    drawn = [tuple(lengths.group(rng, 2)) for _ in range(50)]
    assert set(drawn) == {(3, 5), (7, 9), (2, 2)}
    other = lengths.group(rng, 5)  # another group size: measured lengths one by one
    assert len(other) == 5 and set(other) <= {2, 3, 5, 7, 9}


def test_empirical_lengths_refuse_lengths_past_the_limit():
    with pytest.raises(InputError) as info:
        empirical_lengths([[3, 12]], max_new_tokens=9)
    assert info.value.fields == ["groups[0][1]"]
    with pytest.raises(InputError) as info:
        EmpiricalLengths(median=3, max_new_tokens=9)
    assert info.value.fields == ["groups"]


# ---- the bench mapping ----


def run(**changes) -> BenchRun:
    values = dict(name="async-2", mode="async", prompts_per_step=16, group_size=8, max_new_tokens=48, steps=20)
    values.update(warmup_steps=3, rollout_instances=2, max_policy_lag=1)
    values.update(changes)
    return BenchRun(**values)


def test_bench_config_maps_an_async_run():
    lengths = empirical_lengths([[48] * 8, [12] * 8], 48)
    config = bench_config(run(), lengths, prompt_tokens=12, host_cores=2)
    assert (config.mode, config.prompts_per_step, config.group_size, config.prompt_tokens) == ("async", 16, 8, 12)
    assert (config.rollout_instances, config.trainer_ranks, config.host_cores) == (2, 1, 2)
    assert (config.max_policy_lag, config.on_lag_exceeded, config.capacity) == (1, "throttle", 640)
    assert (config.sim_steps, config.warmup_steps, config.run_steps) == (20, 3, 20)
    assert (config.max_batch_size, config.max_batch_tokens, config.dispatch) == (64, 16384, "longest_first")
    assert config.lengths is lengths


def test_bench_config_maps_lock_step_runs_to_one_process():
    lengths = empirical_lengths([[10] * 8], 48)
    for mode in ("sync", "colocated"):
        config = bench_config(run(mode=mode, rollout_instances=1), lengths, 12, host_cores=2)
        assert (config.mode, config.rollout_instances, config.host_cores) == (mode, 1, None)
    fifo = bench_config(run(length_prediction="off"), lengths, 12)
    assert fifo.dispatch == "fifo"


def test_bench_config_refuses_lengths_of_another_limit():
    with pytest.raises(InputError) as info:
        bench_config(run(), empirical_lengths([[10] * 8], 24), 12)
    assert info.value.fields == ["lengths.max_new_tokens"]


def test_relative_error():
    assert relative_error(110.0, 100.0) == pytest.approx(0.1)
    with pytest.raises(InputError):
        relative_error(1.0, 0.0)


# ---- host cores ----


def finish_times(cores: int, jobs: list[tuple[float, float]]) -> list[float]:
    """(start, seconds) jobs on ``cores``; when each finished."""
    env = simpy.Environment()
    host = HostCores(env, cores)
    done: list[float] = [0.0] * len(jobs)

    def job(i: int, start: float, seconds: float):
        yield env.timeout(start)
        yield host.run(seconds)
        done[i] = env.now

    for i, (start, seconds) in enumerate(jobs):
        env.process(job(i, start, seconds))
    env.run()
    return done


def test_host_cores_share_equally_and_never_speed_one_process_up():
    assert finish_times(2, [(0, 1.0), (0, 1.0)]) == [1.0, 1.0]  # a core each
    assert finish_times(2, [(0, 1.0)]) == [1.0]  # one thread: one core, whatever is free
    assert finish_times(2, [(0, 1.0), (0, 1.0), (0, 1.0)]) == pytest.approx([1.5, 1.5, 1.5])
    # a third job arrives at 0.5: 0.5 s left each, at 2/3 speed -> the first two end at 1.25; the third
    # did 0.5 of its 1.0 by then and finishes the rest alone at full speed
    assert finish_times(2, [(0, 1.0), (0, 1.0), (0.5, 1.0)]) == pytest.approx([1.25, 1.25, 1.75])


def test_oversubscribed_host_slows_the_pipeline_and_enough_cores_change_nothing():
    from tests.capacity.helpers import hand_config, hand_costs

    config = hand_config(mode="async", rollout_instances=2, lengths=fixed_lengths(5), max_policy_lag=1)
    costs = hand_costs()
    free = simulate(config, costs)
    roomy = simulate(config.with_(host_cores=3), costs)  # a core per process: the same steps
    assert roomy.step_time_s == pytest.approx(free.step_time_s, rel=1e-12)
    assert roomy.time_split == pytest.approx(free.time_split, rel=1e-12, abs=1e-15)
    assert roomy.mean_staleness == free.mean_staleness
    shared = simulate(config.with_(host_cores=1), costs)
    assert shared.step_time_s > free.step_time_s * 1.2


def test_host_cores_must_be_positive():
    with pytest.raises(InputError) as info:
        Config(host_cores=0)
    assert info.value.fields == ["host_cores"]
