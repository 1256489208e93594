"""Per-device memory of a run (docs/memory.md's table), and what the async trainer process holds for
the consistency probe and the evaluator before and after they read the weight service's kept versions.

The table is computed by ``capacity.memory`` (no measurement). The second part builds, for a tiny
built-in model, what an async trainer process builds for its probe and its evaluator (with
``resources.eval_devices: 0``) and counts the bytes of the tensors they own, from their parameter
counts and element sizes: the copying implementation's models (a policy each, built as it built them)
against the ``PublishedPolicy`` skeletons bound to the weight service's version.

    python bench/memory_table.py            # all four Qwen2.5 sizes, every row
    python bench/memory_table.py --quick    # the 7B rows only (< 1 min)

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from capacity.memory import GIB, QWEN25, Generation, Training, run_memory, training_memory  # noqa: E402

DEVICE_BYTES = 80 * 10**9  # an 80 GB accelerator (H100 SXM, Ascend 910B's 64 GB is tighter)
RANKS = 8
TOKENS = 4096  # trainer.micro_batch_tokens' default
KV_TOKENS = 64 * 2048  # built-in engine: 64 sequences of 2048 tokens cached at once
VLLM_SHARE = 0.5  # rollout.gpu_memory_utilization for the colocated vLLM row
ROWS = [  # (label, strategy, ranks, gradient checkpointing, cpu_offload)
    ("ddp", "ddp", RANKS, False, False),
    ("ddp +ckpt", "ddp", RANKS, True, False),
    (f"fsdp/{RANKS}", "fsdp", RANKS, False, False),
    (f"fsdp/{RANKS} +ckpt", "fsdp", RANKS, True, False),
    (f"fsdp/{RANKS} +ckpt +offload", "fsdp", RANKS, True, True),
]


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def table(sizes: list[str]) -> list[dict]:
    rows = []
    print(
        "| model | training | weights+grads+AdamW | compute copies | activations | logits | sync | async trainer "
        "| async rollout | colocated (vLLM 0.5) | host: kept versions |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for size in sizes:
        model = QWEN25[size]
        for label, strategy, ranks, ckpt, offload in ROWS:
            t = Training(strategy, ranks, "float32", True, ckpt, offload, TOKENS)
            m = training_memory(model, t)
            builtin = Generation(kv_tokens=KV_TOKENS)
            vllm = Generation(engine="vllm", gpu_memory_utilization=VLLM_SHARE)
            sync = run_memory(model, "sync", t, builtin, DEVICE_BYTES)
            asy = run_memory(model, "async", t, builtin, DEVICE_BYTES, keep=2)
            colo = run_memory(model, "colocated", t, vllm, DEVICE_BYTES, offload_optimizer=True)
            row = {
                "model": model.name,
                "training": label,
                "state": m.weights + m.gradients + m.optimizer,
                "compute_weights": m.compute_weights,
                "activations": m.activations,
                "logits": m.logits,
                "sync": sync.trainer_device,
                "async_trainer": asy.trainer_device,
                "async_rollout": asy.rollout_device,
                "colocated_vllm": colo.trainer_device,
                "host_kept": asy.host_weights,
            }
            rows.append(row)
            cells = [row[k] for k in list(row)[2:]]
            print(f"| {model.name} | {label} | " + " | ".join(gib(c) for c in cells) + " |")
    print(f"(GiB per device; {DEVICE_BYTES / 1e9:.0f} GB devices, micro-batch {TOKENS} tokens, bf16 compute with")
    print(f" fp32 master weights, built-in engine caching {KV_TOKENS} tokens; host column: 2 kept fp32 versions")
    print(" and the shared buffer)")
    return rows


def probe_and_evaluator_bytes() -> dict[str, int]:
    """Bytes of tensors the async trainer process owns for its probe and its evaluator, before and after."""
    import torch

    from runtime.models import build_policy
    from runtime.spec import load_spec
    from runtime.weights.service import WeightService
    from runtime.workloads.llm.models import build_models
    from runtime.workloads.llm.workload import LLMWorkload

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    spec = load_spec({"name": "memory", "model": {"builtin": "small-qwen2"}})
    models = build_models(spec, cpu)
    service = WeightService(keep=2)
    service.initialize({k: v.detach() for k, v in models.policy.state_dict().items()})
    kept = {t.data_ptr() for t in service.state(0).values()}

    def owned(module: torch.nn.Module) -> int:  # bytes of parameters that are not the service's tensors
        return sum(
            p.numel() * p.element_size()
            for p in module.parameters()
            if p.device.type != "meta" and p.data_ptr() not in kept
        )

    copy, _ = build_policy(spec.model, cpu, seed=spec.seed)  # what each of the two built before
    before = owned(copy)
    probe = LLMWorkload().consistency_probe(spec, cpu, max_samples=4)
    with probe.policy.bound(service.state(0)) as model:
        probe_bound = owned(model)
    engine = LLMWorkload().eval_engine(spec, cpu, models)
    engine.update_weights(service.state(0), 0)
    eval_bound = owned(engine.engine.model)
    ids = [models.tokenizer.encode_prompt("abc")]
    from runtime.rollout.sampling import SamplingParams

    engine.generate(ids, SamplingParams(max_new_tokens=2, temperature=0.0, stop_ids=(models.tokenizer.eos_id,)))
    fused = sum(
        t.numel() * t.element_size()
        for layer in getattr(engine.engine.runner, "layers", [])
        for t in (layer.qkv_w, layer.gate_up_w)
    )
    return {
        "params": sum(p.numel() for p in models.policy.parameters()),
        "probe_before": before,
        "probe_after": probe_bound,
        "evaluator_before": before,
        "evaluator_after": eval_bound,
        "evaluator_runner_fused_copies": fused,  # the built-in engine's own q/k/v and gate/up concatenations
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 7B rows only")
    args = parser.parse_args()
    rows = table(["7B"] if args.quick else list(QWEN25))
    measured = probe_and_evaluator_bytes()
    print(
        f"\nasync trainer process, small-qwen2 ({measured['params']:,} parameters, float32): probe "
        f"{measured['probe_before']:,} -> {measured['probe_after']:,} bytes, evaluator "
        f"{measured['evaluator_before']:,} -> {measured['evaluator_after']:,} bytes of parameters of its own; "
        f"the built-in engine's fused copies {measured['evaluator_runner_fused_copies']:,} bytes (unchanged)"
    )
    print(json.dumps({"rows": rows, "probe_evaluator_bytes": measured}))


if __name__ == "__main__":
    main()
