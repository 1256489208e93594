"""Costs and configurations small enough to compute by hand."""

from __future__ import annotations

from capacity import Config, Costs, Link, fixed_lengths


def hand_costs(**changes) -> Costs:
    values = dict(
        decode_step_s=0.01,
        decode_s_per_token=0.001,
        prefill_s_per_token=0.0005,
        train_s_per_token=0.002,
        optimizer_step_s=0.05,
        weight_bytes=1e6,
        local=Link(1e8, 0.001),
        intra_node=Link(1e8, 1e-4),
        inter_node=Link(1e7, 1e-3),
    )
    values.update(changes)
    return Costs(**values)


def hand_config(**changes) -> Config:
    """2 prompts x 4 samples, 3-token prompts, every response 5 tokens: one engine batch holds a step."""
    values = dict(
        prompts_per_step=2,
        group_size=4,
        prompt_tokens=3,
        lengths=fixed_lengths(5),
        max_batch_size=8,
        max_batch_tokens=1024,
        sim_steps=6,
        warmup_steps=2,
    )
    values.update(changes)
    return Config(**values)
