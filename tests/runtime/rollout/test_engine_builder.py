"""One engine builder (runtime.workloads.llm.models.build_engine) on every path: the inline modes, async and
remote rollout instances, the evaluator and ``python -m runtime eval``. With rollout.engine vllm (vllm
replaced by the test stand-in: it cannot run here) every path builds the adapter and no torch copy of the
policy where the engine is its only user."""

from __future__ import annotations

import pytest
import torch

from runtime import __main__ as cli
from runtime.models import build_policy, save_hf
from runtime.rollout.engine import Engine
from runtime.rollout.vllm_adapter import VLLMEngine
from runtime.spec import load_spec
from runtime.workloads.llm import models as llm_models
from runtime.workloads.llm.instance import RemoteLLMRollout, build_instance
from runtime.workloads.llm.workload import LLMWorkload
from tests.runtime.helpers import TINY, derived
from tests.runtime.rollout import vllm_standin

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    policy, tok = build_policy(load_spec(TINY).model, "cpu", seed=1)
    return str(save_hf(policy, tok, tmp_path_factory.mktemp("hf") / "policy"))


def spec_of(tmp_path, **sections):
    return load_spec({**derived(**sections), "output_dir": str(tmp_path / "run")})


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm_standin.install(monkeypatch)
    return vllm_standin


@pytest.fixture
def no_policy_copy(monkeypatch):
    """Fails the test if the builder builds a torch copy of the policy."""

    def refuse(*args, **kwargs):
        raise AssertionError("a torch copy of the policy was built for a vllm engine")

    monkeypatch.setattr(llm_models, "build_policy", refuse)


def vllm_spec(tmp_path, model_dir, mode="sync", pipeline=None, **more):
    resources = {"device": "cuda", "threads_per_process": 1}
    if mode == "async":
        resources["rollout_devices"] = 1
    return spec_of(
        tmp_path,
        model={"path": model_dir},
        rollout={"engine": "vllm", "max_new_tokens": 6, "max_batch_size": 16},
        pipeline={"mode": mode, "eval_interval": 0, "prompts_per_step": 4, **(pipeline or {})},
        resources=resources,
        **more,
    )


# ---- builtin ----------------------------------------------------------------------------------------------
def test_builtin_inline_sync_engine_has_its_own_copy_of_the_policy(tmp_path):
    spec = spec_of(tmp_path)
    models = llm_models.build_models(spec, CPU)
    worker = LLMWorkload().inline_generator(spec, models, None, CPU, colocated=False)
    assert isinstance(worker.engine, Engine) and worker.engine.model is not models.policy
    assert worker.engine.runner.owns_model  # its own module: one copy of the fused weights


def test_builtin_colocated_with_ddp_shares_the_trainers_module(tmp_path):
    spec = spec_of(tmp_path, pipeline={"mode": "colocated"})
    models = llm_models.build_models(spec, CPU)
    worker = LLMWorkload().inline_generator(spec, models, None, CPU, colocated=True)
    assert spec.engine_shares_policy and worker.engine.model is models.policy
    assert not worker.engine.runner.owns_model  # the trainer's parameters are never aliased


def test_builtin_colocated_with_fsdp_gets_a_module_of_its_own(tmp_path):
    spec = spec_of(
        tmp_path, pipeline={"mode": "colocated"}, trainer={"strategy": "fsdp"}, resources={"trainer_devices": 2}
    )
    models = llm_models.build_models(spec, CPU)
    worker = LLMWorkload().inline_generator(spec, models, None, CPU, colocated=True)
    assert not spec.engine_shares_policy
    assert isinstance(worker.engine, Engine) and worker.engine.model is not models.policy


def test_builtin_on_the_instance_remote_and_evaluator_paths(tmp_path):
    spec = spec_of(tmp_path, pipeline={"mode": "async"})
    for engine in (build_instance(0, spec, CPU, None, None, None).engine, RemoteLLMRollout(0, spec, CPU).engine):
        assert isinstance(engine, Engine) and engine.runner.owns_model
    models = llm_models.build_models(spec, CPU)
    assert LLMWorkload().eval_engine(spec, CPU, models).tokenizer is models.tokenizer
    assert isinstance(LLMWorkload().eval_engine(spec, CPU), Engine)


# ---- vllm -------------------------------------------------------------------------------------------------
def test_vllm_inline_sync_and_colocated_build_the_adapter_and_no_policy_copy(
    tmp_path, model_dir, fake_vllm, no_policy_copy
):
    for mode in ("sync", "colocated"):
        spec = vllm_spec(tmp_path, model_dir, mode)
        models = llm_models.Models(policy=torch.nn.Linear(1, 1), tokenizer=llm_models.engine_tokenizer(spec))
        engine = LLMWorkload().inline_generator(spec, models, None, torch.device("cuda"), mode == "colocated").engine
        assert isinstance(engine, VLLMEngine) and engine.tokenizer is models.tokenizer
        assert engine.llm.kwargs["model"] == model_dir
        assert engine.llm.kwargs["enable_sleep_mode"] is (mode == "colocated")


