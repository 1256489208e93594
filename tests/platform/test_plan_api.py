"""POST /api/runs/plan/: a submit's input and checks, nothing stored, a plan of the spec in every mode.

The plans here run on a calibration file the tests write (tests do not depend on the shipped ones), so
the figures are the capacity model's on known costs; what is asserted is the plan's shape, its
provenance and the rules that choose rows and the recommendation, not how fast any machine is.
"""

from __future__ import annotations

import json

import pytest
from rest_framework.test import APIClient

from capacity.spec_mapping import UNKNOWN
from jobs import planning
from jobs.models import Allocation, Experiment, Run, RunStreamEntry
from rlplatform.models import AuditLog, Quota
from tests.platform.capacity_costs import TEST_COSTS, write_calibration

pytestmark = pytest.mark.django_db

PLAN = "/api/runs/plan/"
SUBMIT = "/api/runs/"


@pytest.fixture(autouse=True)
def cpu_calibration(settings, tmp_path):
    """The CPU group's calibration: a file of this test's costs."""
    path = write_calibration(tmp_path, "test-cpu", "written by tests/platform/test_plan_api.py")
    settings.TANDEM_CAPACITY_CALIBRATIONS = {"cpu": str(path)}
    return path


@pytest.fixture
def client_of():
    def make(user):
        client = APIClient()
        client.force_authenticate(user)
        return client

    return make


def _stored() -> tuple[int, ...]:
    return (
        Run.objects.count(),
        Experiment.objects.count(),
        Quota.objects.count(),
        Allocation.objects.count(),
        RunStreamEntry.objects.count(),
        AuditLog.objects.count(),
    )


def test_a_plan_predicts_every_mode_recommends_one_and_says_it_is_an_estimate_from_which_calibration(
    client_of, owner, experiment
):
    before = _stored()
    reply = client_of(owner).post(PLAN, {"experiment": "exp-a", "spec": "name: p\n"}, format="json")
    assert reply.status_code == 200, reply.content
    plan = reply.json()
    assert (plan["estimate"], plan["modelled"], plan["reason"]) == (True, True, "")
    assert plan["note"] == f"{planning.ESTIMATE_NOTE} Costs: calibration test-cpu (measured)."
    assert plan["calibration"]["name"] == "test-cpu"
    assert plan["calibration"]["source"] == "written by tests/platform/test_plan_api.py"
    assert plan["group"] == {"id": experiment.group_id, "name": "cpu-local", "kind": "cpu", "devices": 8}
    rows = [(m["mode"], m["max_policy_lag"], m["as_submitted"], m["devices"], m["fits"]) for m in plan["modes"]]
    assert rows == [
        ("sync", None, True, 1, True),
        ("colocated", None, False, 1, True),
        ("async", 1, False, 2, True),
        ("async", 2, False, 2, True),
        ("async", 3, False, 2, True),
    ]
    for mode in plan["modes"]:
        assert mode["problem"] == ""
        assert mode["samples_per_s"] > 0 and mode["step_time_s"] > 0
        assert mode["run_time_s"] == pytest.approx(50 * mode["step_time_s"])  # pipeline.steps defaults to 50
        assert mode["device_hours"] == pytest.approx(mode["devices"] * mode["run_time_s"] / 3600)
        assert sum(mode["time_split"].values()) == pytest.approx(mode["step_time_s"], rel=1e-6)
        assert mode["bottleneck"] in {"generation", "training", "allreduce", "weight_sync", "switch", "transfer"}
    best = max(m["samples_per_s"] for m in plan["modes"])
    pick = next(m for m in plan["modes"] if (m["mode"], m["max_policy_lag"]) == tuple(plan["recommended"].values())[:2])
    assert pick["samples_per_s"] >= planning.NEAR_BEST * best
    assert plan["recommended"]["bottleneck"] == pick["bottleneck"]
    assert plan["inputs"]["prompt_tokens"] == planning.DEFAULT_PROMPT_TOKENS
    assert plan["inputs"]["response_tokens"] == 8.0  # a quarter of rollout.max_new_tokens (32)
    assert _stored() == before  # nothing written: no run, experiment, quota, allocation, stream entry or audit row


