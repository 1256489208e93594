"""Device kinds, backends, visibility variables, seeding — and clear errors for what is not there."""

from __future__ import annotations

import importlib.util
import random
import sys

import pytest
import torch

from runtime.devices import (
    DeviceError,
    device_count,
    dist_backend,
    manual_seed_all,
    probe_inventory,
    resolve_device,
    set_threads,
    visibility_env,
)


def test_cpu_resolves():
    assert resolve_device("cpu") == torch.device("cpu")
    assert device_count("cpu") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_missing_cuda_is_a_device_error():
    with pytest.raises(DeviceError, match="device `cuda` requested"):
        resolve_device("cuda")
    assert device_count("cuda") == 0


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed")
def test_missing_torch_npu_is_a_device_error_naming_the_package():
    with pytest.raises(DeviceError, match="torch_npu"):
        resolve_device("npu")
    assert "torch_npu" not in sys.modules


def test_cpu_never_imports_torch_npu():
    resolve_device("cpu")
    dist_backend("npu")
    visibility_env("npu", [0, 1])
    assert "torch_npu" not in sys.modules


def test_unknown_kind_and_bad_index():
    with pytest.raises(DeviceError, match="unknown device kind 'tpu'"):
        resolve_device("tpu")
    with pytest.raises(DeviceError, match="index must be >= 0"):
        resolve_device("cpu", -1)
    with pytest.raises(DeviceError, match="unknown device kind"):
        dist_backend("xpu")


def test_backends():
    assert [dist_backend(k) for k in ("cpu", "cuda", "npu")] == ["gloo", "nccl", "hccl"]


def test_visibility_env():
    assert visibility_env("cpu", [0]) == {}
    assert visibility_env("cuda", [2, 3]) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert visibility_env("npu", [0, 1, 7]) == {"ASCEND_RT_VISIBLE_DEVICES": "0,1,7"}
    assert visibility_env("npu", []) == {"ASCEND_RT_VISIBLE_DEVICES": ""}
    with pytest.raises(DeviceError, match=">= 0"):
        visibility_env("cuda", [-1])


def test_set_threads():
    before = torch.get_num_threads()
    try:
        set_threads(None)
        assert torch.get_num_threads() == before
        set_threads(1)
        assert torch.get_num_threads() == 1
        with pytest.raises(DeviceError):
            set_threads(0)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_manual_seed_all_repeats_every_generator():
    import numpy as np

    def draw():
        return random.random(), float(np.random.rand()), torch.rand(3).tolist()

    manual_seed_all(123)
    a = draw()
    manual_seed_all(123)
    assert draw() == a
    manual_seed_all(124)
    assert draw() != a


def test_probe_inventory_cpu_and_absent_tools():
    assert probe_inventory("cpu")[0].startswith("cpu: ")
    if importlib.util.find_spec("torch_npu") is None:
        assert isinstance(probe_inventory("npu"), list)


def test_each_process_kind_has_its_own_device_index():
    from runtime.placement import eval_device_index, rollout_device_index
    from runtime.spec import load_spec

    accel = {"device": "cuda", "trainer_devices": 2, "rollout_devices": 3}
    spec = load_spec({"pipeline": {"mode": "async"}, "resources": {**accel, "eval_devices": 1}})
    # trainer ranks 0-1, rollout instances on 2-4 (round robin), the evaluator on 5
    assert [rollout_device_index(spec, rank) for rank in range(4)] == [2, 3, 4, 2]
    assert eval_device_index(spec) == 5
    assert eval_device_index(load_spec({"pipeline": {"mode": "async"}, "resources": accel})) is None  # shares
    assert eval_device_index(load_spec({})) is None  # CPU, no evaluator devices: the trainer's


def test_with_trainer_ranks_on_other_hosts_this_hosts_devices_follow_its_own_ranks(monkeypatch):
    from runtime.placement import eval_device_index, rollout_device_index
    from runtime.spec import load_spec

    spec = load_spec(
        {
            "pipeline": {"mode": "async"},
            "resources": {"device": "cuda", "trainer_devices": 4, "rollout_devices": 2, "eval_devices": 1},
        }
    )
    for key, value in {"TANDEM_LOCAL_RANKS": "0-1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    # ranks 0-1 here (devices 0-1), ranks 2-3 on another host: rollout devices 2-3, the evaluator 4
    assert [rollout_device_index(spec, rank) for rank in range(3)] == [2, 3, 2]
    assert eval_device_index(spec) == 4
