"""The per-device memory model (capacity/memory.py) against figures computed by hand.

The hand model: 2 layers, hidden 8, 2 heads of 4 (1 KV head), MLP 16, vocabulary 10, no biases, untied:
a layer has 2*8*8 (q, o) + 2*8*4 (k, v) + 3*8*16 (MLP) + 2*8 (norms) = 592 parameters; the model
2*10*8 (embedding, head) + 2*592 + 8 (final norm) = 1352.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from capacity.memory import (
    QWEN25,
    Generation,
    MemoryInputError,
    ModelShape,
    Training,
    generation_memory,
    run_memory,
    training_memory,
)

ROOT = Path(__file__).resolve().parents[2]
HAND = ModelShape(
    "hand", layers=2, hidden=8, heads=2, kv_heads=1, intermediate=16, vocab=10, tied_embeddings=False, qkv_bias=False
)
MIXED = Training(strategy="ddp", ranks=1, model_dtype="float32", mixed_precision=True, micro_batch_tokens=10)
# weights 1352*4, gradients 1352*4, moments 2*1352*4, autocast copies 1352*2,
# activations 2 layers * (6*8 + 2*4 + 4*16 = 120 elements) * 2 bytes * 10 tokens, logits 10 * (2+4+4) * 10
MIXED_TOTAL = 5408 + 5408 + 10816 + 2704 + 4800 + 1000


def test_the_hand_models_shape_and_kv_bytes():
    assert (HAND.layer_params, HAND.params) == (592, 1352)
    assert HAND.kv_bytes_per_token() == 2 * 2 * 1 * 4 * 2  # K and V, 2 layers, 1 KV head of 4, bf16
    assert HAND.activation_elements_per_token_layer() == 120


def test_qwen25_parameter_counts_match_the_published_sizes():
    # embeddings 152064*3584 (twice: untied) + 28 layers + the final norm, as the 7B's safetensors hold
    assert QWEN25["7B"].params == 2 * 152064 * 3584 + 28 * 233_057_792 + 3584 == 7_615_616_512
    assert [round(QWEN25[k].params / 1e9, 2) for k in ("0.5B", "1.5B", "32B")] == [0.49, 1.54, 32.76]


def test_ddp_mixed_precision_keeps_everything_on_every_rank():
    m = training_memory(HAND, MIXED)
    assert (m.weights, m.gradients, m.optimizer, m.compute_weights) == (5408, 5408, 10816, 2704)
    assert (m.activations, m.logits, m.reference) == (4800, 1000, 0)
    assert m.total == MIXED_TOTAL


def test_gradient_checkpointing_keeps_each_layers_input_and_one_layer():
    m = training_memory(HAND, Training(**{**vars(MIXED), "gradient_checkpointing": True}))
    assert m.activations == 2 * 8 * 2 * 10 + 120 * 2 * 10  # 320 + one layer's 2400


def test_fsdp_divides_the_state_and_gathers_two_layers_and_offload_moves_it_to_the_host():
    fsdp = Training(**{**vars(MIXED), "strategy": "fsdp", "ranks": 4})
    m = training_memory(HAND, fsdp)
    assert (m.weights, m.gradients, m.optimizer) == (1352, 1352, 2704)
    assert m.compute_weights == 2 * 592 * 2  # a layer (bigger than the 80-parameter embedding) and the next
    off = training_memory(HAND, Training(**{**vars(fsdp), "cpu_offload": True}))
    assert (off.weights, off.gradients, off.optimizer, off.compute_weights) == (0, 0, 0, 2368)


def test_pure_bf16_keeps_two_byte_state_without_master_weights():
    m = training_memory(HAND, Training(model_dtype="bfloat16", micro_batch_tokens=10))
    assert (m.weights, m.gradients, m.optimizer, m.compute_weights) == (2704, 2704, 5408, 0)


def test_engines_weights_and_cache():
    assert generation_memory(HAND, Generation(kv_tokens=100), 1e9).total == 2704 + 100 * 32
    vllm = generation_memory(HAND, Generation(engine="vllm", gpu_memory_utilization=0.5), 100_000)
    assert (vllm.weights, vllm.kv_cache) == (2704, 50_000 - 2704)


def test_each_mode_puts_training_and_generation_where_it_runs():
    builtin = Generation(kv_tokens=100)  # weights 2704 + cache 3200
    a = run_memory(HAND, "async", MIXED, builtin, 1e9, keep=2)
    assert (a.trainer_device, a.rollout_device, a.eval_device) == (MIXED_TOTAL, 5904, 0)
    assert a.host_weights == 3 * 1352 * 4  # two kept fp32 versions and the shared buffer
    assert run_memory(HAND, "async", MIXED, builtin, 1e9, eval_device=True).eval_device == 5904
    assert run_memory(HAND, "sync", MIXED, builtin, 1e9).trainer_device == MIXED_TOTAL + 5904
    assert run_memory(HAND, "colocated", MIXED, builtin, 1e9).trainer_device == MIXED_TOTAL + 3200  # shared weights
    vllm = Generation(engine="vllm", gpu_memory_utilization=0.5)
    # generation phase: vLLM's 50000 beside the weights and moments kept between steps (5408 + 10816)
    assert run_memory(HAND, "colocated", MIXED, vllm, 100_000).trainer_device == 16224 + 50_000
    assert run_memory(HAND, "colocated", MIXED, vllm, 100_000, offload_optimizer=True).trainer_device == 55_408
    assert run_memory(HAND, "colocated", MIXED, vllm, 10_000).trainer_device == MIXED_TOTAL  # training is larger


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: training_memory(HAND, Training(strategy="zero3")), "trainer.strategy"),
        (
            lambda: training_memory(HAND, Training(model_dtype="bfloat16", mixed_precision=True)),
            "trainer.mixed_precision",
        ),
        (lambda: training_memory(HAND, Training(cpu_offload=True)), "trainer.cpu_offload"),
        (lambda: training_memory(HAND, Training(ranks=0)), "resources.trainer_devices"),
        (lambda: generation_memory(HAND, Generation(engine="sglang"), 1e9), "rollout.engine"),
        (
            lambda: generation_memory(HAND, Generation(engine="vllm", gpu_memory_utilization=1.5), 1e9),
            "rollout.gpu_memory_utilization",
        ),
        (lambda: run_memory(HAND, "hybrid", MIXED, Generation(), 1e9), "pipeline.mode"),
    ],
)
def test_bad_input_names_the_field(call, field):
    with pytest.raises(MemoryInputError, match=field):
        call()


def test_the_memory_model_loads_without_torch():
    code = "import sys, capacity.memory; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert not {name.split(".")[0] for name in out.stdout.split()} & {"torch", "django", "runtime"}
