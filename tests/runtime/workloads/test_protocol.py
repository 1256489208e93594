"""The Workload seam: the LLM workload implements every method the pipeline calls, with the protocol's
parameters; a workload that names no LLM type passes the same check, and one missing a method does not.
The LLM's data source also implements the DataSource protocol, re-issuing stale groups where they were."""

from __future__ import annotations

import inspect
from typing import Any

from runtime.samples import Prompt, Sample
from runtime.workloads.base import DataSource, Workload, workload_for
from runtime.workloads.llm import LLMWorkload, PromptSource
from tests.runtime.helpers import TINY, tiny_spec


def mismatches(obj: Any, protocol: type) -> list[str]:
    """What ``obj`` lacks of ``protocol``: missing members, methods whose parameters differ by name or kind."""
    problems = []
    names = {n for n in vars(protocol) if not n.startswith("_")} | set(getattr(protocol, "__annotations__", {}))
    for name in sorted(names):
        if not hasattr(obj, name):
            problems.append(f"{name}: missing")
            continue
        wanted = vars(protocol).get(name)
        if not inspect.isfunction(wanted):
            continue
        got = getattr(obj, name)
        if not callable(got):
            problems.append(f"{name}: not callable")
            continue
        want_params = [(p.name, p.kind) for p in list(inspect.signature(wanted).parameters.values())[1:]]
        got_params = [(p.name, p.kind) for p in inspect.signature(got).parameters.values()]
        if want_params != got_params:
            problems.append(f"{name}: parameters {got_params}, the protocol's {want_params}")
    return problems


def test_the_llm_workload_implements_the_protocol(tmp_path):
    workload = workload_for(tiny_spec(tmp_path, "proto", TINY))
    assert isinstance(workload, LLMWorkload)
    assert isinstance(workload, Workload)
    assert mismatches(workload, Workload) == []


def test_the_gym_workload_implements_the_protocol():
    from runtime.spec import load_spec
    from runtime.workloads.gym.workload import GymWorkload

    workload = workload_for(load_spec({"workload": "gym", "env": {"id": "CartPole-v1"}}))
    assert isinstance(workload, GymWorkload) and isinstance(workload, Workload)
    assert mismatches(workload, Workload) == []


class _Counting:
    """A workload in name only: no LLM type anywhere, every method a stub."""

    name = "counting"
    eval_metric = "eval/accuracy"
    units_per_s_metric = "throughput/gen_tokens_per_s"
    evaluates_in_process = False

    def build_models(self, spec, device): ...
    def build_trainer(self, spec, models, device, group=None): ...
    def build_task(self, spec): ...
    def build_source(self, task): ...
    def export_policy(self, models, directory): ...
    def consistency_probe(self, spec, device, max_samples): ...
    def inline_generator(self, spec, models, task, device, colocated): ...
    def rollout_instance(self, rank, spec, device, weights, conn, flags, state=None): ...
    def remote_rollout(self, rank, spec, device): ...
    def work_cost(self, spec): ...
    def pack_samples(self, samples): ...
    def unpack_samples(self, packed, version_offset=0): ...
    def eval_engine(self, spec, device, models=None): ...
    def evaluate(self, spec, engine, task): ...


class _NoEvaluation(_Counting):
    evaluate = None  # type: ignore[assignment]


def test_the_check_takes_any_workload_with_every_method_and_refuses_one_without():
    assert isinstance(_Counting(), Workload) and mismatches(_Counting(), Workload) == []
    assert mismatches(_NoEvaluation(), Workload) == ["evaluate: not callable"]

    class Renamed(_Counting):
        def evaluate(self, spec, policy, task): ...

    assert [m.split(" [")[0] for m in mismatches(Renamed(), Workload)] == ["evaluate: parameters"]


def _stale(group: int, prompt_id: int, ids: range) -> list[Sample]:
    return [
        Sample(
            sample_id=i,
            prompt_id=prompt_id,
            group_id=group,
            prompt_ids=[1],
            response_ids=[2],
            logprobs=[0.0],
            versions=[0],
            finish_reason="stop",
        )
        for i in ids
    ]


def test_the_prompt_source_is_a_data_source_and_regenerates_stale_groups_at_their_indices():
    prompts = [Prompt(10 + i, f"p{i}", f"a{i}") for i in range(3)]
    source = PromptSource(prompts)
    assert isinstance(source, DataSource) and mismatches(source, DataSource) == []
    source.next(5)
    source.regenerate(_stale(4, 11, range(8, 10)) + _stale(1, 11, range(2, 4)), min_version=3)
    again = source.next(3)
    assert [(w.index, w.prompt.prompt_id, w.min_version) for w in again] == [(1, 11, 3), (4, 11, 3), (5, 12, 0)]
    assert source.unpack_item(again[0].pack()) == again[0]
