"""Inventory parsers on sample outputs of npu-smi and nvidia-smi, and the probe on this machine.

The samples are written from the tools' documented layouts (npu-smi info's
two-row card/chip table as printed for 910A, 910B and 310P cards;
nvidia-smi --query-gpu with csv,noheader,nounits), not captured from
hardware; odd spacing, missing fields and unhealthy devices are added on
purpose.
"""

import os
import shutil
import stat

import pytest

from rlplatform.inventory import (
    NVIDIA_QUERY_FIELDS,
    DeviceInfo,
    InventoryError,
    parse_npu_smi_info,
    parse_nvidia_smi_csv,
    probe_cpu,
    probe_devices,
)

NPU_910B = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.rc3                 Version: 23.0.rc3                                             |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 93.6        37                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3161 / 65536         |
+===========================+===============+====================================================+
| 1     910B3               | Warning       | 90.1        36                0    / 0             |
| 0                         | 0000:C2:00.0  | 0           0    / 0          3162 / 65536         |
+===========================+===============+====================================================+
| 2     910B3               | OK            | 91.0        38                0    / 0             |
| 0                         | 0000:81:00.0  | 12          0    / 0          40960 / 65536        |
+===========================+===============+====================================================+
| 3     910B3               | Critical      | NA          NA                0    / 0             |
| 0                         | 0000:82:00.0  | 0           0    / 0          0    / 65536         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| 2       0                 | 171882        | python3.11               | 37700                   |
+===========================+===============+====================================================+
"""

# 310P Duo: two chips per card, with the logical Device id in the chip row; NPU ids are not contiguous.
NPU_310P_DUO = """\
+--------------------------------------------------------------------------------------------------------+
| npu-smi 23.0.0                                   Version: 23.0.0                                       |
+-------------------------------+-----------------+------------------------------------------------------+
| NPU     Name                  | Health          | Power(W)     Temp(C)           Hugepages-Usage(page) |
| Chip    Device                | Bus-Id          | AICore(%)    Memory-Usage(MB)                        |
+===============================+=================+======================================================+
| 1       310P3                 | OK              | NA           43                0     / 0             |
| 0       0                     | 0000:01:00.0    | 0            1615 / 44280                            |
| 1       1                     | 0000:01:00.0    | 0            1383 / 44280                            |
+===============================+=================+======================================================+
| 4       310P3                 | Alarm           | NA           71                0     / 0             |
| 0       2                     | 0000:02:00.0    | 0            1620 / 44280                            |
| 1       3                     | 0000:02:00.0    | 0            1380 / 44280                            |
+===============================+=================+======================================================+
+-------------------------------+-----------------+------------------------------------------------------+
| NPU     Chip                  | Process id      | Process name             | Process memory(MB)        |
+===============================+=================+======================================================+
| No running processes found in NPU 1                                                                    |
+===============================+=================+======================================================+
"""

# 910A (Atlas 800 9000): chip-side DDR in Memory-Usage, the HBM the platform cares about after it.
# Odd spacing, a card with a missing Health word and a truncated last card (no chip row).
NPU_ODD = """\
| npu-smi 21.0.4   Version: 21.0.4 |
+----+
|NPU Name|Health|Power(W) Temp(C)|
|Chip|Bus-Id|AICore(%) Memory-Usage(MB) HBM-Usage(MB)|
+====+
|0 910A|OK|68.9 38|
|   0   |0000:C1:00.0|0 2245/15039   0/32768|
+====+
|1    910A  |      | 70.2 39 |
|0|0000:C2:00.0|0   2245 /15039 100/ 32768|
+====+
|2 910A|OK|
"""

NVIDIA_HEALTHY = """\
0, GPU-5e7e3d2a-1111-2222-3333-444455556666, NVIDIA H100 80GB HBM3, 81559, 1, 0, No
1, GPU-6f8f4e3b-1111-2222-3333-444455556666, NVIDIA H100 80GB HBM3, 81559, 74000, 0, No
"""

# Odd spacing, [N/A] for fields the board lacks, and three kinds of unhealthy GPU.
NVIDIA_MIXED = """\
  0 ,GPU-aaaa,  NVIDIA GeForce RTX 4090 ,24564 , 3 ,[N/A],[N/A]