def test_the_recommendation_is_the_fewest_devices_then_smallest_lag_among_modes_within_5_percent_of_the_fastest():
    def row(mode, lag, samples, devices, fits=True):
        return planning.ModePlan(mode, lag, False, devices, fits, samples_per_s=samples, bottleneck="x")

    rows = [row("sync", None, 100.0, 1), row("async", 2, 104.0, 2), row("async", 1, 103.0, 2)]
    rows.append(row("async", 3, 150.0, 4, fits=False))  # faster, but not within the experiment's devices
    assert planning.recommend(rows)["mode"] == "sync"  # 100 is within 5% of 104, on fewer devices
    rows[0].samples_per_s = 98.0
    assert (planning.recommend(rows)["mode"], planning.recommend(rows)["max_policy_lag"]) == ("async", 1)
    assert planning.recommend(rows)["why"] == (
        "103 samples/s on 2 devices, within 5% of the fastest mode that fits (104 samples/s) on the fewest devices"
    )
    assert planning.recommend([row("async", 2, 120.0, 9, fits=False)]) is None  # nothing that fits


def test_an_async_spec_is_planned_at_its_own_lag_too(client_of, owner, experiment):
    spec = "name: a\npipeline:\n  mode: async\n  max_policy_lag: 5\nresources:\n  rollout_workers: 2\n"
    plan = client_of(owner).post(PLAN, {"experiment": experiment.pk, "spec": spec}, format="json").json()
    asyncs = [(m["max_policy_lag"], m["as_submitted"], m["devices"]) for m in plan["modes"] if m["mode"] == "async"]
    assert asyncs == [(1, False, 3), (2, False, 3), (3, False, 3), (5, True, 3)]


@pytest.mark.parametrize(
    "body",
    [
        {"spec": "name: t\npipeline:\n  mode: turbo\n"},  # a bad spec field
        {"spec": "resources:\n  trainer_devics: 2\n"},  # an unknown spec field
        {"spec": "resources: [unclosed"},  # not YAML
        {"spec": "resources:\n  device: cuda\n"},  # not this group's device kind
        {"spec": "resources:\n  trainer_devices: 9\n"},  # more than the group has
        {"spec": "name: t\n", "priority": 5000},  # a submit argument out of range
        {"spec": "name: t\n", "submission_id": "-bad id"},
        {"spec": "name: t\n", "overrides": ["pipeline.mode=turbo"]},
        {"spec": "model:\n  path: /etc\n"},  # a path the team may not read
        {"spec": "name: t\n", "experiment": "no-such-experiment"},
        {"spec": "name: t\n", "submision_id": "typo"},  # an unknown request field
    ],
)
def test_bad_input_is_refused_with_the_same_field_errors_as_a_submit(client_of, owner, experiment, body):
    body = {"experiment": "exp-a", **body}
    client = client_of(owner)
    before = _stored()
    planned = client.post(PLAN, body, format="json")
    submitted = client.post(SUBMIT, body, format="json")
    assert planned.status_code == submitted.status_code == 400
    assert planned.json()["errors"] == submitted.json()["errors"]
    assert planned.json()["errors"][0]["field"] not in ("", None)
    assert _stored() == before


def test_a_plan_is_scoped_to_the_callers_teams_and_roles_like_a_submit(
    client_of, outsider, viewer, owner, experiment, experiment_b
):
    body = {"experiment": experiment.pk, "spec": "name: t\n"}
    # another team's experiment is not found, as in a submit
    planned = client_of(outsider).post(PLAN, body, format="json")
    submitted = client_of(outsider).post(SUBMIT, body, format="json")
    assert (planned.status_code, planned.json()["errors"]) == (400, submitted.json()["errors"])
    assert planned.json()["errors"][0]["field"] == "experiment"
    # a viewer may not submit, so may not plan
    refused = client_of(viewer).post(PLAN, body, format="json")
    assert refused.status_code == 403
    assert refused.json()["errors"][0]["message"] == "viewers of team team-a cannot submit runs, nor plan them"
    # nobody signed in
    assert APIClient().post(PLAN, body, format="json").status_code in (401, 403)
    # the other team's own experiment in the same group plans
    assert (
        client_of(outsider).post(PLAN, {"experiment": "exp-b", "spec": "name: t\n"}, format="json").status_code == 200
    )


