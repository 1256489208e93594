"""Every knob acts in the modes that accept it, or is refused naming it: a spec that asks for something
the run would not do fails validation (exit 2 on the CLI, 400 at submit), and the resolved spec records
only the knobs that act in its mode."""

from __future__ import annotations

import pytest

from runtime.__main__ import main
from runtime.spec import ACTS_ONLY_WITH, MODE_ONLY, RunSpec, SpecError, load_spec, validate_spec

MODES = ("sync", "async", "colocated")
# A value other than the default for each mode-only knob.
ASKED = {
    "rollout.length_prediction": "off",
    "pipeline.offload_optimizer": True,
    "resources.rollout_workers": 2,
    "resources.rollout_devices": 1,
    "resources.eval_devices": 1,
    "resources.rollout_restarts": 5,
    "resources.min_rollout_workers": 1,
    "rollout.hang_timeout_s": 30.0,
    "pipeline.scale_up_below": 0.5,
    "pipeline.scale_down_above": 0.5,
    "pipeline.transfer_max_bytes": 1024,
    "pipeline.transfer_window_s": 0.5,
    "pipeline.transfer_shm_min_bytes": None,
    "pipeline.queue_capacity": 64,
    "pipeline.on_lag_exceeded": "drop",
    "pipeline.max_policy_lag": 3,
    "resources.remote_rollout_workers": 1,
    "resources.remote_evaluator": True,
    "pipeline.rollout_listen": "127.0.0.1:0",
    "pipeline.rollout_reconnect_s": 60.0,
    "pipeline.remote_weight_sync": "broadcast",
}
# Knobs refused outside their modes by a check of their own, older than MODE_ONLY: (path, mode) -> message.
OWN_MESSAGES = {
    ("resources.rollout_devices", "colocated"): "colocated mode shares the trainer's devices; set rollout_devices to 0",
    **{
        ("resources.remote_rollout_workers", mode): f"remote rollout instances need pipeline.mode async, not {mode}"
        for mode in ("sync", "colocated")
    },
    **{
        ("resources.remote_evaluator", mode): f"a remote evaluator needs pipeline.mode async, not {mode}"
        for mode in ("sync", "colocated")
    },
}


def _spec(mode: str, **knobs) -> dict:
    data: dict = {"pipeline": {"mode": mode}}
    for path, value in knobs.items():
        section, name = path.split(".")
        data.setdefault(section, {})[name] = value
    return data