1, GPU-bbbb, Tesla V100-SXM2-32GB, 32768, 0, 2, No
2, GPU-cccc, Tesla V100-SXM2-32GB, 32768, 0, 0, Yes
3, [Unknown Error], [Unknown Error], [Unknown Error], [Unknown Error], [Unknown Error], [Unknown Error]
Unable to determine the device handle for GPU0000:86:00.0: Unknown Error
5, GPU-dddd, NVIDIA A100-SXM4-40GB, [N/A]
"""


def test_npu_910b_one_chip_per_card_with_unhealthy_cards():
    devices = parse_npu_smi_info(NPU_910B)
    assert devices == [
        DeviceInfo(0, "npu", "Ascend 910B3", 65536, True, "OK"),
        DeviceInfo(1, "npu", "Ascend 910B3", 65536, False, "Warning"),
        DeviceInfo(2, "npu", "Ascend 910B3", 65536, True, "OK"),
        DeviceInfo(3, "npu", "Ascend 910B3", 65536, False, "Critical"),
    ]


def test_npu_310p_two_chips_per_card_use_the_logical_device_ids():
    devices = parse_npu_smi_info(NPU_310P_DUO)
    assert [(d.index, d.model, d.memory_mb, d.healthy, d.health) for d in devices] == [
        (0, "Ascend 310P3", 44280, True, "OK"),
        (1, "Ascend 310P3", 44280, True, "OK"),
        (2, "Ascend 310P3", 44280, False, "Alarm"),
        (3, "Ascend 310P3", 44280, False, "Alarm"),
    ]


def test_npu_two_chip_card_without_device_column_is_numbered_in_order():
    text = NPU_310P_DUO.replace("Chip    Device", "Chip          ").replace("| 0       2    ", "| 0            ")
    text = text.replace("| 1       3    ", "| 1            ")
    text = text.replace("| 0       0    ", "| 0            ").replace("| 1       1    ", "| 1            ")
    assert [d.index for d in parse_npu_smi_info(text)] == [0, 1, 2, 3]


def test_npu_odd_spacing_missing_health_and_truncated_card():
    devices = parse_npu_smi_info(NPU_ODD)
    assert devices == [
        DeviceInfo(0, "npu", "Ascend 910A", 32768, True, "OK"),
        # No Health word: not vouched for, so not schedulable.
        DeviceInfo(1, "npu", "Ascend 910A", 32768, False, "unknown"),
        # A card row with its chip row cut off still counts as one device (memory unknown).
        DeviceInfo(2, "npu", "Ascend 910A", 0, True, "OK"),
    ]


def test_npu_output_without_device_table_is_an_error():
    with pytest.raises(InventoryError, match="no device table"):
        parse_npu_smi_info("dcmi module initialize failed. ret is -8005\n")


def test_npu_table_with_no_cards_is_empty():
    header = NPU_910B.split("| 0     910B3")[0]
    assert parse_npu_smi_info(header) == []


def test_nvidia_healthy_rows():
    assert parse_nvidia_smi_csv(NVIDIA_HEALTHY) == [
        DeviceInfo(0, "gpu", "NVIDIA H100 80GB HBM3", 81559, True, "OK"),
        DeviceInfo(1, "gpu", "NVIDIA H100 80GB HBM3", 81559, True, "OK"),
    ]


def test_nvidia_odd_spacing_na_and_unhealthy_gpus():
    devices = parse_nvidia_smi_csv(NVIDIA_MIXED)
    assert [(d.index, d.model, d.memory_mb, d.healthy, d.health) for d in devices] == [
        (0, "NVIDIA GeForce RTX 4090", 24564, True, "OK"),  # [N/A]: no ECC on the board, not an error
        (1, "Tesla V100-SXM2-32GB", 32768, False, "2 uncorrected ECC errors"),
        (2, "Tesla V100-SXM2-32GB", 32768, False, "retired pages pending"),
        (
            3,
            "",
            0,
            False,
            "uuid error; name error; memory.total error; memory.used error; "
            "ecc.errors.uncorrected.volatile.total error; retired_pages.pending error",
        ),
        # Missing trailing fields and [N/A] memory: unknown, not unhealthy.
        (5, "NVIDIA A100-SXM4-40GB", 0, True, "OK"),
    ]


def test_nvidia_bad_index_and_duplicates_are_errors():
    with pytest.raises(InventoryError, match="row 1: index 'GPU-x' is not a GPU index"):
        parse_nvidia_smi_csv("GPU-x, name, 1024\n")
    with pytest.raises(InventoryError, match="GPU index 0 listed twice"):
        parse_nvidia_smi_csv("0, a, n, 1\n0, b, n, 1\n")


def test_nvidia_query_asks_for_the_fields_the_parser_reads():
    assert NVIDIA_QUERY_FIELDS[:5] == ("index", "uuid", "name", "memory.total", "memory.used")
    assert parse_nvidia_smi_csv("") == []


def test_probe_cpu_counts_and_splits_memory():
    devices = probe_cpu(3)
    assert [d.index for d in devices] == [0, 1, 2]
    assert {d.kind for d in devices} == {"cpu"}
    assert all(d.healthy and d.memory_mb > 0 for d in devices)
    assert len({d.memory_mb for d in devices}) == 1
    with pytest.raises(InventoryError, match="must be >= 1"):
        probe_cpu(0)


def _fake_tool(directory, name, script):
    """A stand-in for a vendor tool on PATH (the real ones are absent on this machine)."""
    path = directory / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_probe_runs_the_tool_on_path_and_detects_the_kind(tmp_path, monkeypatch):
    sample = tmp_path / "out.txt"
    sample.write_text(NPU_310P_DUO)
    _fake_tool(tmp_path, "npu-smi", f'[ "$1" = info ] && cat {sample}\n')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    kind, devices = probe_devices()
    assert kind == "npu"
    assert [d.index for d in devices] == [0, 1, 2, 3]


def test_probe_nvidia_passes_the_query_and_reads_rows(tmp_path, monkeypatch):
    args = tmp_path / "args.txt"
    _fake_tool(tmp_path, "nvidia-smi", f'echo "$@" > {args}\necho "0, GPU-a, NVIDIA L4, 23034, 0, 0, No"\n')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    kind, devices = probe_devices("gpu")
    assert (kind, devices) == ("gpu", [DeviceInfo(0, "gpu", "NVIDIA L4", 23034, True, "OK")])
    assert args.read_text().split() == [
        "--query-gpu=index,uuid,name,memory.total,memory.used,ecc.errors.uncorrected.volatile.total,"
        "retired_pages.pending,utilization.gpu",
        "--format=csv,noheader,nounits",
    ]


def test_probe_failures_are_errors_not_a_cpu_fallback(tmp_path, monkeypatch):
    sleep = shutil.which("sleep")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(InventoryError, match="needs `nvidia-smi` on PATH"):
        probe_devices("gpu")
    _fake_tool(tmp_path, "nvidia-smi", 'echo "NVIDIA-SMI has failed because it could not communicate" >&2\nexit 9\n')
    with pytest.raises(InventoryError, match="exited with 9: NVIDIA-SMI has failed"):
        probe_devices("gpu")
    _fake_tool(tmp_path, "npu-smi", f"exec {sleep} 5\n")
    with pytest.raises(InventoryError, match="did not answer within 0.2 s"):
        probe_devices("npu", timeout=0.2)
    with pytest.raises(InventoryError, match="unknown device kind 'tpu'"):
        probe_devices("tpu")


def test_probe_without_tools_is_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    kind, devices = probe_devices(cpu_count=2)
    assert kind == "cpu"
    assert [d.index for d in devices] == [0, 1]


def test_device_info_from_json_names_the_bad_field():
    assert DeviceInfo.from_dict({"index": 2, "kind": "gpu", "memory_mb": 10}) == DeviceInfo(2, "gpu", "", 10)
    with pytest.raises(ValueError, match=r"devices\[1\]\.index: expected a non-negative integer, got -1"):
        DeviceInfo.from_dict({"index": -1, "kind": "gpu"}, field="devices[1]")
    with pytest.raises(ValueError, match=r"device\.kind: expected one of npu, gpu, cpu, got 'tpu'"):
        DeviceInfo.from_dict({"index": 0, "kind": "tpu"})
    with pytest.raises(ValueError, match=r"device\.healthy: expected true or false, got 'yes'"):
        DeviceInfo.from_dict({"index": 0, "kind": "cpu", "healthy": "yes"})
    with pytest.raises(ValueError, match=r"unknown keys \['colour'\]"):
        DeviceInfo.from_dict({"index": 0, "kind": "cpu", "colour": "red"})