def test_a_group_the_experiments_quota_does_not_cover_marks_bigger_modes_as_not_fitting(
    client_of, owner, team_a, cpu_group, make_experiment
):
    make_experiment(team_a, cpu_group, "small", max_devices=2)
    spec = "name: t\nresources:\n  trainer_devices: 2\n"
    plan = client_of(owner).post(PLAN, {"experiment": "small", "spec": spec}, format="json").json()
    fits = {(m["mode"], m["max_policy_lag"]): (m["fits"], m["problem"]) for m in plan["modes"]}
    assert fits[("sync", None)] == (True, "")
    assert fits[("async", 1)] == (False, "needs 3 devices; 2 are available to this experiment in cpu-local")
    assert plan["recommended"]["mode"] in ("sync", "colocated")


def test_fields_whose_effect_is_not_modelled_are_named_with_the_reason(client_of, owner, experiment):
    spec = "name: t\nreward:\n  url: http://reward.example/score\ncheckpoint:\n  interval: 5\n"
    plan = client_of(owner).post(PLAN, {"experiment": "exp-a", "spec": spec}, format="json").json()
    named = {item["field"]: item["reason"] for item in plan["not_modelled"]}
    assert named["reward.url"] == "a remote reward service's latency is not modelled (scoring is free)"
    assert named["checkpoint.interval"] == "checkpoint saves every N steps take time the model leaves out"
    assert plan["modelled"] is True


def test_a_spec_field_the_model_does_not_know_is_planned_and_named_never_dropped(experiment):
    from runtime.spec import parse_spec_text, validate_spec

    resolved = validate_spec(parse_spec_text("name: t\n")).resolved()
    resolved["pipeline"]["warp_drive"] = True  # a spec newer than the capacity model
    plan = planning.plan(resolved, planning.Group.of(experiment.group))
    assert {"field": "pipeline.warp_drive", "reason": UNKNOWN} in plan["not_modelled"]
    assert plan["modelled"] is True and len(plan["modes"]) == 5


def test_a_gym_spec_is_answered_not_modelled_with_the_reason(client_of, owner, experiment):
    spec = "name: cartpole\nworkload: gym\nenv:\n  id: CartPole-v1\n"
    reply = client_of(owner).post(PLAN, {"experiment": "exp-a", "spec": spec}, format="json")
    assert reply.status_code == 200
    plan = reply.json()
    assert (plan["modelled"], plan["modes"], plan["recommended"], plan["calibration"]) == (False, [], None, None)
    assert plan["reason"] == f"workload 'gym': {planning.GYM_REASON}"
    assert {"workload", "env", "agent"} <= {item["field"] for item in plan["not_modelled"]}


def test_model_inputs_out_of_physical_range_are_field_errors(client_of, owner, experiment):
    client = client_of(owner)

    def errors(inputs):
        reply = client.post(PLAN, {"experiment": "exp-a", "spec": "name: t\n", "inputs": inputs}, format="json")
        assert reply.status_code == 400
        return [e["field"] for e in reply.json()["errors"]]

    assert errors({"prompt_tokens": 0, "response_sigma": 9.0}) == ["inputs.prompt_tokens", "inputs.response_sigma"]
    assert errors({"max_lag": 9}) == ["inputs.max_lag"]
    assert errors({"prompt_tokens": "many"}) == ["inputs.prompt_tokens"]
    assert errors({"warp": 1}) == ["inputs.warp"]
    bad_costs = {**json.loads(json.dumps(TEST_COSTS.as_dict())), "intra_node": {"bandwidth_bytes_per_s": -1.0}}
    assert errors({"costs": bad_costs}) == ["inputs.costs.intra_node.bandwidth_bytes_per_s"]
    assert errors({"costs": {**TEST_COSTS.as_dict(), "decode_s_per_token": 1e9}}) == ["inputs.costs.decode_s_per_token"]


def test_costs_given_with_the_request_replace_the_calibration_and_say_so(client_of, owner, experiment):
    inputs = {"costs": TEST_COSTS.as_dict(), "prompt_tokens": 16, "response_tokens": 4, "max_lag": 1}
    plan = (
        client_of(owner)
        .post(PLAN, {"experiment": "exp-a", "spec": "name: t\n", "inputs": inputs}, format="json")
        .json()
    )
    assert (plan["calibration"]["name"], plan["calibration"]["kind"]) == ("request", "request")
    assert (plan["inputs"]["prompt_tokens"], plan["inputs"]["response_tokens"]) == (16, 4)
    assert [(m["mode"], m["max_policy_lag"]) for m in plan["modes"]] == [
        ("sync", None),
        ("colocated", None),
        ("async", 1),
    ]