def test_vllm_on_the_instance_remote_and_evaluator_paths(tmp_path, model_dir, fake_vllm, no_policy_copy):
    spec = vllm_spec(tmp_path, model_dir, "async")
    cuda = torch.device("cuda")
    for engine in (
        build_instance(0, spec, cuda, None, None, None).engine,
        RemoteLLMRollout(0, spec, cuda).engine,
        LLMWorkload().eval_engine(spec, cuda),
    ):
        assert isinstance(engine, VLLMEngine) and engine.llm.kwargs["enable_sleep_mode"] is False
        assert engine.tokenizer.vocab_size == 100  # the model directory's (char) tokenizer


def test_vllm_generates_in_the_trainers_compute_dtype(tmp_path, model_dir, fake_vllm):
    spec = vllm_spec(tmp_path, model_dir, trainer={"mixed_precision": "bf16"})
    assert llm_models.build_engine(None, None, torch.device("cuda"), spec).llm.kwargs["dtype"] == "bfloat16"
    spec = vllm_spec(tmp_path, model_dir)
    assert llm_models.build_engine(None, None, torch.device("cuda"), spec).llm.kwargs["dtype"] == "float32"


def test_vllm_never_takes_a_torch_model(tmp_path, model_dir, fake_vllm):
    spec = vllm_spec(tmp_path, model_dir)
    with pytest.raises(ValueError, match="loads its own weights"):
        llm_models.build_engine(torch.nn.Linear(1, 1), None, torch.device("cuda"), spec)


def test_the_eval_command_builds_its_engine_with_the_builder(tmp_path, monkeypatch):
    """``python -m runtime eval`` on a real one-step run's checkpoint takes its engine from build_engine."""
    from tests.runtime.helpers import ROOT

    small = ["task.eval_size=2", "task.train_size=16", "rollout.max_new_tokens=4", "resources.threads_per_process=1"]
    out_dir = tmp_path / "run"
    argv = ["run", str(ROOT / "examples/grpo-sync.yaml"), f"output_dir={out_dir}", *small, "pipeline.steps=1"]
    argv += ["pipeline.prompts_per_step=2", "algorithm.group_size=2", "metrics.progress_bar=false"]
    assert cli.main(argv) == 0
    built = []
    real = llm_models.build_engine

    def spy(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr("runtime.workloads.llm.build_engine", spy)
    assert cli.main(["eval", "--checkpoint", str(out_dir)]) == 0
    assert len(built) == 1 and isinstance(built[0], Engine)


# ---- colocated with vllm: the inline mode's order --------------------------------------------------------
def test_colocated_vllm_offloads_before_waking_sleeps_before_reloading_and_loads_each_published_state(
    tmp_path, model_dir, fake_vllm
):
    from types import SimpleNamespace

    from runtime.pipeline.inline import InlineMode
    from runtime.train.trainer import Trainer
    from runtime.weights.service import WeightService

    spec = vllm_spec(tmp_path, model_dir, "colocated", pipeline={"offload_optimizer": True})
    models = llm_models.build_models(spec, CPU)
    trainer = Trainer(spec, models.policy, models.tokenizer, CPU)
    weights = WeightService(keep=0)
    weights.initialize(trainer.publish_state())
    ctx = SimpleNamespace(
        spec=spec, workload=LLMWorkload(), models=models, task=None, device=torch.device("cuda"),
        trainer=trainer, weights=weights,
    )  # fmt: skip
    mode = InlineMode(ctx)
    llm = mode.engine.llm
    names = sorted(models.policy.state_dict())
    (initial,) = [c for c in llm.calls if c[0] == "collective_rpc"]
    assert sorted(n for n, _ in initial[2][0]) == names  # the full state, not a shared module

    def watch(method):  # each call logged with whether the optimizer state is offloaded at that moment
        def call(*args, **kwargs):
            llm.calls.append(("offloaded", trainer.optimizer_offloaded))
            return method(*args, **kwargs)

        return call

    llm.sleep, llm.wake_up = watch(llm.sleep), watch(llm.wake_up)
    with mode.generating():
        pass
    assert not trainer.optimizer_offloaded
    trainer.version = 1  # as after a training step
    mode.publish()  # asleep: staged, loaded at the next wake-up
    assert len([c for c in llm.calls if c[0] == "collective_rpc"]) == 1
    with mode.generating():
        pass
    log = [c[:2] for c in llm.calls if c[0] in ("offloaded", "sleep", "wake_up", "collective_rpc")]
    assert log[1:] == [
        ("offloaded", True),
        ("sleep", 1),  # the first phase's end (the engine starts awake and loaded)
        ("offloaded", True),
        ("wake_up", ["weights"]),
        ("collective_rpc", "load_policy_weights"),
        ("offloaded", True),
        ("wake_up", ["kv_cache"]),
        ("offloaded", True),
        ("sleep", 1),
    ]
    assert not trainer.optimizer_offloaded
