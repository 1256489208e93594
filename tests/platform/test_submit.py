"""Submitting runs: validation by the runtime's schema, bad input writes nothing, idempotent submission_id."""

import pytest

from jobs import handler
from jobs.models import Allocation, Experiment, Run
from jobs.states import RunState
from rlplatform.models import AuditLog, Quota

pytestmark = pytest.mark.django_db


def _nothing_written():
    return Run.objects.count() == 0 and Allocation.objects.count() == 0


def _fields(exc_info):
    return [(e["field"], e["message"]) for e in exc_info.value.errors]


def test_valid_submit_stores_spec_resolved_spec_and_admits(experiment, owner, spec):
    text = spec(2, rollout_workers=3, name="my-run")
    run, created = handler.submit_run(owner, experiment, text, submission_id="ci-1")
    assert created is True
    assert (run.name, run.spec, run.state, run.reason) == ("my-run", text, RunState.ADMITTED, "")
    assert run.resolved_spec["resources"]["trainer_devices"] == 2
    assert run.resolved_spec["algorithm"]["name"] == "grpo"  # defaults filled in
    assert (run.devices_requested, run.rollout_workers, run.created_by) == (2, 3, owner)
    assert Allocation.objects.active().filter(run=run).count() == 2


def test_dict_specs_and_overrides_are_accepted(experiment, owner):
    run, _ = handler.submit_run(
        owner, experiment, {"resources": {"device": "cpu"}}, overrides=["resources.trainer_devices=3"], name="o"
    )
    assert run.devices_requested == 3
    assert run.name == "o"


@pytest.mark.parametrize(
    "text,expected",
    [
        (
            "resources: [unclosed",
            [("spec", "malformed YAML at line 1, column 21: expected ',' or ']', but got '<stream end>'")],
        ),
        ("- a\n- b\n", [("spec", "the spec must be a mapping of sections")]),
        ("resources:\n  trainer_devics: 2\n", [("resources.trainer_devics", "unknown field")]),
        (
            "resources:\n  trainer_devices: lots\n",
            [("resources.trainer_devices", "Input should be a valid integer")],
        ),
        (
            "resources:\n  trainer_devices: -1\n",
            [("resources.trainer_devices", "Input should be greater than or equal to 1")],
        ),
        (
            "resources:\n  trainer_devices: 100000\n",
            [("resources.trainer_devices", "Input should be less than or equal to 4096")],
        ),
        (  # a sync run would hold the 3 extra devices and use none of them
            "resources:\n  rollout_devices: 2\n  eval_devices: 1\n",
            [
                ("resources.rollout_devices", "acts only in pipeline.mode async, not sync: leave it at 0"),
                ("resources.eval_devices", "acts only in pipeline.mode async, not sync: leave it at 0"),
            ],
        ),
        (
            "rollout:\n  engine: vllm\n",
            [
                (
                    "rollout.engine",
                    "vllm loads a Hugging Face model directory, but model.builtin tiny-qwen2 has none: set "
                    "model.path (`python -m runtime sft SPEC --steps N --out DIR` writes one)",
                ),
            ],
        ),
    ],
)
def test_bad_specs_name_the_field_and_write_nothing(experiment, owner, text, expected):
    with pytest.raises(handler.InvalidInput) as info:
        handler.submit_run(owner, experiment, text)
    assert _fields(info) == expected
    assert _nothing_written()


def test_request_larger_than_the_whole_group_is_refused(experiment, owner, spec):
    with pytest.raises(handler.InvalidInput) as info:
        handler.submit_run(owner, experiment, spec(9))
    assert _fields(info) == [("resources", "request exceeds the whole group: needs 9 devices, group cpu-local has 8")]
    assert _nothing_written()


def test_request_larger_than_the_quota_and_wrong_device_kind_are_refused(
    make_experiment, team_a, cpu_group, owner, spec
):
    small = make_experiment(team_a, cpu_group, "small", max_devices=2, max_rollout_workers=2)
    with pytest.raises(handler.InvalidInput) as info:
        handler.submit_run(owner, small, spec(3, device="npu", rollout_workers=5))
    assert _fields(info) == [
        ("resources.device", "group cpu-local has cpu devices, not npu"),
        ("resources", "needs 4 devices; the experiment's quota allows 2"),  # 3 trainer ranks + 1 rollout
        ("resources.rollout_workers", "5 exceeds the quota's 2 rollout workers"),
    ]
    assert _nothing_written()


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"submission_id": "has space"}, "submission_id"),
        ({"submission_id": "x" * 129}, "submission_id"),
        ({"priority": 5000}, "priority"),
        ({"priority": "high"}, "priority"),
        ({"name": ""}, "name"),
    ],
)
def test_bad_arguments_name_the_field_and_write_nothing(experiment, owner, spec, kwargs, field):
    with pytest.raises(handler.InvalidInput) as info:
        handler.submit_run(owner, experiment, spec(1), **kwargs)
    assert [f for f, _ in _fields(info)] == [field]
    assert _nothing_written()


