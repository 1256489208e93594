"""Every spec field acts in each mode that accepts it: a tiny run of each pipeline mode records every spec field
read after validation, and each field the mode accepts (MODE_ONLY refuses the rest) must be among them, or in
EXEMPT with why and the test that proves it acts. A new spec field that nothing reads fails here.

Reads count wherever the run reads the spec: the trainer's process, its threads, and (async) the rollout
processes and a workload's evaluator process. Reads while a spec is loaded, validated (every validator of every spec model) or resolved do not:
they check or record a knob, they do not act on it.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel

import runtime.evaluation.process
import runtime.pipeline.instance_pool
from runtime import spec as spec_module
from runtime.evaluation.process import evaluator_process
from runtime.pipeline import run
from runtime.rollout.instance import rollout_process
from runtime.spec import MODE_ONLY, RunSpec, load_spec
from tests.runtime.helpers import TINY, derived, tiny_spec
from tests.runtime.reward_server import RewardServer

MODES = ("sync", "async", "colocated")
ALL = MODES

# Fields accepted but not read by the tiny runs: (the modes, why; where a test proves the field acts).
EXEMPT: dict[str, tuple[tuple[str, ...], str]] = {
    "trainer.cpu_offload": (
        ALL,
        "refused on resources.device cpu, where the trainer already is in host memory; on accelerators fsdp "
        "passes FSDP2's CPUOffloadPolicy (runtime/train/parallel.py, not run on hardware) "
        "(test_spec_knobs.py::test_training_strategy_combinations_that_cannot_act_are_refused)",
    ),
    "trainer.collective_timeout_s": (
        ALL,
        "read by data-parallel trainer ranks only, resources.trainer_devices > 1 "
        "(test_trainer_ranks.py::test_a_dead_rank_fails_the_run_naming_it)",
    ),
    "resources.max_restarts": (
        ALL,
        "read by the platform, which restarts a failed trainer role "
        "(tests/launch/test_launch.py::test_a_crash_restarts_the_trainer_until_the_budget_is_spent)",
    ),
    "resources.preemptible": (
        ALL,
        "read by the platform's preemption "
        "(tests/launch/test_preemption.py::test_runs_not_marked_preemptible_or_of_equal_priority_are_left_alone)",
    ),
    "resources.rollout_restarts": (
        ("async",),
        "read when a rollout process dies "
        "(test_rollout_restart.py::test_a_rollout_process_dying_beyond_its_restart_budget_fails_the_run_with_the_reason)",
    ),
    "pipeline.rollout_listen": (
        ("async",),
        "read only with remote rollout instances or a remote evaluator "
        "(rollout/test_remote.py::test_a_remote_instance_works_beside_a_local_one_and_a_mismatched_one_is_refused)",
    ),
    "pipeline.remote_weight_sync": (
        ("async",),
        "read only with remote rollout instances "
        "(rollout/test_remote.py::test_remote_instances_get_their_weights_by_broadcast_when_asked)",
    ),
    "pipeline.rollout_reconnect_s": (
        ("async",),
        "read by a remote rollout instance or evaluator waiting for its trainer "
        "(rollout/test_remote.py::test_a_failing_trainer_leaves_its_remote_instances_waiting_for_its_restart)",
    ),
}


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _field_paths(model: type[BaseModel] = RunSpec, prefix: str = "") -> dict[type[BaseModel], dict[str, str]]:
    """Each spec model class (sections are walked recursively) -> {its leaf field: dotted path}."""
    found: dict[type[BaseModel], dict[str, str]] = {model: {}}
    for name, info in model.model_fields.items():
        if _is_section(info.annotation):
            inner = _field_paths(info.annotation, f"{prefix}{name}.")
            # the recorder knows a field by its class: one class at two places could not be told apart
            assert not set(inner) & set(found), f"{info.annotation.__name__} is used twice in the spec"
            found.update(inner)
        else:
            found[model][name] = f"{prefix}{name}"
    return found


FIELD_PATHS = _field_paths()
LEAVES = {path for fields in FIELD_PATHS.values() for path in fields.values()}


def _not_acting() -> set[Any]:
    """Code objects whose reads do not count: loading, validating (every validator) and resolving a spec."""
    funcs: list[Any] = [spec_module.load_spec, spec_module.validate_spec, RunSpec.resolved]
    for model in FIELD_PATHS:
        decorators = model.__pydantic_decorators__
        funcs += [d.func for d in (*decorators.field_validators.values(), *decorators.model_validators.values())]
    return {inspect.unwrap(getattr(f, "__func__", f)).__code__ for f in funcs}


NOT_ACTING = _not_acting()


def _recording_getattribute(reads: set[str], sink: Path | None = None) -> Any:
    """A ``__getattribute__`` for the spec models that adds each field read outside NOT_ACTING to ``reads``
    (and, first time, a line to ``sink``: a process killed later keeps what it read)."""
    plain = object.__getattribute__

    def __getattribute__(self: Any, name: str) -> Any:
        value = plain(self, name)
        path = FIELD_PATHS.get(type(self), {}).get(name)
        if path is None or path in reads:
            return value
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code in NOT_ACTING:
                return value
            frame = frame.f_back
        reads.add(path)
        if sink is not None:
            with sink.open("a") as fh:
                fh.write(path + "\n")
        return value

    return __getattribute__


# The processes a run spawns that read the spec: async rollout instances and a workload's evaluator process.
_CHILDREN = {"rollout": rollout_process, "evaluator": evaluator_process}


class _RecordingProcess:
    """A spawned child's entry point (``_CHILDREN[kind]``), recording the fields it reads into
    ``sink/<pid>.reads`` (pickled by reference, so this class lives at module level)."""

    def __init__(self, sink: Path, kind: str):
        self.sink, self.kind = sink, kind

    def __call__(self, *args: Any) -> None:
        reads: set[str] = set()
        spec_module._Section.__getattribute__ = _recording_getattribute(reads, self.sink / f"{os.getpid()}.reads")
        _CHILDREN[self.kind](*args)


class Recorded:
    """The fields read from now on: by this process (``here``), by the processes it spawns."""

    def __init__(self, here: set[str], sink: Path):
        self.here, self.sink = here, sink

    def in_child_processes(self) -> set[str]:
        return {line for f in self.sink.glob("*.reads") for line in f.read_text().split()}

    def everywhere(self) -> set[str]:
        return self.here | self.in_child_processes()


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    reads: set[str] = set()
    monkeypatch.setattr(spec_module._Section, "__getattribute__", _recording_getattribute(reads))
    sink = tmp_path / "child-reads"
    sink.mkdir()
    monkeypatch.setattr(runtime.pipeline.instance_pool, "rollout_process", _RecordingProcess(sink, "rollout"))
    monkeypatch.setattr(runtime.evaluation.process, "evaluator_process", _RecordingProcess(sink, "evaluator"))
    return Recorded(reads, sink)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny model saved as a Hugging Face directory, and train / eval JSONL files."""
    from runtime.models import build_policy, save_hf

    root = tmp_path_factory.mktemp("files")
    model, tokenizer = build_policy(load_spec(TINY).model, "cpu", seed=0)
    save_hf(model, tokenizer, root / "model")
    for name, words in (("train", ["ab", "abc", "ba", "cab", "bca", "ca"]), ("eval", ["ac", "cb"])):
        rows = [json.dumps({"prompt": w, "answer": w[::-1]}) for w in words]
        (root / f"{name}.jsonl").write_text("\n".join(rows) + "\n")
    sums = [json.dumps({"q": f"{a}+{b}=", "a": f"#### {a + b}"}) for a in range(3) for b in range(3)]
    (root / "sums.jsonl").write_text("\n".join(sums) + "\n")
    return root


