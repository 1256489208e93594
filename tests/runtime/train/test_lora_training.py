"""Training with ``model.lora``: only the adapters train, take optimizer state, sync and go into checkpoints;
the KL reference is the base model (the adapters off, no copy); a sync run resumes bit-identically, with
ddp and fsdp too; an async run's engines generate with the adapters they are sent; the export's adapter
directory starts a fork's adapters where its parent's stopped."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from runtime.checkpoint import HF_DIR, load_checkpoint
from runtime.contract import ADAPTER_DIR
from runtime.metrics import read_jsonl
from runtime.models import build_policy
from runtime.models.lora import adapter_state, is_adapter_key
from runtime.pipeline import run
from runtime.pipeline.driver import CHECKPOINT_DIR
from runtime.spec import RunSpec
from runtime.train.trainer import Trainer, TrainerError
from tests.runtime.helpers import derived, tiny_spec
from tests.runtime.train.test_trainer import _samples

LORA = derived(
    model={"builtin": "tiny-qwen2", "lora": {"r": 4, "alpha": 8.0}},
    algorithm={"name": "grpo", "group_size": 4, "entropy_coef": 0.01, "kl_coef": 0.05},
    trainer={"lr": 1e-2},
    checkpoint={"interval": 1, "keep_last": 5},
)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _trainer_state(result_or_dir):
    path = result_or_dir["checkpoint"] if isinstance(result_or_dir, dict) else result_or_dir
    return load_checkpoint(path, keys=["trainer"])["trainer"]


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_only_the_adapters_train_sync_and_take_optimizer_state():
    spec = RunSpec.model_validate({**LORA, "seed": 3})
    policy, tok = build_policy(spec.model, "cpu", seed=3)
    trainer = Trainer(spec, policy, tok, "cpu")
    frozen = {k: v.clone() for k, v in policy.state_dict().items() if not is_adapter_key(k)}
    before = {k: v.clone() for k, v in adapter_state(policy.state_dict()).items()}
    trainer.train_step(_samples(), step=0)
    after = adapter_state(policy.state_dict())
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the adapters moved ...
    assert all(torch.equal(frozen[k], policy.state_dict()[k]) for k in frozen)  # ... and nothing else
    published = trainer.publish_state()
    assert published.keys() == after.keys()
    adapters = {id(p) for n, p in policy.named_parameters() if is_adapter_key(n)}
    assert {id(p) for p in trainer.optimizer.state} == adapters
    assert trainer.state_dict()["policy"].keys() == after.keys()


def test_the_reference_is_the_base_model_with_no_second_copy():
    spec = RunSpec.model_validate({**LORA, "seed": 3})
    policy, tok = build_policy(spec.model, "cpu", seed=3)
    base, _ = build_policy(RunSpec.model_validate({"model": {"builtin": "tiny-qwen2"}}).model, "cpu", seed=3)
    trainer = Trainer(spec, policy, tok, "cpu")
    samples = _samples()
    trainer.train_step(samples, step=0)  # the adapters now differ from zero: the policy is not the base
    ref = trainer._score_pass(samples)["ref"]
    copy_trainer = Trainer(
        RunSpec.model_validate({**derived(algorithm=LORA["algorithm"]), "seed": 3}), base, tok, "cpu"
    )
    want = copy_trainer._score_pass(samples, proximal=True)["proximal"]  # the base model's own log-probs
    for got, expected in zip(ref, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    proximal = trainer._score_pass(samples, proximal=True, ref=False)["proximal"]
    assert max((p - r).abs().max().item() for p, r in zip(proximal, ref, strict=True)) > 1e-4


def test_a_checkpoint_of_another_lora_shape_is_refused_by_name():
    spec = RunSpec.model_validate({**LORA, "seed": 3})
    policy, tok = build_policy(spec.model, "cpu", seed=3)
    state = Trainer(spec, policy, tok, "cpu").state_dict()
    other = RunSpec.model_validate({**derived(**{**LORA, "model": {"lora": {"r": 4, "target_modules": ["q_proj"]}}})})
    policy2, _ = build_policy(other.model, "cpu", seed=3)
    with pytest.raises(TrainerError, match="model.lora"):
        Trainer(other, policy2, tok, "cpu").load_state_dict(state)


def test_a_plugin_algorithm_that_needs_full_weights_is_refused_with_lora():
    from runtime.train.algos import get_algorithm, register_algorithm
    from runtime.train.algos.interface import Algorithm

    grpo = get_algorithm("grpo")
    register_algorithm(
        "full-weights", lambda: Algorithm("full-weights", grpo.loss_fn, grpo.update_fn, needs_full_weights=True)
    )
    spec = RunSpec.model_validate({**derived(**{**LORA, "algorithm": {"name": "full-weights", "group_size": 4}})})
    policy, tok = build_policy(spec.model, "cpu", seed=3)
    with pytest.raises(TrainerError, match="model.lora: algorithm full-weights needs full weights"):
        Trainer(spec, policy, tok, "cpu")


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_sync_lora_run_resumed_from_its_checkpoint_is_bit_identical(tmp_path, algo):
    over = {"pipeline__mode": "sync", "algorithm__name": algo}
    whole = run(tiny_spec(tmp_path, "whole", LORA, pipeline__steps=3, **over))
    first = run(tiny_spec(tmp_path, "split", LORA, pipeline__steps=1, **over))
    second = run(tiny_spec(tmp_path, "split", LORA, pipeline__steps=3, **over), resume=tmp_path / "split")
    assert first["trace"]["consumed"] + second["trace"]["consumed"] == whole["trace"]["consumed"]
    a, b = _trainer_state(whole), _trainer_state(second)
    assert a["policy"] and all(is_adapter_key(k) for k in a["policy"])  # the checkpoint holds the adapters
    assert _equal(a["policy"], b["policy"])
    assert all(
        torch.equal(a["optimizer"]["state"][k]["exp_avg"], b["optimizer"]["state"][k]["exp_avg"])
        for k in a["optimizer"]["state"]
    )
    assert len(a["optimizer"]["state"]) == len(a["policy"])  # optimizer state for the adapters only
    steps_whole, _ = read_jsonl(tmp_path / "whole" / "metrics.jsonl")
    steps_split, _ = read_jsonl(tmp_path / "split" / "metrics.jsonl")
    for key in ("loss/policy", "grad_norm", "kl_ref"):
        assert [s.get(key) for s in steps_whole] == [s.get(key) for s in steps_split], key
    assert steps_whole[-1]["kl_ref"] > 0  # the reference (the base) and the adapted policy came apart
    # the export: the merged model under the base's names, and the adapter directory beside it
    export = tmp_path / "whole" / CHECKPOINT_DIR / "step-00000003" / HF_DIR
    merged = load_file(export / "model.safetensors")
    assert not any("lora" in k or "base_layer" in k for k in merged)
    assert (export / ADAPTER_DIR / "adapter_model.safetensors").is_file()


def test_colocated_generates_on_the_trainers_module_as_sync_on_its_own_copy(tmp_path):
    """The colocated engine reads the trainer's LoRA module, the sync one a copy sent the adapters: the same
    merged weights, so the same samples and the same trained adapters."""
    sync = run(tiny_spec(tmp_path, "s", LORA, pipeline__mode="sync", pipeline__steps=2))
    colo = run(tiny_spec(tmp_path, "c", LORA, pipeline__mode="colocated", pipeline__steps=2))
    assert _equal(_trainer_state(sync)["policy"], _trainer_state(colo)["policy"])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_two_rank_lora_run_resumes_bit_identically(tmp_path, strategy):
    spec = derived(
        **{
            **LORA,
            "seed": 7,
            "pipeline": {"steps": 3, "mode": "sync"},
            "trainer": {"lr": 1e-2, "collective_timeout_s": 60, "strategy": strategy},
            "resources": {"threads_per_process": 1, "trainer_devices": 2},
        }
    )
    whole = run(tiny_spec(tmp_path, "whole", spec))
    final = tmp_path / "whole" / CHECKPOINT_DIR / "step-00000003" / HF_DIR
    adapters_whole = load_file(final / ADAPTER_DIR / "adapter_model.safetensors")
    merged_whole = load_file(final / "model.safetensors")
    resumed = run(tiny_spec(tmp_path, "whole", spec), resume=tmp_path / "whole" / CHECKPOINT_DIR / "step-00000001")
    assert whole["outcome"] == resumed["outcome"] == "completed"
    assert resumed["trace"]["consumed"] == whole["trace"]["consumed"][1:]
    assert _equal(adapters_whole, load_file(final / ADAPTER_DIR / "adapter_model.safetensors"))
    assert _equal(merged_whole, load_file(final / "model.safetensors"))
    base, _ = build_policy(RunSpec.model_validate({"model": {"builtin": "tiny-qwen2"}}).model, "cpu", seed=7)
    assert any(not torch.equal(base.state_dict()[k], v) for k, v in merged_whole.items() if k in base.state_dict())


@pytest.mark.slow
def test_an_async_lora_run_generates_with_the_adapters_it_sends_and_a_fork_starts_from_them(tmp_path):
    spec = derived(
        **{
            **LORA,
            "pipeline": {"steps": 4, "mode": "async", "max_policy_lag": 1},
            "resources": {"threads_per_process": 1, "rollout_workers": 2},
        }
    )
    parent = run(tiny_spec(tmp_path, "parent", spec))
    steps, _ = read_jsonl(tmp_path / "parent" / "metrics.jsonl")
    trained = [s for s in steps if "consistency/logprob_diff_max" in s]
    assert trained and all(s["consistency/logprob_diff_max"] < 1e-4 for s in trained)
    adapter = tmp_path / "parent" / CHECKPOINT_DIR / "step-00000004" / HF_DIR / ADAPTER_DIR
    fork_spec = tiny_spec(
        tmp_path,
        "fork",
        {**spec, "model": {**spec["model"], "lora": {**spec["model"]["lora"], "init_path": str(adapter)}}},
    )
    policy, _ = build_policy(fork_spec.model, "cpu", seed=fork_spec.seed)
    parent_adapters = _trainer_state(parent)["policy"]
    assert _equal(adapter_state(policy.state_dict()), parent_adapters)
