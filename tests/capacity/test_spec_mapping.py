"""Config.from_spec: the runtime's spec fields become model knobs, and what the model leaves out is named."""

from __future__ import annotations

from pydantic import BaseModel

from capacity import Config, LengthDistribution, NotModelled
from capacity.spec_mapping import (
    MAPPED,
    NO_TIMING_EFFECT,
    NOT_MODELLED,
    NOT_MODELLED_SECTIONS,
    THROUGH_INPUTS,
    UNKNOWN,
)
from runtime.spec import RunSpec, load_spec


def resolved(data: dict) -> dict:
    return load_spec(data).resolved()


def test_a_sync_spec_maps_its_knobs_and_names_evaluation_as_not_modelled():
    spec = resolved(
        {
            "algorithm": {"group_size": 4},
            "rollout": {"max_new_tokens": 24, "max_batch_size": 32},
            "pipeline": {"prompts_per_step": 16, "steps": 30},
            "resources": {"trainer_devices": 2},
        }
    )

    config, mapping = Config.from_spec(spec, prompt_tokens=12, lengths=LengthDistribution(median=10, max_new_tokens=99))

    assert (config.mode, config.group_size, config.prompts_per_step, config.run_steps) == ("sync", 4, 16, 30)
    assert (config.trainer_ranks, config.rollout_instances, config.max_batch_size) == (2, 1, 32)
    assert config.lengths == LengthDistribution(median=10, max_new_tokens=24)
    assert config.prompt_tokens == 12
    assert config.dispatch == "fifo"  # lock-step generates in issue order
    # the default eval_interval (10) evaluates; a checkpoint only at the end and no reward service do nothing
    assert mapping.not_modelled == [
        NotModelled("pipeline.eval_interval", NOT_MODELLED["pipeline.eval_interval"][1]),
    ]
    assert "model.builtin" in mapping.through_inputs
    assert "trainer.lr" in mapping.no_timing_effect


def test_an_async_spec_maps_the_staleness_knobs_and_names_each_effect_left_out():
    spec = resolved(
        {
            "pipeline": {
                "mode": "async",
                "max_policy_lag": 2,
                "on_lag_exceeded": "drop",
                "queue_capacity": 256,
                "eval_interval": 0,
            },
            "rollout": {"length_prediction": "off"},
            "resources": {"rollout_workers": 2},
            "reward": {"url": "http://reward.local/score"},
            "checkpoint": {"interval": 5},
        }
    )

    config, mapping = Config.from_spec(spec)

    assert (config.mode, config.max_policy_lag, config.on_lag_exceeded, config.queue_capacity) == (
        "async",
        2,
        "drop",
        256,
    )
    assert (config.rollout_instances, config.dispatch, config.weight_publication) == (2, "fifo", "unicast")
    assert mapping.not_modelled_fields == [
        "reward.url",
        "reward.concurrency",
        "pipeline.transfer_max_bytes",
        "pipeline.transfer_window_s",
        "pipeline.transfer_shm_min_bytes",
        "checkpoint.interval",
    ]


def test_the_bench_sync_split_run_is_async_with_lag_zero():
    spec = resolved({"pipeline": {"mode": "async", "max_policy_lag": 0, "on_lag_exceeded": "throttle"}})

    config, _ = Config.from_spec(spec)

    assert (config.mode, config.max_policy_lag, config.on_lag_exceeded, config.dispatch) == (
        "async",
        0,
        "throttle",
        "longest_first",
    )


def test_a_gym_run_is_named_as_not_modelled_by_its_workload_and_sections():
    spec = resolved({})
    spec.update({"workload": "gym", "env": {"id": "CartPole-v1"}, "agent": {"algorithm": "ppo"}})

    _, mapping = Config.from_spec(spec)

    assert mapping.not_modelled_fields[:3] == ["env", "agent", "workload"]


def test_a_field_the_model_does_not_know_is_named_never_dropped():
    spec = resolved({})
    spec["pipeline"]["speculative_decoding"] = True
    spec["experimental"] = {"fp8": True}

    _, mapping = Config.from_spec(spec)

    assert NotModelled("pipeline.speculative_decoding", UNKNOWN) in mapping.not_modelled
    assert NotModelled("experimental.fp8", UNKNOWN) in mapping.not_modelled


def test_every_field_of_the_runtime_spec_is_in_exactly_one_table():
    paths = set()
    for name, info in RunSpec.model_fields.items():
        section = info.annotation
        if name in NOT_MODELLED_SECTIONS:
            continue  # left out whole
        if isinstance(section, type) and issubclass(section, BaseModel):
            paths.update(f"{name}.{field}" for field in section.model_fields)
        else:
            paths.add(name)
    tables = [set(MAPPED), set(THROUGH_INPUTS), set(NO_TIMING_EFFECT), set(NOT_MODELLED)]
    classified = set().union(*tables)

    assert paths - classified == set()
    assert sum(len(t) for t in tables) == len(classified)  # no path in two tables
    # a table entry names a real field (a typo would classify nothing); `workload` arrives with the gym
    # workload's spec change
    assert classified - paths <= {"workload"}
