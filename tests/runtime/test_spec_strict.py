"""The spec's types are strict and its loader bounded: what was silently coerced or crashed is a SpecError
naming the field.

Before: ``trainer.lr: true`` loaded as 1.0 and ``pipeline.steps: "5"`` as 5; a 1 KB ``[[[...]]]`` spec or
override overflowed PyYAML's recursive composer (RecursionError); NUL characters and lone surrogates
(from YAML escapes or JSON objects) reached the database as text it cannot store.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runtime.spec import MAX_NESTING, SpecError, load_spec

ROOT = Path(__file__).resolve().parents[2]
NOT_A_BOOL = "Value error, must be a number, not true/false"
NOT_AN_INT = "Input should be a valid integer"
NOT_A_BOOLEAN = "Input should be a valid boolean"
NUL = r"contains a NUL character (\u0000)"
SURROGATE = r"contains a lone surrogate (\ud800-\udfff), which is not valid Unicode"
TOO_DEEP = f"nested deeper than {MAX_NESTING} levels"


def refused(source, overrides=None) -> list[dict[str, str]]:
    with pytest.raises(SpecError) as caught:
        load_spec(source, overrides)
    return caught.value.errors


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        ("trainer:\n  lr: true\n", "trainer.lr", NOT_A_BOOL),
        ("algorithm:\n  clip_eps_high: false\n", "algorithm.clip_eps_high", NOT_A_BOOL),
        ("pipeline:\n  steps: true\n", "pipeline.steps", NOT_AN_INT),
        ("pipeline:\n  steps: '5'\n", "pipeline.steps", NOT_AN_INT),
        ("pipeline:\n  steps: 5.0\n", "pipeline.steps", NOT_AN_INT),
        ("rollout:\n  top_k: '8'\n", "rollout.top_k", NOT_AN_INT),
        ("model:\n  reference: 'yes'\n", "model.reference", NOT_A_BOOLEAN),
        ("model:\n  reference: 1\n", "model.reference", NOT_A_BOOLEAN),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_not_coerced(text, field, message):
    assert refused(text) == [{"field": field, "message": message}]


def test_the_same_wrong_types_are_refused_in_a_json_object_spec():
    errors = refused({"trainer": {"lr": True}, "pipeline": {"steps": "5"}})

    assert errors == [
        {"field": "trainer.lr", "message": NOT_A_BOOL},
        {"field": "pipeline.steps", "message": NOT_AN_INT},
    ]


def test_numbers_of_the_right_kind_still_load_including_yaml_exponents_read_as_text():
    # PyYAML (YAML 1.1) reads 1e-4 as the string "1e-4": a float field still takes it.
    spec = load_spec("trainer:\n  lr: 1e-4\n  weight_decay: 0\npipeline:\n  steps: 7\nmodel:\n  reference: false\n")

    assert (spec.trainer.lr, spec.trainer.weight_decay, spec.pipeline.steps, spec.model.reference) == (
        0.0001,
        0.0,
        7,
        False,
    )
    assert type(spec.trainer.weight_decay) is float


def test_overrides_still_coerce_from_text_as_yaml_scalars():
    spec = load_spec(
        "name: x\n",
        [
            "algorithm.name=ppo",
            "trainer.lr=0.001",
            "trainer.critic_lr=1e-5",
            "pipeline.steps=3",
            "model.reference=false",
            "seed=-2",
        ],
    )

    assert (spec.trainer.lr, spec.trainer.critic_lr, spec.pipeline.steps, spec.model.reference, spec.seed) == (
        0.001,
        1e-5,
        3,
        False,
        -2,
    )


@pytest.mark.parametrize(
    ("override", "field", "message"),
    [
        ("trainer.lr=true", "trainer.lr", NOT_A_BOOL),
        ("pipeline.steps='3'", "pipeline.steps", NOT_AN_INT),
        ("pipeline.steps=2.5", "pipeline.steps", NOT_AN_INT),
    ],
)
def test_an_override_of_the_wrong_type_is_refused(override, field, message):
    assert refused("name: x\n", [override]) == [{"field": field, "message": message}]


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_spec_still_loads(path):
    assert load_spec(path).name


def test_a_deeply_nested_yaml_spec_is_refused():
    assert refused("[" * 500 + "]" * 500) == [{"field": "spec", "message": TOO_DEEP}]


def test_yaml_nested_exactly_to_the_limit_is_parsed_and_one_more_level_is_not():
    # A mapping (level 1) holding lists nested to the limit: refused only for the unknown field.
    at_limit = "x: " + "[" * (MAX_NESTING - 1) + "]" * (MAX_NESTING - 1) + "\n"
    over = "x: " + "[" * MAX_NESTING + "]" * MAX_NESTING + "\n"

    assert refused(at_limit) == [{"field": "x", "message": "unknown field"}]
    assert refused(over) == [{"field": "spec", "message": TOO_DEEP}]


def test_a_deeply_nested_override_is_refused_naming_its_key():
    assert refused("name: x\n", ["trainer.lr=" + "[" * 500 + "]" * 500]) == [
        {"field": "trainer.lr", "message": TOO_DEEP}
    ]


def test_a_deeply_nested_json_object_spec_is_refused():
    deep: list = []
    for _ in range(5000):
        deep = [deep]

    assert refused({"name": "x", "task": {"path": deep}}) == [
        {"field": "task.path" + ".0" * (MAX_NESTING - 2), "message": TOO_DEEP}
    ]


@pytest.mark.parametrize(
    ("source", "field", "message"),
    [
        ({"name": "a\u0000b"}, "name", NUL),
        ({"model": {"path": "/models/a\u0000b"}}, "model.path", NUL),
        ({"task": {"name": "jsonl", "path": "/data/\ud800.jsonl"}}, "task.path", SURROGATE),
        ('name: "a\\0b"\n', "name", NUL),
        ('name: "a\\ud800b"\n', "name", SURROGATE),
        ("name: a\ud800b\n", "spec", SURROGATE),
        ("name: a\u0000b\n", "spec", NUL),
    ],
)
def test_text_no_database_can_store_is_refused_naming_the_field(source, field, message):
    assert refused(source) == [{"field": field, "message": message}]


def test_yaml_aliases_are_inspected_once_not_expanded():
    # "Billion laughs": 10 ** 6 leaves if expanded; each shared list is inspected once.
    levels = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for prev, name in zip("abcde", "bcdef", strict=True):
        levels.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 10) + "]")

    errors = refused("\n".join(levels) + "\n")

    assert errors == [{"field": name, "message": "unknown field"} for name in "abcdef"]


def test_the_cli_exits_with_the_bad_input_code_on_a_deeply_nested_spec(tmp_path):
    spec = tmp_path / "deep.yaml"
    spec.write_text("[" * 500 + "]" * 500)

    done = subprocess.run(
        [sys.executable, "-m", "runtime", "validate", str(spec)], cwd=ROOT, capture_output=True, text=True
    )

    assert done.returncode == 2
    assert f"spec: {TOO_DEEP}" in done.stderr
    assert "Traceback" not in done.stderr
