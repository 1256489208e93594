"""Checkpoints of the training strategies: with fsdp every rank's shards go into the checkpoint through
torch.distributed.checkpoint (checksummed with the rest), the HF export is still written; with ddp the
state is rank 0's. A sync run resumed from one continues bit-identically to the run that was never
interrupted, with mixed precision too (fp16's loss scale is part of the state)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from runtime.checkpoint import HF_DIR, SHARDS_DIR, load_checkpoint, read_manifest
from runtime.metrics import read_jsonl
from runtime.pipeline import run
from runtime.pipeline.driver import CHECKPOINT_DIR
from tests.runtime.helpers import derived, tiny_spec

FSDP = derived(
    seed=7,
    pipeline={"steps": 3},
    checkpoint={"interval": 1, "keep_last": 5},
    trainer={"collective_timeout_s": 60, "strategy": "fsdp"},
    resources={"threads_per_process": 1, "trainer_devices": 2},
)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "precision"), [("fsdp", "off"), ("fsdp", "bf16"), ("ddp", "bf16"), ("ddp", "fp16")]
)
def test_a_sync_run_resumed_from_its_checkpoint_is_bit_identical(tmp_path, strategy, precision):
    spec = {**FSDP, "trainer": {**FSDP["trainer"], "strategy": strategy, "mixed_precision": precision}}
    whole = run(tiny_spec(tmp_path, "whole", spec))
    ckpt = tmp_path / "whole" / CHECKPOINT_DIR / "step-00000001"
    files = read_manifest(ckpt)["files"]
    assert f"{HF_DIR}/model.safetensors" in files
    if strategy == "fsdp":  # both ranks' shards and DCP's metadata, checksummed like every other file
        assert {f"{SHARDS_DIR}/__0_0.distcp", f"{SHARDS_DIR}/__1_0.distcp", f"{SHARDS_DIR}/.metadata"} <= set(files)
    else:
        assert not any(name.startswith(f"{SHARDS_DIR}/") for name in files)
    trainer_state = load_checkpoint(ckpt, keys=["trainer"])["trainer"]
    assert ("loss_scale" in trainer_state) == (precision == "fp16")  # fp16's dynamic scale resumes too

    final = tmp_path / "whole" / CHECKPOINT_DIR / "step-00000003" / HF_DIR / "model.safetensors"
    weights_whole = load_file(final)
    steps_whole, _ = read_jsonl(tmp_path / "whole" / "metrics.jsonl")

    resumed = run(tiny_spec(tmp_path, "whole", spec), resume=ckpt)  # rewrites steps 2 and 3 in place
    assert whole["outcome"] == resumed["outcome"] == "completed" and resumed["steps"] == 3
    assert resumed["trace"]["consumed"] == whole["trace"]["consumed"][1:]
    weights_resumed = load_file(final)
    assert weights_resumed.keys() == weights_whole.keys()
    for name, value in weights_whole.items():
        assert torch.equal(weights_resumed[name], value), name
    steps_resumed, _ = read_jsonl(tmp_path / "whole" / "metrics.jsonl")
    assert len(steps_resumed) == len(steps_whole) == 3
    for key in ("loss/policy", "grad_norm", "reward/mean"):
        assert [s[key] for s in steps_resumed] == [s[key] for s in steps_whole], key