def _errors(data: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as err:
        validate_spec(data)
    return {e["field"]: e["message"] for e in err.value.errors}


def test_every_mode_only_knob_has_a_value_to_ask_for():
    assert set(ASKED) == set(MODE_ONLY)


@pytest.mark.parametrize("path", sorted(MODE_ONLY))
@pytest.mark.parametrize("mode", MODES)
def test_a_mode_only_knob_is_taken_where_it_acts_and_refused_elsewhere(path, mode):
    data = _spec(mode, **{path: ASKED[path]})
    if mode in MODE_ONLY[path]:
        spec = validate_spec(data)
        section, name = path.split(".")
        assert getattr(getattr(spec, section), name) == ASKED[path]
        assert spec.resolved()[section][name] == ASKED[path]
    else:
        errors = _errors(data)
        if (path, mode) in OWN_MESSAGES:
            assert errors[path] == OWN_MESSAGES[path, mode]
        else:
            assert errors[path].startswith(f"acts only in pipeline.mode {' or '.join(MODE_ONLY[path])}, not {mode}")


@pytest.mark.parametrize("mode", MODES)
def test_the_resolved_spec_records_only_the_knobs_that_act_and_validates_again(mode):
    spec = validate_spec(_spec(mode))
    resolved = spec.resolved()
    for path, modes in MODE_ONLY.items():
        section, name = path.split(".")
        assert (name in resolved[section]) == (mode in modes), path
    again = validate_spec(resolved)  # what the platform hands the role back
    assert again.resolved() == resolved


# Knobs that act only with some algorithms or tasks: a value other than the default, a spec section where
# it acts, and one where it does not.
JSONL = {"name": "jsonl", "path": "data/train.jsonl"}
DATASET = {"name": "dataset", "path": "data/train.parquet"}
VLLM = {"rollout": {"engine": "vllm"}, "model": {"path": "m"}, "resources": {"device": "cuda"}}
WITH = {
    "algorithm.gamma": (0.9, {"algorithm": {"name": "ppo"}}, {"algorithm": {"name": "grpo"}}),
    "algorithm.lam": (0.9, {"algorithm": {"name": "ppo"}}, {"algorithm": {"name": "grpo"}}),
    "algorithm.value_clip": (0.5, {"algorithm": {"name": "ppo"}}, {"algorithm": {"name": "grpo"}}),
    "algorithm.vf_coef": (1.0, {"algorithm": {"name": "ppo"}}, {"algorithm": {"name": "grpo"}}),
    "trainer.critic_lr": (3e-4, {"algorithm": {"name": "ppo"}}, {"algorithm": {"name": "grpo"}}),
    "algorithm.normalize_adv_std": (False, {"algorithm": {"name": "grpo"}}, {"algorithm": {"name": "ppo"}}),
    "algorithm.proximal_logprobs": ("behaviour", {"trainer": {"updates_per_step": 2}}, {}),
    "task.train_size": (128, {"task": {"name": "copy"}}, {"task": JSONL}),
    "task.min_len": (2, {"task": {"name": "copy"}}, {"task": JSONL}),
    "task.max_len": (4, {"task": {"name": "copy"}}, {"task": JSONL}),
    "task.verifier": ("numeric", {"task": JSONL}, {"task": {"name": "copy"}}),
    "task.prompt_key": ("problem", {"task": DATASET}, {"task": JSONL}),
    "task.answer_key": ("solution", {"task": DATASET}, {"task": JSONL}),
    "task.system_prompt": ("Be brief.", {"task": DATASET}, {"task": {"name": "copy"}}),
    "task.chat_template": (True, {"task": DATASET, "model": {"builtin": None, "path": "m"}}, {"task": DATASET}),
    "rollout.gpu_memory_utilization": (0.8, VLLM, {**VLLM, "resources": {"device": "cpu"}}),
    "rollout.kv_cache_gib": (2.0, VLLM, {}),
    "rollout.max_batch_tokens": (4096, {}, VLLM),
}
# a tracker's settings act only when metrics.reporters asks for it
_MLFLOW, _WANDB = {"metrics": {"reporters": ["mlflow"]}}, {"metrics": {"reporters": ["wandb"]}}
WITH |= {
    "metrics.mlflow_tracking_uri": ("http://mlflow.example:5000", _MLFLOW, _WANDB),
    "metrics.mlflow_experiment": ("rl", _MLFLOW, _WANDB),
    "metrics.wandb_project": ("rl", _WANDB, _MLFLOW),
    "metrics.wandb_mode": ("online", _WANDB, {}),
}
# workload gym: each learner's knobs act with its algorithm only
_GYM = {"workload": "gym", "env": {"id": "CartPole-v1"}}
_PPO, _DQN = {**_GYM, "agent": {"algorithm": "ppo"}}, {**_GYM, "agent": {"algorithm": "dqn"}}
_PPO_VALUES = {"lam": 0.9, "clip": 0.3, "value_clip": 0.5, "entropy_coef": 0.01}
_PPO_VALUES |= {"epochs": 2, "minibatches": 2, "actor_lr": 1e-3, "critic_lr": 3e-4}
_DQN_VALUES = {"lr": 3e-4, "buffer_size": 1000, "batch_size": 32, "learning_starts": 100, "updates_per_step": 4}
_DQN_VALUES |= {"target_update_interval": 10, "tau": 1.0, "epsilon_start": 0.5, "epsilon_end": 0.05}
_DQN_VALUES |= {"epsilon_decay_steps": 1000}
WITH |= {f"agent.{name}": (value, _PPO, _DQN) for name, value in _PPO_VALUES.items()}
WITH |= {f"agent.{name}": (value, _DQN, _PPO) for name, value in _DQN_VALUES.items()}


def _with(base: dict, path: str, value) -> dict:
    data = {section: dict(fields) if isinstance(fields, dict) else fields for section, fields in base.items()}
    section, name = path.split(".")
    data.setdefault(section, {})[name] = value
    return data


def test_every_algorithm_or_task_knob_has_a_case():
    assert set(WITH) == set(ACTS_ONLY_WITH)


@pytest.mark.parametrize("path", sorted(ACTS_ONLY_WITH))
def test_an_algorithm_or_task_knob_is_taken_where_it_acts_and_refused_elsewhere(path):
    value, acts, idle = WITH[path]
    section, name = path.split(".")
    spec = validate_spec(_with(acts, path, value))
    assert getattr(getattr(spec, section), name) == value and spec.resolved()[section][name] == value
    assert _errors(_with(idle, path, value))[path].startswith(f"acts only with {ACTS_ONLY_WITH[path][1]}: leave it at")
    resolved = validate_spec(idle).resolved()  # at its default: accepted, and left out of the record
    assert name not in resolved[section]
    assert validate_spec(resolved).resolved() == resolved


def test_a_plug_in_algorithm_takes_every_algorithm_knob():
    spec = validate_spec({"algorithm": {"name": "my_pkg.algos:make", "gamma": 0.9, "normalize_adv_std": False}})
    assert spec.resolved()["algorithm"]["gamma"] == 0.9 and spec.resolved()["algorithm"]["normalize_adv_std"] is False


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ("rollout.engine=vllm", "rollout.engine: vllm loads a Hugging Face model directory, but model.builtin"),
        ("pipeline.on_lag_exceeded=drop", "pipeline.on_lag_exceeded: acts only in pipeline.mode async, not sync"),
    ],
)
def test_the_cli_exits_with_the_bad_input_code_before_any_work(tmp_path, capsys, override, error):
    code = main(["run", "examples/grpo-sync.yaml", f"output_dir={tmp_path}/out", override])
    assert code == 2
    assert error in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["bucket_boundaries", "num_buckets", "mix_long_short"])