@pytest.fixture(scope="module")
def reward_url():
    server = RewardServer()
    yield server.url
    server.close()


def _tiny_runs(mode: str, tmp_path: Path, files: Path, reward_url: str) -> list[RunSpec]:
    """Three tiny runs of ``mode`` that between them take every path a spec can choose without extra
    processes: GRPO on a built-in model and task; PPO on a model directory, a JSONL task and a reward service
    (these two evaluate and checkpoint every step, keeping the best); GRPO on the dataset task."""
    every_step = {
        "pipeline__mode": mode,
        "pipeline__steps": 2,
        "pipeline__eval_interval": 1,
        "checkpoint__interval": 1,
        "checkpoint__keep_best_metric": "eval/accuracy",
    }
    from_files = derived(
        model={"builtin": None, "path": str(files / "model"), "tokenizer": "auto"},
        algorithm={"name": "ppo"},
        reward={"url": reward_url},
    )
    # the whole section: a built-in task's sizes do not act on a jsonl one (runtime.spec.ACTS_ONLY_WITH)
    from_files["task"] = {"name": "jsonl", "path": str(files / "train.jsonl"), "eval_path": str(files / "eval.jsonl")}
    # the dataset task's knobs (task.chat_template acts with a model directory's tokenizer; this one is the
    # character tokenizer, so the run reads it at its default)
    from_dataset = derived(model={"builtin": None, "path": str(files / "model"), "tokenizer": "auto"})
    from_dataset["task"] = {"name": "dataset", "path": str(files / "sums.jsonl"), "prompt_key": "q", "answer_key": "a"}
    llm = [
        tiny_spec(tmp_path, "builtin", **every_step),
        tiny_spec(tmp_path, "files", from_files, **every_step),
        tiny_spec(tmp_path, "dataset", from_dataset, pipeline__mode=mode, pipeline__steps=1),
    ]
    return llm + _gym_runs(tmp_path, mode)


