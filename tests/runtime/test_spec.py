"""The run spec: defaults, overrides, and errors that name the field."""

import pytest

from runtime.spec import SpecError, apply_overrides, load_spec


def _fields(exc: SpecError) -> list[str]:
    return [e["field"] for e in exc.errors]


def test_defaults_resolve_to_a_complete_spec():
    spec = load_spec({})
    resolved = spec.resolved()
    assert resolved["pipeline"]["mode"] == "sync"
    assert resolved["algorithm"]["name"] == "grpo"
    assert spec.samples_per_step == 8 * 8
    assert spec.queue_capacity == 5 * 64
    assert spec.resources.total_devices == 1


def test_yaml_text_and_overrides_are_typed():
    spec = load_spec(
        "pipeline:\n  mode: async\nrollout:\n  temperature: 0.7\n",
        [
            "pipeline.steps=3",
            "algorithm.kl_coef=0.05",
            "model.reference=false",
            "checkpoint.keep_best_metric=eval/accuracy",
        ],
    )
    assert spec.pipeline.mode == "async"
    assert spec.pipeline.steps == 3
    assert spec.algorithm.kl_coef == 0.05
    assert spec.model.reference is False
    assert spec.rollout.temperature == 0.7
    assert spec.checkpoint.keep_best_metric == "eval/accuracy"


def test_spec_file_is_loaded(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: demo\npipeline: {steps: 7}\n")
    spec = load_spec(path)
    assert (spec.name, spec.pipeline.steps) == ("demo", 7)
    assert str(spec.resolved_output_dir()) == "runs/demo"


@pytest.mark.parametrize(
    ("data", "field", "fragment"),
    [
        ({"pipline": {}}, "pipline", "unknown field"),
        ({"pipeline": {"mode": "fast"}}, "pipeline.mode", "sync"),
        ({"pipeline": {"steps": "many"}}, "pipeline.steps", "integer"),
        ({"pipeline": {"steps": -1}}, "pipeline.steps", "greater than or equal to 1"),
        ({"resources": {"trainer_devices": 100000}}, "resources.trainer_devices", "less than or equal"),
        ({"algorithm": {"group_size": 1}}, "algorithm.group_size", "at least 2"),
        (
            {"pipeline": {"mode": "colocated"}, "resources": {"rollout_devices": 2}},
            "resources.rollout_devices",
            "colocated",
        ),
        ({"task": {"name": "jsonl"}}, "task", "needs `path`"),
        ({"rollout": {"top_p": 0}}, "rollout.top_p", "greater than 0"),
    ],
)
def test_bad_values_name_the_field(data, field, fragment):
    with pytest.raises(SpecError) as info:
        load_spec(data)
    assert field in _fields(info.value)
    message = next(e["message"] for e in info.value.errors if e["field"] == field)
    assert fragment in message


def test_every_error_is_reported_at_once():
    with pytest.raises(SpecError) as info:
        load_spec({"pipeline": {"steps": 0, "mode": "x"}, "extra": 1})
    assert sorted(_fields(info.value)) == ["extra", "pipeline.mode", "pipeline.steps"]


@pytest.mark.parametrize("text", ["a: [", "- just\n- a list\n", "pipeline: {mode: sync"])
def test_malformed_or_non_mapping_yaml(text):
    with pytest.raises(SpecError) as info:
        load_spec(text if "\n" in text else text + "\n")
    assert _fields(info.value) == ["spec"]


def test_missing_spec_file_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match="no such spec file"):
        load_spec(tmp_path / "nope.yaml")


def test_bad_override_syntax():
    with pytest.raises(SpecError) as info:
        apply_overrides({"pipeline": 3}, ["pipeline.steps=2", "novalue"])
    assert sorted(_fields(info.value)) == ["novalue", "pipeline.steps"]
