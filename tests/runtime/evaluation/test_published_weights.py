"""The consistency probe and the async evaluator read the weight service's kept versions in place.

Before, each built a whole policy of its own and copied a version into it. These tests pin that the
metrics stay exactly what that copying implementation gave (the reference functions below are it,
kept here as the yardstick), that no parameter is copied, and that a version the service drops while
it is being read stays readable until the reader lets it go.
"""

from __future__ import annotations

import threading

import pytest
import torch

from runtime.contract import EVAL_ACCURACY
from runtime.evaluation.evaluator import EVAL_REWARD, BackgroundEvaluator, evaluate
from runtime.metrics import consistency_metrics
from runtime.models import build_policy, token_logprobs
from runtime.samples import Sample
from runtime.weights.service import WeightService
from runtime.workloads.llm.models import build_engine, build_models, build_task
from runtime.workloads.llm.probe import ConsistencyProbe, PublishedPolicy
from runtime.workloads.llm.workload import LLMWorkload
from tests.runtime.helpers import tiny_spec

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _service(spec, seeds=(11, 12)) -> WeightService:
    """A weight service keeping two versions whose weights differ (models initialised from other seeds)."""
    service = WeightService(keep=2)
    for i, seed in enumerate(seeds):
        model, _ = build_policy(spec.model, CPU, seed=seed)
        state = {k: v.detach() for k, v in model.state_dict().items()}
        service.initialize(state) if i == 0 else service.publish(state)
    return service


def _samples(vocab: int) -> list[Sample]:
    """Samples of versions 0 and 1; two of version 1 straddle an update to version 2 mid-response."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for i, versions in enumerate([[0, 0, 0], [1, 1, 1, 1], [1, 1, 2, 2, 2], [1, 2], [1, 1, 1]]):
        prompt = torch.randint(4, vocab, (3 + i,), generator=gen).tolist()
        response = torch.randint(4, vocab, (len(versions),), generator=gen).tolist()
        logprobs = (-torch.rand(len(versions), generator=gen) * 5).tolist()
        out.append(Sample(i, i, i, prompt, response, logprobs, versions, "stop"))
    return out


def _copying_probe(spec, samples, service, max_samples):
    """The probe as it was: a policy of its own, the version's weights copied into it, then the same scoring."""
    model, _ = build_policy(spec.model, CPU, seed=spec.seed)
    model.eval().requires_grad_(False)
    usable = [s for s in samples if s.versions and s.version in set(service.versions())]
    version = max(s.version for s in usable)
    picked = [s for s in usable if s.version == version][:max_samples]
    prefix = [next((t for t, v in enumerate(s.versions) if v != version), len(s.versions)) for s in picked]
    with torch.no_grad():
        params = model.state_dict()
        for name, tensor in service.state(version).items():
            params[name].copy_(tensor)
        rows = [s.prompt_ids + s.response_ids[:n] for s, n in zip(picked, prefix, strict=True)]
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        logp = token_logprobs(model, ids, mask, temperature=spec.rollout.temperature or 1.0)
    trainer = [
        logp[i, len(s.prompt_ids) - 1 : len(s.prompt_ids) - 1 + n].tolist()
        for i, (s, n) in enumerate(zip(picked, prefix, strict=True))
    ]
    return consistency_metrics([s.logprobs[:n] for s, n in zip(picked, prefix, strict=True)], trainer)


def _copying_evaluation(spec, service, version):
    """The evaluator as it was: a policy of its own, the version's weights copied into its engine."""
    model, tokenizer = build_policy(spec.model, CPU, seed=spec.seed)
    engine = build_engine(model.eval(), tokenizer, CPU, spec)
    engine.update_weights(service.state(version), version)
    return _eval_outcome(spec, engine)


