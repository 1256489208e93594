"""Published hardware figures as named presets, and costs derived from them for a model size.

The figures below are peak numbers from vendors' datasheets; every figure that is not from one is
marked ASSUMPTION with where it comes from. Peak figures are not achieved: :func:`costs_for` applies
efficiency factors (model FLOPs utilisation, memory and link efficiency), each an assumption a
calibration should replace with measured values.

Derivations (per device, P parameters):

* training: ``train_flops_per_param * P`` FLOPs per token, 6 for forward and backward (Kaplan et
  al., "Scaling laws for neural language models", 2020, section 2.1), plus 2 per extra forward the
  algorithm runs (reference model, old log-probs), at ``mfu`` of the bf16 peak;
* decode: each engine step reads the weights once (``bytes_per_param * P`` bytes) whatever its batch
  — memory-bound (Pope et al., "Efficiently scaling transformer inference", MLSys 2023, section 2)
  — and each sequence adds ``2 P`` FLOPs and reads its KV cache (``kv_bytes_per_token`` per context
  token);
* prefill: ``2 P`` FLOPs per prompt token at ``mfu`` (attention's quadratic term left out);
* optimizer (Adam, mixed precision): ``optimizer_bytes_per_param`` of state (fp32 master weights and
  two moments: 12 bytes, Rajbhandari et al., ZeRO, SC 2020, section 3.1) moved over the host link
  to offload or reload; one update reads and writes about 32 bytes per parameter, memory-bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from capacity.checks import Problems
from capacity.costs import Costs, Link

GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class Accelerator:
    """One accelerator model in its usual server: peak figures per device."""

    name: str
    bf16_flops: float
    """Dense bf16 peak, FLOP/s."""
    memory_bytes: float
    memory_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    intra_node_bandwidth: float
    """Per device, one direction, to the other devices of its node (HCCS, NVLink), bytes/s."""
    inter_node_bandwidth: float
    """Per device, one direction, to other nodes (its RoCE / InfiniBand port), bytes/s."""
    host_bandwidth: float
    """Per device, one direction, to host memory (PCIe), bytes/s."""
    intra_node_latency_s: float
    inter_node_latency_s: float
    devices_per_node: int
    source: str


H100_SXM = Accelerator(
    name="NVIDIA H100 SXM5 80GB (HGX/DGX H100)",
    bf16_flops=989 * TFLOPS,  # datasheet: 1,979 TFLOPS bf16 "with sparsity"; dense is half
    memory_bytes=80 * GB,
    memory_bandwidth=3.35e12,
    intra_node_bandwidth=450 * GB,  # NVLink 4: 900 GB/s per GPU, both directions together
    inter_node_bandwidth=50 * GB,  # one ConnectX-7 400 Gb/s port per GPU (DGX H100 datasheet)
    host_bandwidth=64 * GB,  # PCIe Gen5 x16: 128 GB/s both directions together
    intra_node_latency_s=3e-6,  # ASSUMPTION: order of NVLink collective step latency, not a datasheet figure
    inter_node_latency_s=1e-5,  # ASSUMPTION: order of an InfiniBand collective step, not a datasheet figure
    devices_per_node=8,
    source="NVIDIA H100 Tensor Core GPU datasheet (SXM5: bf16, HBM3 80 GB, 3.35 TB/s, NVLink 900 GB/s, "
    "PCIe Gen5 128 GB/s); NVIDIA DGX H100 datasheet (8 GPUs, 8x ConnectX-7 400 Gb/s for compute)",
)

H200_SXM = Accelerator(
    name="NVIDIA H200 SXM 141GB (HGX/DGX H200)",
    bf16_flops=989 * TFLOPS,  # datasheet: 1,979 TFLOPS bf16 "with sparsity"; dense is half
    memory_bytes=141 * GB,
    memory_bandwidth=4.8e12,
    intra_node_bandwidth=450 * GB,  # NVLink 4: 900 GB/s per GPU, both directions together
    inter_node_bandwidth=50 * GB,  # one ConnectX-7 400 Gb/s port per GPU (DGX H200 datasheet)
    host_bandwidth=64 * GB,  # PCIe Gen5 x16: 128 GB/s both directions together
    intra_node_latency_s=3e-6,  # ASSUMPTION, as H100_SXM
    inter_node_latency_s=1e-5,  # ASSUMPTION, as H100_SXM
    devices_per_node=8,
    source="NVIDIA H200 Tensor Core GPU datasheet (SXM: bf16, HBM3e 141 GB, 4.8 TB/s, NVLink 900 GB/s, "
    "PCIe Gen5 128 GB/s); NVIDIA DGX H200 datasheet (8 GPUs, 8x ConnectX-7 400 Gb/s for compute)",
)

ASCEND_910B = Accelerator(
    name="Huawei Ascend 910B-class (Atlas 800T A2)",
    # ASSUMPTION: Huawei publishes no per-chip datasheet figure for the 910B variants; 313 TFLOPS fp16/bf16
    # is the figure widely reported for the 910B3 (reports for the variants range about 280-400).
    bf16_flops=313 * TFLOPS,
    memory_bytes=64 * GB,  # ASSUMPTION: 64 GB HBM2e, as widely reported for the 910B
    memory_bandwidth=1.6e12,  # ASSUMPTION: widely reported figure, no vendor datasheet
    # ASSUMPTION: HCCS full mesh of 7 links x 56 GB/s per chip as reported for the Atlas 800T A2 (392 GB/s
    # both directions together): 196 GB/s one way
    intra_node_bandwidth=196 * GB,
    inter_node_bandwidth=25 * GB,  # one 200GE RoCE port per NPU (Atlas 800T A2: 8x 200GE)
    host_bandwidth=32 * GB,  # ASSUMPTION: PCIe Gen4 x16-class host link, one direction
    intra_node_latency_s=5e-6,  # ASSUMPTION: not published
    inter_node_latency_s=2e-5,  # ASSUMPTION: RoCE collective step, not published
    devices_per_node=8,
    source="Huawei Atlas 800T A2 training server datasheet (8x Ascend 910B NPUs, 8x 200GE RoCE ports); "
    "per-chip compute, memory and HCCS figures are ASSUMPTIONS from public reports, marked above",
)

PRESETS = {"h100-sxm": H100_SXM, "h200-sxm": H200_SXM, "ascend-910b": ASCEND_910B}

# A supernode: one scale-up domain of hundreds of devices, its "node" the whole supernode. Figures are from
# Zuo et al., "Serving Large Language Models on Huawei CloudMatrix384", arXiv:2506.12708 (2025), section 3
# (CloudMatrix384: 48 servers x 8 Ascend 910C = 384 NPUs on one Unified Bus (UB) plane; Huawei sells the
# same class as the Atlas 900 A3 SuperPoD). One device is one 910C package (two dies).
ASCEND_910C_SUPERNODE = Accelerator(
    name="Huawei Ascend 910C in a CloudMatrix384 supernode (Atlas 900 A3 SuperPoD class)",
    bf16_flops=752 * TFLOPS,  # Zuo et al. 2025: about 752 TFLOPS dense BF16/FP16 per package (2 dies)
    memory_bytes=128 * GB,  # Zuo et al. 2025: 128 GB on-package HBM (64 GB per die)
    memory_bandwidth=3.2e12,  # Zuo et al. 2025: 3.2 TB/s per package
    intra_node_bandwidth=392 * GB,  # Zuo et al. 2025: UB plane, 392 GB/s one way per 910C, non-blocking
    inter_node_bandwidth=50 * GB,  # Zuo et al. 2025: RDMA plane (RoCE), 400 Gb/s one way per NPU
    host_bandwidth=64 * GB,  # ASSUMPTION: the NPU-CPU link is not given per NPU; PCIe Gen5 x16 order
    intra_node_latency_s=2e-6,  # ASSUMPTION: a UB collective step; the paper gives only a sub-microsecond hop
    inter_node_latency_s=2e-5,  # ASSUMPTION: a RoCE collective step, as ASCEND_910B
    devices_per_node=384,  # the supernode is one UB domain: its 48 servers do not split its bandwidth
    source="Zuo et al., 'Serving Large Language Models on Huawei CloudMatrix384', arXiv:2506.12708, 2025, "
    "section 3 (910C: 752 TFLOPS BF16, 128 GB HBM, 3.2 TB/s; UB 392 GB/s per NPU across 384 NPUs; RDMA "
    "400 Gb/s per NPU); latencies and the host link are ASSUMPTIONS, marked above",
)

SUPERNODES = {"ascend-910c-supernode": ASCEND_910C_SUPERNODE}
"""Supernode presets, apart from :data:`PRESETS` (whose nodes are 8-device servers)."""


@dataclass(frozen=True)
class ModelShape:
    """What the costs need of a model: its parameters and its KV cache per context token."""

    name: str
    params: float
    kv_bytes_per_token: float
    """2 (K and V) x layers x KV heads x head dim x bytes per value."""


# Qwen2.5 config.json (Hugging Face model cards): 7B has 28 layers, 4 KV heads of dim 128, 7.61 B
# parameters; 32B has 64 layers, 8 KV heads of dim 128, 32.5 B parameters. KV in bf16 (2 bytes).
QWEN25_7B = ModelShape("Qwen2.5-7B", 7.61e9, 2 * 28 * 4 * 128 * 2)
QWEN25_32B = ModelShape("Qwen2.5-32B", 32.5e9, 2 * 64 * 8 * 128 * 2)


def costs_for(
    hw: Accelerator,
    model: ModelShape,
    *,
    context_tokens: float,
    mfu: float = 0.4,
    memory_efficiency: float = 0.7,
    link_efficiency: float = 0.8,
    train_flops_per_param: float = 8.0,
    bytes_per_param: float = 2.0,
    gradient_bytes_per_param: float = 2.0,
    optimizer_bytes_per_param: float = 12.0,
    colocated_switch_s: float = 0.0,
) -> Costs:
    """Costs of ``model`` on one ``hw`` device, sequences averaging ``context_tokens`` of context.

    Defaults, all ASSUMPTIONS to replace by measurement: 40% MFU (the range large dense training
    reports, e.g. Chowdhery et al., PaLM, 2022, table 3: 46%); 70% of peak memory bandwidth; 80% of
    peak link bandwidth; 8 FLOPs per parameter and trained token (forward, backward and one reference
    forward); bf16 weights and gradients; a colocated switch of 0 s (it depends on the engine: set it
    from a measurement).
    """
    p = Problems()
    for name, value in (("mfu", mfu), ("memory_efficiency", memory_efficiency), ("link_efficiency", link_efficiency)):
        p.number(name, value, low=0, high=1, low_open=True)
    p.number("context_tokens", context_tokens, low=0, high=1 << 22)
    p.number("train_flops_per_param", train_flops_per_param, low=2, high=100)
    p.raise_if_any()
    P = model.params
    flops = hw.bf16_flops * mfu
    memory = hw.memory_bandwidth * memory_efficiency
    weight_bytes = P * bytes_per_param
    host = hw.host_bandwidth * link_efficiency
    return Costs(
        decode_step_s=weight_bytes / memory,
        decode_s_per_token=2 * P / flops + model.kv_bytes_per_token * context_tokens / memory,
        prefill_s_per_token=2 * P / flops,
        train_s_per_token=train_flops_per_param * P / flops,
        optimizer_step_s=32 * P / memory,
        weight_bytes=weight_bytes,
        gradient_bytes=P * gradient_bytes_per_param,
        local=Link(memory / 2),  # a copy reads and writes device memory
        intra_node=Link(hw.intra_node_bandwidth * link_efficiency, hw.intra_node_latency_s),
        inter_node=Link(hw.inter_node_bandwidth * link_efficiency, hw.inter_node_latency_s),
        optimizer_offload_s=P * optimizer_bytes_per_param / host,
        optimizer_reload_s=P * optimizer_bytes_per_param / host,
        colocated_switch_s=colocated_switch_s,
    )


def kv_cache_tokens(
    hw: Accelerator, model: ModelShape, *, usable_fraction: float = 0.9, bytes_per_param: float = 2.0
) -> int:
    """Context tokens one inference engine's KV cache holds on ``hw``: the usable device memory less
    the weights, divided by the KV bytes of one token (vLLM's ``gpu_memory_utilization`` is the same
    fraction; its default is 0.9). Activations and the engine's workspace are left out (ASSUMPTION:
    they fit in the 10% left)."""
    p = Problems()
    p.number("usable_fraction", usable_fraction, low=0, high=1, low_open=True)
    p.raise_if_any()
    free = hw.memory_bytes * usable_fraction - model.params * bytes_per_param
    if free <= 0:
        p.add("model", f"{model.name}'s weights do not fit in {hw.name}'s usable memory")
        p.raise_if_any()
    return int(free // model.kv_bytes_per_token)