def test_spec_paths_are_never_read_as_files(experiment, owner):
    # runtime.spec.load_spec would open a one-line "*.yaml" string as a file; a submission must not.
    with pytest.raises(handler.InvalidInput) as info:
        handler.submit_run(owner, experiment, "/etc/passwd.yaml")
    assert _fields(info) == [("spec", "the spec must be a mapping of sections")]
    assert _nothing_written()


def test_oversized_spec_is_refused(experiment, owner):
    with pytest.raises(handler.InvalidInput) as info:
        handler.submit_run(owner, experiment, "name: x\n" + "#" * (300 * 1024))
    assert _fields(info) == [("spec", "larger than 256 KiB")]
    assert _nothing_written()


def test_same_submission_id_returns_the_same_run(experiment, owner, spec):
    first, created = handler.submit_run(owner, experiment, spec(1), submission_id="build-42")
    again, created_again = handler.submit_run(owner, experiment, spec(1), submission_id="build-42")
    assert (created, created_again) == (True, False)
    assert again.pk == first.pk
    assert Run.objects.count() == 1
    assert Allocation.objects.count() == 1


def test_same_submission_id_with_another_spec_conflicts(experiment, owner, spec):
    handler.submit_run(owner, experiment, spec(1), submission_id="build-42")
    with pytest.raises(handler.Conflict, match="build-42"):
        handler.submit_run(owner, experiment, spec(2), submission_id="build-42")
    assert Run.objects.count() == 1


def test_submission_ids_are_per_experiment(experiment, make_experiment, team_a, cpu_group, owner, spec):
    other = make_experiment(team_a, cpu_group, "other")
    a, _ = handler.submit_run(owner, experiment, spec(1), submission_id="same")
    b, created = handler.submit_run(owner, other, spec(1), submission_id="same")
    assert created is True and a.pk != b.pk


def test_create_experiment_with_default_quota_is_audited(team_a, cpu_group, owner, settings):
    settings.TANDEM_DEFAULT_QUOTA = {
        "max_devices": 3,
        "max_concurrent_runs": 2,
        "max_rollout_workers": 5,
        "device_hour_budget": 7.5,
    }
    exp = handler.create_experiment(owner, team_a, "new-exp", cpu_group)
    quota = exp.quota
    assert (quota.team, quota.group, quota.name) == (team_a, cpu_group, "new-exp")
    assert (quota.max_devices, quota.max_concurrent_runs, quota.max_rollout_workers, quota.device_hour_budget) == (
        3,
        2,
        5,
        7.5,
    )
    entry = AuditLog.objects.get(action="quota.create")
    assert (entry.actor, entry.team, entry.target_id, entry.before) == (owner, team_a, str(quota.pk), None)


def test_create_experiment_bad_input_writes_nothing(team_a, team_b, make_group, cpu_group, owner, experiment):
    ungranted = make_group("private", teams=[team_b])
    foreign_quota = Quota.objects.create(team=team_b, group=cpu_group, name="theirs")
    before = (Experiment.objects.count(), Quota.objects.count())
    with pytest.raises(handler.InvalidInput) as info:
        handler.create_experiment(owner, team_a, "exp-a", ungranted)
    assert [f for f, _ in _fields(info)] == ["name", "group"]
    with pytest.raises(handler.InvalidInput) as info:
        handler.create_experiment(owner, team_a, "bad name!", cpu_group, quota=foreign_quota)
    assert [f for f, _ in _fields(info)] == ["name", "quota"]
    assert (Experiment.objects.count(), Quota.objects.count()) == before


def test_bad_quota_values_name_the_field(experiment, owner):
    before = Quota.objects.values().get(pk=experiment.quota.pk)
    with pytest.raises(handler.InvalidInput) as info:
        handler.update_quota(owner, experiment.quota, max_devices=-1, device_hour_budget="lots", colour="red")
    assert [f for f, _ in _fields(info)] == ["max_devices", "device_hour_budget", "colour"]
    assert Quota.objects.values().get(pk=experiment.quota.pk) == before
    assert not AuditLog.objects.filter(action="quota.update").exists()