def test_the_static_batch_knobs_are_not_run_spec_knobs(name):
    # read only by Scheduler.plan, which no run path calls: they belong to the Scheduler's arguments
    assert _errors({"rollout": {name: 4}}) == {f"rollout.{name}": "unknown field"}


def test_a_bare_yaml_off_means_off():
    spec = validate_spec({"pipeline": {"mode": "async"}, "rollout": {"length_prediction": False}})
    assert spec.rollout.length_prediction == "off"


def test_defaults_in_any_mode_are_accepted():
    for mode in MODES:
        assert isinstance(validate_spec(_spec(mode)), RunSpec)


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        ({"trainer": {"strategy": "fsdp"}}, "trainer.strategy", "fsdp shards over trainer ranks"),
        (
            {"trainer": {"mixed_precision": "bf16"}, "model": {"dtype": "bfloat16"}},
            "trainer.mixed_precision",
            "bf16 keeps float32 master weights: needs model.dtype float32, not bfloat16",
        ),
        ({"trainer": {"cpu_offload": True}}, "trainer.cpu_offload", "acts only with trainer.strategy fsdp"),
        (
            {"trainer": {"strategy": "fsdp", "cpu_offload": True}, "resources": {"trainer_devices": 2}},
            "trainer.cpu_offload",
            "the trainer already runs in host memory on resources.device cpu",
        ),
    ],
)
def test_training_strategy_combinations_that_cannot_act_are_refused(data, field, message):
    assert _errors(data)[field].startswith(message)


def test_a_bare_yaml_off_is_the_mixed_precision_off():
    spec = load_spec("examples/grpo-sync.yaml", ["trainer.mixed_precision=bf16", "trainer.mixed_precision=off"])
    assert spec.trainer.mixed_precision == "off"
