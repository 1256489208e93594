"""The calibration store: round trips, field errors, names, and the calibration the project ships."""

from __future__ import annotations

import json

import pytest

from capacity import InputError
from capacity.calibration import Calibration, load, shipped, shipped_names
from tests.capacity.helpers import hand_costs


def calibration(**changes) -> Calibration:
    values = dict(
        name="test-machine",
        source="python bench/capacity_calibration.py --quick",
        costs=hand_costs(),
        measured_at="2026-12-01T23:40:00Z",
        notes="hand costs",
        variants={"all-cores": hand_costs(decode_step_s=0.02)},
    )
    values.update(changes)
    return Calibration(**values)


def test_round_trips_through_a_dict_and_a_file(tmp_path):
    original = calibration()
    assert Calibration.from_dict(json.loads(json.dumps(original.as_dict()))) == original
    path = tmp_path / "calibrations" / "test-machine.json"
    original.save(path)
    assert load(path) == original


def test_variants_are_optional():
    data = calibration().as_dict()
    del data["variants"]
    assert Calibration.from_dict(data).variants == {}


def test_bad_costs_are_named_with_their_prefix():
    data = calibration().as_dict()
    data["costs"]["decode_s_per_token"] = -1.0
    data["variants"]["all-cores"]["train_s_per_token"] = "fast"
    data["colour"] = "blue"
    with pytest.raises(InputError) as info:
        Calibration.from_dict(data)
    assert info.value.fields == [
        "colour",
        "costs.decode_s_per_token",
        "variants.all-cores.train_s_per_token",
    ]


def test_a_bad_link_field_is_named_in_full():
    data = calibration().as_dict()
    data["costs"]["intra_node"]["bandwidth_bytes_per_s"] = 0
    with pytest.raises(InputError) as info:
        Calibration.from_dict(data)
    assert info.value.fields == ["costs.intra_node.bandwidth_bytes_per_s"]


def test_missing_costs_are_named():
    with pytest.raises(InputError) as info:
        Calibration.from_dict({"name": "x", "source": "y"})
    assert info.value.fields == ["costs"]


def test_bad_names_and_sources_are_refused():
    for name in ("Bad Name", "../etc", "", "-x"):
        with pytest.raises(InputError) as info:
            calibration(name=name)
        assert info.value.fields == ["name"]
    with pytest.raises(InputError) as info:
        calibration(source="  ", variants={"Bad Name": hand_costs()})
    assert info.value.fields == ["source", "variants"]


def test_unknown_or_malformed_shipped_names_are_refused():
    for name in ("no-such-machine", "../calibrations/cpu-2core", "CPU-2CORE"):
        with pytest.raises(InputError) as info:
            shipped(name)
        assert info.value.fields == ["calibration"]


def test_an_unreadable_file_is_named(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(InputError) as info:
        load(path)
    assert info.value.fields == ["calibration"]


def test_the_shipped_cpu_calibration_loads():
    assert "cpu-2core" in shipped_names()
    cpu = shipped("cpu-2core")
    assert cpu.name == "cpu-2core"
    assert cpu.source.startswith("python bench/capacity_calibration.py")
    assert cpu.measured_at
    assert set(cpu.variants) == {"all-cores"}
    assert cpu.costs.decode_s_per_token > 0 and cpu.costs.train_s_per_token > 0
