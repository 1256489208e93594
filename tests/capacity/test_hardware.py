"""Costs derived from published hardware figures follow the documented formulas."""

from __future__ import annotations

import pytest

from capacity import Config, InputError, LengthDistribution, simulate
from capacity.hardware import (
    ASCEND_910B,
    ASCEND_910C_SUPERNODE,
    H100_SXM,
    H200_SXM,
    PRESETS,
    QWEN25_7B,
    QWEN25_32B,
    SUPERNODES,
    costs_for,
    kv_cache_tokens,
)


@pytest.mark.parametrize("hw", PRESETS.values(), ids=PRESETS.keys())
def test_every_preset_cites_its_source(hw):
    assert "datasheet" in hw.source
    assert hw.devices_per_node == 8


def test_the_kv_cache_of_the_qwen_presets_follows_their_configs():
    assert QWEN25_7B.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2  # 57,344 bytes
    assert QWEN25_32B.kv_bytes_per_token == 262_144


def test_costs_for_applies_the_formulas():
    costs = costs_for(H100_SXM, QWEN25_7B, context_tokens=1000, mfu=0.5, memory_efficiency=0.5, link_efficiency=0.5)

    P, flops, memory = 7.61e9, 989e12 * 0.5, 3.35e12 * 0.5
    assert costs.train_s_per_token == pytest.approx(8 * P / flops)
    assert costs.prefill_s_per_token == pytest.approx(2 * P / flops)
    assert costs.decode_step_s == pytest.approx(2 * P / memory)  # the weights read once per step
    assert costs.decode_s_per_token == pytest.approx(2 * P / flops + 57_344 * 1000 / memory)
    assert costs.weight_bytes == pytest.approx(2 * P)
    assert costs.intra_node.bandwidth_bytes_per_s == pytest.approx(225e9)
    assert costs.inter_node.bandwidth_bytes_per_s == pytest.approx(25e9)
    assert costs.optimizer_offload_s == pytest.approx(12 * P / 32e9)


def test_a_faster_memory_decodes_faster_and_the_910b_trains_slower_than_the_h100():
    h100 = costs_for(H100_SXM, QWEN25_32B, context_tokens=2048)
    h200 = costs_for(H200_SXM, QWEN25_32B, context_tokens=2048)
    ascend = costs_for(ASCEND_910B, QWEN25_32B, context_tokens=2048)

    assert h200.decode_step_s < h100.decode_step_s
    assert h200.train_s_per_token == h100.train_s_per_token  # same bf16 peak
    assert ascend.train_s_per_token > h100.train_s_per_token


def test_derived_costs_simulate():
    costs = costs_for(H200_SXM, QWEN25_7B, context_tokens=1024)
    config = Config(
        mode="async",
        prompts_per_step=16,
        group_size=8,
        prompt_tokens=256,
        lengths=LengthDistribution(median=512, max_new_tokens=2048, sigma=0.8),
        trainer_ranks=8,
        rollout_instances=8,
        max_batch_size=128,
        max_batch_tokens=1 << 20,
        sim_steps=5,
        warmup_steps=1,
    )

    result = simulate(config, costs)

    assert 0 < result.samples_per_s < 1e4
    assert sum(result.time_split.values()) == pytest.approx(result.step_time_s, rel=1e-9)


def test_the_supernode_preset_carries_the_cited_figures_and_its_size():
    hw = SUPERNODES["ascend-910c-supernode"]

    assert hw is ASCEND_910C_SUPERNODE
    assert "arXiv:2506.12708" in hw.source and "ASSUMPTIONS" in hw.source
    assert (hw.bf16_flops, hw.memory_bytes, hw.memory_bandwidth) == (752e12, 128e9, 3.2e12)
    assert (hw.intra_node_bandwidth, hw.inter_node_bandwidth) == (392e9, 50e9)
    assert hw.devices_per_node == 384  # one UB domain
    assert not set(SUPERNODES) & set(PRESETS)


def test_the_kv_cache_holds_the_usable_memory_left_by_the_weights():
    # (128 GB x 0.9 - 2 x 7.61e9 B of weights) / 57,344 B per token
    assert kv_cache_tokens(ASCEND_910C_SUPERNODE, QWEN25_7B) == int((115.2e9 - 15.22e9) // 57_344)
    assert kv_cache_tokens(ASCEND_910C_SUPERNODE, QWEN25_7B) == 1_743_512
    assert kv_cache_tokens(ASCEND_910C_SUPERNODE, QWEN25_32B, usable_fraction=0.8) == int((102.4e9 - 65e9) // 262_144)


def test_a_model_too_large_for_the_device_is_named():
    with pytest.raises(InputError) as caught:
        kv_cache_tokens(ASCEND_910B, QWEN25_32B)  # 65 GB of weights, 57.6 GB usable

    assert caught.value.fields == ["model"]
