"""Checkpoints: atomic saves, verification, retention, RNG and sample packing."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime.checkpoint import (
    CheckpointError,
    CheckpointManager,
    capture_rng,
    check_weights_only_safe,
    checkpoint_info,
    load_checkpoint,
    pack_prompts,
    pack_samples,
    restore_rng,
    step_dir_name,
    unpack_prompts,
    unpack_samples,
    verify_checkpoint,
)
from runtime.samples import Prompt, Sample

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]


def trainer_state(seed: int = 0) -> dict:
    """A real optimizer + scheduler state after one update, like Trainer.state_dict() holds."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    return {"policy": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}


def samples() -> list[Sample]:
    return [
        Sample(1, 10, 0, [5, 6, 7], [8, 9], [-0.1234567890123, -2.5], [3, 4], "stop", 1.0, True, {"len": 2}),
        Sample(2, 10, 0, [5, 6, 7], [], [], [], "length", -0.5, False),
        Sample(3, 11, 1, [1], [2, 3, 4], [-1e-12, -0.3, -7.25], [4, 4, 4], "stop", 0.1 + 0.2, False, {"a": [1, 2]}),
    ]


def full_state() -> dict:
    return {
        "trainer": trainer_state(),
        "rng": {"trainer0": capture_rng()},
        "queue": pack_samples(samples()),
        "in_flight": pack_prompts([Prompt(12, "abc", "cba", 3)]),
        "cursor": {"epoch": 1, "position": 37, "order_seed": 5},
        "progress": {"step": 4, "weights_version": 4, "metrics_cursor": 1234},
    }


def write_policy(files: dict[str, bytes]):
    def export(d: Path) -> None:
        for name, data in files.items():
            (d / name).write_bytes(data)

    return export


def entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def assert_equal_nested(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), where
        for k in a:
            assert_equal_nested(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal_nested(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


# ---------------------------------------------------------------- save / load


def test_save_then_load_returns_the_same_state(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    state = full_state()
    path = mgr.save(42, state, hf_export=write_policy({"config.json": b"{}"}), metrics={"eval/accuracy": 0.5})

    assert path == tmp_path / "step-00000042"
    assert entries(path) == ["manifest.json", "policy", "state"]
    assert entries(path / "state") == ["cursor.pt", "in_flight.pt", "progress.pt", "queue.pt", "rng.pt", "trainer.pt"]
    loaded = load_checkpoint(path)
    assert_equal_nested(state, loaded)
    info = checkpoint_info(path)
    assert (info.step, info.metrics, info.hf_dir) == (42, {"eval/accuracy": 0.5}, path / "policy")


def test_state_files_load_with_weights_only(tmp_path):
    path = CheckpointManager(tmp_path).save(1, full_state())
    for f in sorted((path / "state").iterdir()):
        torch.load(f, weights_only=True)  # raises if anything needs unpickling of arbitrary classes


def test_load_subset_of_keys_and_unknown_key(tmp_path):
    path = CheckpointManager(tmp_path).save(1, {"a": torch.ones(2), "b": [1, 2]})
    assert list(load_checkpoint(path, keys=["b"])) == ["b"]
    with pytest.raises(CheckpointError, match=r"no state key\(s\) \['c'\]"):
        load_checkpoint(path, keys=["c"])


def test_manifest_lists_every_file_with_sha256(tmp_path):
    path = CheckpointManager(tmp_path).save(
        7, {"x": torch.arange(3)}, hf_export=write_policy({"model.safetensors": b"abc"}), metrics={"reward/mean": 1}
    )
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 7
    assert manifest["state_keys"] == ["x"]
    assert manifest["hf_dir"] == "policy"
    assert sorted(manifest["files"]) == ["policy/model.safetensors", "state/x.pt"]
    assert manifest["files"]["policy/model.safetensors"] == {
        "bytes": 3,
        "sha256": "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
    }
    assert manifest["metrics"] == {"reward/mean": 1.0}


def test_hf_export_is_loadable_by_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    path = CheckpointManager(tmp_path).save(3, {}, hf_export=model.save_pretrained)

    verify_checkpoint(path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(path / "policy", local_files_only=True)
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_saving_the_same_step_again_replaces_it(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(5, {"v": 1})
    mgr.save(5, {"v": 2})
    assert entries(tmp_path) == ["step-00000005"]
    assert load_checkpoint(tmp_path / "step-00000005") == {"v": 2}


def test_unsafe_state_is_refused_before_anything_is_written(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=r"state\['queue'\]\[1\]: a Sample .* pack_samples"):
        mgr.save(1, {"queue": [1, samples()[0]]})
    with pytest.raises(CheckpointError, match=r"state\['rng'\]\['np'\]: a ndarray .* torch.from_numpy"):
        mgr.save(1, {"rng": {"np": np.zeros(3)}})
    with pytest.raises(CheckpointError, match="state key 'a/b' is not usable as a file name"):
        mgr.save(1, {"a/b": 1})
    assert not (tmp_path / "ckpt").exists()


def test_check_weights_only_safe_accepts_plain_containers():
    check_weights_only_safe({"a": (1, 2.0, "s", None, True), "b": [torch.zeros(1)], 3: torch.Size([2])})


# ---------------------------------------------------------------- crashes and corruption


def test_crash_inside_hf_export_leaves_previous_checkpoint_latest(tmp_path):
    mgr = CheckpointManager(tmp_path)
    first = mgr.save(1, {"v": 1})

    def broken_export(d: Path) -> None:
        (d / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        mgr.save(2, {"v": 2}, hf_export=broken_export)
    assert entries(tmp_path) == ["step-00000001"]
    assert mgr.latest() == first
    assert [i.step for i in mgr.list()] == [1]


def test_killed_process_mid_save_leaves_nothing_complete_looking(tmp_path):
    # A real crash: the process dies inside hf_export, so no cleanup code runs.
    CheckpointManager(tmp_path).save(1, {"v": 1})
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        from runtime.checkpoint import CheckpointManager
        def die(d):
            (d / "model.safetensors").write_bytes(b"partial")
            os._exit(9)
        CheckpointManager({str(tmp_path)!r}).save(2, {{"v": 2}}, hf_export=die)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    leftovers = [n for n in entries(tmp_path) if n.startswith(".tmp-step-00000002-")]
    assert len(leftovers) == 1

    mgr = CheckpointManager(tmp_path)
    assert mgr.latest() == tmp_path / "step-00000001"
    mgr.save(3, {"v": 3})  # the next save clears the crashed one's temp dir
    assert entries(tmp_path) == ["step-00000001", "step-00000003"]


def test_step_dir_without_manifest_is_ignored_and_refused(tmp_path):
    mgr = CheckpointManager(tmp_path)
    good = mgr.save(1, {"v": 1})
    partial = tmp_path / "step-00000002"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "v.pt").write_bytes(b"x")
    (tmp_path / "step-3").mkdir()  # not our naming scheme

    assert mgr.latest() == good
    with pytest.raises(CheckpointError, match=r"step-00000002/manifest.json: missing .* partial"):
        load_checkpoint(partial)


def test_flipped_byte_is_a_checksum_error_naming_the_file(tmp_path):
    path = CheckpointManager(tmp_path).save(1, full_state())
    target = path / "state" / "trainer.pt"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"state/trainer.pt: checksum mismatch"):
        load_checkpoint(path)


def test_truncated_file_is_reported_with_sizes(tmp_path):
    path = CheckpointManager(tmp_path).save(1, {"w": torch.zeros(100)}, hf_export=write_policy({"a.bin": b"12345"}))
    target = path / "policy" / "a.bin"
    target.write_bytes(b"12")
    with pytest.raises(CheckpointError, match=r"policy/a.bin: truncated, 2 bytes where the manifest says 5"):
        verify_checkpoint(path)


def test_missing_file_and_bad_manifest(tmp_path):
    path = CheckpointManager(tmp_path).save(1, {"w": 1, "z": 2})
    (path / "state" / "z.pt").unlink()
    with pytest.raises(CheckpointError, match=r"state/z.pt: missing \(listed in the manifest\)"):
        load_checkpoint(path)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"manifest.json: unreadable manifest"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        load_checkpoint(tmp_path / "step-00000099")


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_pickled_object_is_never_executed_on_load(tmp_path):
    # A state file replaced (with a consistent manifest) by one that needs arbitrary unpickling.
    path = CheckpointManager(tmp_path).save(1, {"w": 1})
    target = path / "state" / "w.pt"
    torch.save({"x": Evil()}, target)
    manifest = json.loads((path / "manifest.json").read_text())
    import hashlib

    manifest["files"]["state/w.pt"] = {
        "bytes": target.stat().st_size,
        "sha256": hashlib.sha256(target.read_bytes()).hexdigest(),
    }
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"state/w.pt: cannot be loaded safely"):
        load_checkpoint(path)


# ---------------------------------------------------------------- retention


def test_keep_last(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in range(1, 6):
        mgr.save(step, {"s": step})
    assert entries(tmp_path) == ["step-00000004", "step-00000005"]
    assert mgr.latest() == tmp_path / "step-00000005"


def test_keep_best_pins_an_old_checkpoint_and_ties_go_to_newest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2, keep_best_metric="eval/accuracy", keep_best_mode="max")
    scores = {1: 0.2, 2: 0.9, 3: 0.4, 4: 0.9, 5: 0.1, 6: 0.3, 7: 0.5}
    for step, acc in scores.items():
        mgr.save(step, {"s": step}, metrics={"eval/accuracy": acc})
        if step == 3:
            # best so far is step 2 (0.9), older than the last two
            assert entries(tmp_path) == ["step-00000002", "step-00000003"]
    # steps 2 and 4 tie at 0.9: the newer (4) is the best and survives; 2 is gone
    assert entries(tmp_path) == ["step-00000004", "step-00000006", "step-00000007"]
    assert mgr.best().step == 4


def test_keep_best_min_mode_and_checkpoints_without_the_metric(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=1, keep_best_metric="loss/policy", keep_best_mode="min")
    mgr.save(1, {}, metrics={"loss/policy": 0.5})
    mgr.save(2, {}, metrics={"loss/policy": 0.1})
    mgr.save(3, {}, metrics={"reward/mean": 1.0})  # no loss reported: not a candidate
    mgr.save(4, {}, metrics={"loss/policy": 0.3})
    assert entries(tmp_path) == ["step-00000002", "step-00000004"]


def test_without_rotation_saves_delete_nothing_and_retention_stays_on_call(tmp_path):
    # A platform-managed run: the platform applies the same policy (runtime.contract.retained) itself.
    mgr = CheckpointManager(tmp_path, keep_last=1, keep_best_metric="loss", keep_best_mode="min", rotate=False)
    for step, loss in ((1, 0.5), (2, 0.1), (3, 0.7)):
        mgr.save(step, {"s": step}, metrics={"loss": loss})
    assert entries(tmp_path) == ["step-00000001", "step-00000002", "step-00000003"]
    assert mgr.best().step == 2
    assert mgr.apply_retention() == [tmp_path / "step-00000001"]
    assert entries(tmp_path) == ["step-00000002", "step-00000003"]


def test_bad_manager_arguments():
    with pytest.raises(CheckpointError, match="keep_last must be >= 1, got 0"):
        CheckpointManager("x", keep_last=0)
    with pytest.raises(CheckpointError, match="keep_best_mode must be 'max' or 'min', got 'best'"):
        CheckpointManager("x", keep_best_mode="best")
    with pytest.raises(CheckpointError, match="step must be >= 0, got -1"):
        step_dir_name(-1)
    assert step_dir_name(42) == "step-00000042"


# ---------------------------------------------------------------- RNG


def draws() -> tuple:
    return (
        [random.random() for _ in range(3)],
        random.gauss(0, 1),
        np.random.rand(3).tolist(),
        np.random.standard_normal(),
        torch.rand(3).tolist(),
        torch.randint(0, 1000, (4,)).tolist(),
    )


def test_rng_capture_restore_reproduces_draws():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in the python state
    np.random.standard_normal()  # and in numpy's
    state = capture_rng()
    first = draws()
    draws()  # move every generator on
    restore_rng(state)
    assert draws() == first


def test_rng_state_round_trips_through_a_checkpoint(tmp_path):
    torch.manual_seed(11)
    random.seed(12)
    np.random.seed(13)
    path = CheckpointManager(tmp_path).save(1, {"rng": capture_rng()})
    expected = draws()
    draws()
    restore_rng(load_checkpoint(path)["rng"])
    assert draws() == expected


def test_malformed_rng_state_is_a_clear_error():
    state = capture_rng()
    del state["numpy"]
    with pytest.raises(CheckpointError, match="RNG state is malformed"):
        restore_rng(state)


def test_accelerator_rng_state_without_the_accelerator():
    state = capture_rng()
    state["cuda"] = [torch.zeros(8, dtype=torch.uint8)]
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(CheckpointError, match="1 cuda device"):
        restore_rng(state)
    restore_rng(state, strict=False)  # skipped, CPU states still restored


# ---------------------------------------------------------------- packing


def test_samples_round_trip_exactly():
    original = samples()
    assert unpack_samples(pack_samples(original)) == original
    assert unpack_samples(pack_samples([])) == []


def test_packed_samples_have_no_padding():
    packed = pack_samples(samples())
    assert packed["response_ids"].tolist() == [8, 9, 2, 3, 4]
    assert packed["response_lens"].tolist() == [2, 0, 3]
    assert packed["logprobs"].dtype == torch.float64


def test_unpacking_inconsistent_lengths_fails():
    packed = pack_samples(samples())
    packed["response_lens"] = torch.tensor([2, 0, 2])
    with pytest.raises(CheckpointError, match="`response_ids` has 5 values, lengths sum to 4"):
        unpack_samples(packed)
    with pytest.raises(CheckpointError, match="not a packed sample list"):
        unpack_samples({"kind": "prompts/v1"})


def test_sample_extra_must_be_json():
    bad = Sample(9, 1, 1, [1], [2], [-0.1], [0], "stop", extra={"obj": object()})
    with pytest.raises(CheckpointError, match="sample 9: `extra` must be JSON-serialisable"):
        pack_samples([bad])


def test_prompts_round_trip():
    prompts = [Prompt(3, "reverse: abc", "cba", 3), Prompt(4, "", "", 0)]
    assert unpack_prompts(pack_prompts(prompts)) == prompts


def test_manifest_entries_are_validated(tmp_path):
    path = CheckpointManager(tmp_path).save(1, {"w": 1})
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["../outside"] = {"sha256": "0" * 64, "bytes": 0}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="file entry '../outside' points outside the checkpoint"):
        verify_checkpoint(path)
    del manifest["files"]["../outside"]
    manifest["files"]["state/w.pt"] = {"bytes": 3}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="file entry 'state/w.pt' lacks `sha256` or `bytes`"):
        verify_checkpoint(path)


def test_a_checkpoint_renamed_by_hand_is_not_listed(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"w": 1})
    mgr.save(2, {"w": 2})
    os.rename(tmp_path / "step-00000001", tmp_path / "step-00000009")
    assert [i.step for i in mgr.list()] == [2]
    assert mgr.latest() == tmp_path / "step-00000002"