def test_without_a_usable_cpu_calibration_the_plan_says_so(client_of, owner, experiment, settings, tmp_path):
    settings.TANDEM_CAPACITY_CALIBRATIONS = {"cpu": str(tmp_path / "absent.json")}
    plan = client_of(owner).post(PLAN, {"experiment": "exp-a", "spec": "name: t\n"}, format="json").json()
    assert (plan["modelled"], plan["modes"], plan["calibration"]) == (False, [], None)
    assert plan["reason"].startswith(f"calibration {str(tmp_path / 'absent.json')!r} cannot be used: ")
    settings.TANDEM_CAPACITY_CALIBRATIONS = {}
    plan = client_of(owner).post(PLAN, {"experiment": "exp-a", "spec": "name: t\n"}, format="json").json()
    assert plan["reason"].startswith("no calibration is configured for cpu devices")


def test_an_accelerator_group_without_a_calibration_plans_on_its_hardware_preset(
    client_of, owner, team_a, make_group, make_experiment
):
    group = make_group("h100s", "gpu", hosts=[("h1", 8, "sw1")], teams=[team_a], device_model="NVIDIA H100 80GB")
    make_experiment(team_a, group, "gpu-exp")
    spec = "name: g\nmodel:\n  builtin: small-qwen2\n  dtype: bfloat16\nresources:\n  device: cuda\n"
    plan = client_of(owner).post(PLAN, {"experiment": "gpu-exp", "spec": spec}, format="json").json()
    assert (plan["calibration"]["name"], plan["calibration"]["kind"]) == ("h100-sxm.small-qwen2", "derived")
    assert plan["calibration"]["source"].startswith("derived from NVIDIA H100 SXM5 80GB")
    assert plan["calibration"]["notes"] == ""
    assert plan["modelled"] is True and all(m["samples_per_s"] > 0 for m in plan["modes"])


def test_a_spec_too_large_to_simulate_within_the_budget_is_answered_not_simulated(client_of, owner, experiment):
    wide = "name: t\npipeline:\n  prompts_per_step: 100000\n"
    plan = client_of(owner).post(PLAN, {"experiment": "exp-a", "spec": wide}, format="json").json()
    assert plan["modelled"] is False
    assert plan["reason"] == (
        "800000 samples per step is more than the planner simulates within its budget "
        f"({planning.SIMULATION_BUDGET} simulated samples over 3 modes)"
    )
    # large ones simulate fewer steps first (down to 3), then drop async lags beyond 1, the largest first
    lock_step = [("sync", None), ("colocated", None)]
    for samples, expected in (
        (1200, ([*lock_step, ("async", 1), ("async", 2), ("async", 3)], 8)),
        (2400, ([*lock_step, ("async", 1), ("async", 2), ("async", 3)], 4)),
        (4000, ([*lock_step, ("async", 1), ("async", 2)], 3)),
        (5200, ([*lock_step, ("async", 1)], 3)),
    ):
        base = planning.Config(prompts_per_step=samples, group_size=1)
        assert planning._budgeted(base, planning._variants(3, None)) == expected, samples


def test_the_builtin_model_shapes_are_the_runtimes():
    from runtime.models.configs import BUILTIN_CONFIGS
    from runtime.models.tokenizer import CharTokenizer

    for name, config in BUILTIN_CONFIGS.items():
        dims = {k: v for k, v in config.items() if k != "model_type"}
        assert planning.BUILTIN_DIMS[name] == {**dims, "vocab_size": CharTokenizer().vocab_size}, name


def test_the_model_shape_counts_the_parameters_of_the_real_model():
    torch = pytest.importorskip("torch")
    from runtime.models.loading import build_builtin
    from runtime.models.tokenizer import CharTokenizer

    with torch.device("meta"):  # the model a built-in run trains (the plain decoder), without storage
        model = build_builtin("tiny-qwen2", torch.float32, CharTokenizer())
    real = sum(p.numel() for p in model.parameters())
    shape = planning.model_shape({"model": {"builtin": "tiny-qwen2", "dtype": "float32"}})
    # q/k/v biases (Qwen2 has them) are the only parameters the shape leaves out: a few hundred of ~0.4 M
    assert shape.params == pytest.approx(real, rel=0.01)
    assert shape.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4  # K and V x layers x KV heads x head dim x float32
