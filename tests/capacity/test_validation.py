"""Bad inputs are field errors: each out-of-range value names its field."""

from __future__ import annotations

import math

import pytest

from capacity import Config, Costs, InputError, LengthDistribution, Link
from capacity.hardware import H100_SXM, QWEN25_7B, costs_for
from tests.capacity.helpers import hand_config, hand_costs


def test_a_link_faster_than_physics_or_with_negative_latency_names_both_fields():
    with pytest.raises(InputError) as caught:
        Link(bandwidth_bytes_per_s=1e16, latency_s=-1.0)
    assert caught.value.fields == ["bandwidth_bytes_per_s", "latency_s"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("decode_s_per_token", 0.0),
        ("train_s_per_token", -1e-3),
        ("weight_bytes", math.inf),
        ("prefill_s_per_token", math.nan),
        ("optimizer_step_s", 1e9),
        ("gradient_bytes", -5.0),
        ("colocated_switch_s", True),
    ],
)
def test_costs_out_of_range_raise_naming_the_field(field, value):
    with pytest.raises(InputError) as caught:
        hand_costs(**{field: value})
    assert caught.value.fields == [field]
    assert isinstance(caught.value, ValueError)


def test_costs_from_plain_data_name_a_links_field_by_its_path():
    data = hand_costs().as_dict()
    data["intra_node"] = {"bandwidth_bytes_per_s": 0, "latency_s": 1e-6}
    data["surprise"] = 1
    del data["train_s_per_token"]

    with pytest.raises(InputError) as caught:
        Costs.from_dict(data)

    assert sorted(caught.value.fields) == ["intra_node.bandwidth_bytes_per_s", "surprise", "train_s_per_token"]


def test_costs_round_trip_through_plain_data():
    costs = hand_costs()
    assert Costs.from_dict(costs.as_dict()) == costs


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"mode": "pipelined"}, "mode"),
        ({"on_lag_exceeded": "wait"}, "on_lag_exceeded"),
        ({"prompts_per_step": 0}, "prompts_per_step"),
        ({"queue_capacity": 7}, "queue_capacity"),  # less than one step's 8 samples
        ({"max_batch_tokens": 7}, "max_batch_tokens"),  # less than one request (3 + 5 tokens)
        ({"warmup_steps": 6}, "warmup_steps"),
        ({"mode": "sync", "rollout_instances": 2}, "rollout_instances"),  # more engines than trainer devices
        ({"mode": "async", "max_batch_size": 3}, "max_batch_size"),  # a group of 4 must start whole
        ({"mode": "async", "rollout_instances": 0}, "rollout_instances"),
        ({"shared_comm_domain": 1}, "shared_comm_domain"),
    ],
)
def test_bad_configurations_name_the_field(changes, field):
    with pytest.raises(InputError) as caught:
        hand_config(**changes)
    assert caught.value.fields == [field]


def test_every_bad_field_is_reported_at_once():
    with pytest.raises(InputError) as caught:
        Config(mode="x", group_size=0, seed=-1)
    assert caught.value.fields == ["mode", "group_size", "seed"]


def test_length_distribution_out_of_range_names_the_field():
    with pytest.raises(InputError) as caught:
        LengthDistribution(median=-3, max_new_tokens=0)
    assert caught.value.fields == ["median", "max_new_tokens"]


def test_derived_costs_refuse_an_mfu_above_one():
    with pytest.raises(InputError) as caught:
        costs_for(H100_SXM, QWEN25_7B, context_tokens=1024, mfu=1.5)
    assert caught.value.fields == ["mfu"]