def _gym_runs(tmp_path: Path, mode: str) -> list[RunSpec]:
    """Two tiny gym runs, PPO and DQN (each reads its own agent knobs), evaluating and checkpointing every step."""
    specs = []
    sampling = {"resources": {"rollout_workers": 1}} if mode == "async" else {}
    for algorithm, extra in (("ppo", {"value_clip": 0.2}), ("dqn", {"learning_starts": 16, "updates_per_step": 2})):
        data = {
            "name": f"gym-{algorithm}",
            "workload": "gym",
            "output_dir": str(tmp_path / f"gym-{algorithm}"),
            "env": {"id": "CartPole-v1", "num_envs": 2, "segment_length": 8, "eval_episodes": 1},
            "agent": {"algorithm": algorithm, **extra},
            "pipeline": {"mode": mode, "steps": 2, "eval_interval": 1},
            "checkpoint": {"interval": 1, "keep_best_metric": "eval/return_mean"},
            **sampling,
        }
        specs.append(load_spec(data))
    return specs


def test_the_recorder_sees_run_reads_and_not_loading_validation_or_resolution(recorded, tmp_path):
    spec = tiny_spec(tmp_path, "probe", pipeline__mode="async")
    spec.resolved()
    spec.model_dump()
    spec.model_copy(deep=True)
    assert recorded.everywhere() == set()
    assert spec.trainer.lr and spec.samples_per_step  # a property reads for its caller
    assert recorded.everywhere() == {"trainer.lr", "workload", "pipeline.prompts_per_step", "algorithm.group_size"}


def test_the_exempt_fields_are_spec_fields_each_with_a_reason():
    for path, (modes, why) in EXEMPT.items():
        assert path in LEAVES, path
        assert modes and set(modes) <= set(MODES) and why, path
        assert all(mode in MODE_ONLY.get(path, MODES) for mode in modes), f"{path} is refused there: not exempt"


@pytest.mark.parametrize("mode", MODES)
def test_every_field_a_mode_accepts_is_read_on_its_run_path(mode, recorded, tmp_path, files, reward_url):
    torch.set_num_threads(1)
    specs = _tiny_runs(mode, tmp_path, files, reward_url)
    for spec in specs:
        run(spec)
    if mode == "async":  # the rollout processes sample: their reads are recorded too
        assert "rollout.top_p" in recorded.in_child_processes()
    read = recorded.everywhere()
    # what acts in one of the runs (the mode's knobs; the algorithm's and task's of that run)
    accepted = {path for path in LEAVES for spec in specs if spec.acts(path)}
    exempt = {path for path, (modes, _) in EXEMPT.items() if mode in modes}
    assert sorted(accepted - exempt - read) == [], (
        f"accepted in pipeline.mode {mode} but never read: refuse it there (runtime.spec.MODE_ONLY, ACTS_ONLY_WITH) or wire it"
    )
    assert sorted(exempt & read) == [], f"read in pipeline.mode {mode}: take it out of EXEMPT"