def _eval_outcome(spec, engine):
    """The workload's evaluation metrics (time left out) and every greedy completion's tokens."""
    task = build_task(spec)
    metrics = LLMWorkload().evaluate(spec, engine, task)
    r = spec.rollout
    sampled = {EVAL_ACCURACY: metrics[EVAL_ACCURACY], EVAL_REWARD: metrics[EVAL_REWARD]}
    # the same prompts through the engine directly: a sharper comparison than an accuracy near 0
    again = evaluate(engine, engine.tokenizer, task, task.eval_prompts(), r.max_new_tokens, r.max_batch_size)
    assert again[EVAL_ACCURACY] == metrics[EVAL_ACCURACY]
    from runtime.rollout.engine import SamplingParams

    params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0.0, stop_ids=(engine.tokenizer.eos_id,))
    ids = [engine.tokenizer.encode_prompt(p.text) for p in task.eval_prompts()]
    tokens = sorted((c.prompt_index, list(c.token_ids)) for c in engine.generate(ids, params))
    return sampled, tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_probe_gives_the_copying_probes_metrics_on_the_same_samples(tmp_path, dtype):
    spec = tiny_spec(tmp_path, "probe", model__dtype=dtype)
    service = _service(spec)
    samples = _samples(vocab=90)
    expected = _copying_probe(spec, samples, service, max_samples=3)
    assert expected and expected != _copying_probe(spec, samples[:1] + samples[2:], service, max_samples=3)

    probe = ConsistencyProbe(spec, CPU, max_samples=3)
    assert probe.measure(samples, service) == expected
    assert probe.measure(samples, service) == expected  # the second time, with the version already read


def test_the_evaluator_gives_the_copying_evaluators_accuracy_and_completions(tmp_path):
    spec = tiny_spec(tmp_path, "evaluate")
    service = _service(spec)
    expected = {v: _copying_evaluation(spec, service, v) for v in (0, 1)}
    assert expected[0][1] != expected[1][1]  # the versions generate differently: the comparison can fail

    models = build_models(spec, CPU)
    for version in (0, 1):
        engine = LLMWorkload().eval_engine(spec, CPU, models)
        engine.update_weights(service.state(version), version)
        assert _eval_outcome(spec, engine) == expected[version]


def test_a_published_policy_binds_the_kept_tensors_without_copying_and_lets_them_go(tmp_path):
    spec = tiny_spec(tmp_path, "bind")
    service = _service(spec)
    policy = PublishedPolicy(spec.model, CPU)
    assert all(p.device.type == "meta" for p in policy.model.parameters())  # nothing allocated before a bind
    kept = service.state(1)
    with policy.bound(kept) as model:
        params = dict(model.named_parameters(remove_duplicate=False))
        assert params and all(params[name].data_ptr() == kept[name].data_ptr() for name in params)
    assert all(p.device.type == "meta" for p in policy.model.parameters())  # the version is not pinned


def test_a_published_policy_names_the_missing_weights(tmp_path):
    spec = tiny_spec(tmp_path, "missing")
    kept = dict(_service(spec).state(1))
    kept.pop("model.norm.weight")
    with pytest.raises(ValueError, match="model.norm.weight"), PublishedPolicy(spec.model, CPU).bound(kept):
        pass


def test_a_version_the_service_drops_during_an_evaluation_is_evaluated_whole(tmp_path):
    spec = tiny_spec(tmp_path, "dropped")
    service = _service(spec)
    expected, _ = _copying_evaluation(spec, service, 0)
    models = build_models(spec, CPU)
    reading, dropped = threading.Event(), threading.Event()

    def run_eval(engine):
        reading.set()  # the version's tensors are bound: now the service lets them go
        dropped.wait()
        return _eval_outcome(spec, engine)[0]

    evaluator = BackgroundEvaluator(lambda: LLMWorkload().eval_engine(spec, CPU, models), run_eval)
    evaluator.submit(step=1, version=0, weights=service.state(0))
    reading.wait()
    newer, _ = build_policy(spec.model, CPU, seed=13)
    for _ in range(2):  # keep=2: version 0 is no longer kept
        service.publish({k: v.detach().clone() for k, v in newer.state_dict().items()})
    assert 0 not in service.versions()
    dropped.set()
    assert evaluator.close(wait=True) == [(1, expected)]
