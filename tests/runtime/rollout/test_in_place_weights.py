"""A host rollout instance reads the weight service's shared buffer in place: its engine's parameters (and the
fast runner's fused q/k/v and gate/up matrices) are the buffer's tensors, it generates exactly what an engine
with its own copy of the same weights generates, and a publish reaches it without a copy."""

from __future__ import annotations

import pytest
import torch

from runtime.models import build_policy
from runtime.rollout import sampling_params
from runtime.weights.service import WeightError, WeightService, WeightSubscriber
from runtime.workloads.llm.instance import engine_on_shared_weights
from runtime.workloads.llm.models import build_engine
from tests.runtime.helpers import TINY, tiny_spec

CPU = torch.device("cpu")


def _setup(tmp_path, readers: int = 1, **over):
    spec = tiny_spec(tmp_path, "inplace", TINY, pipeline__mode="async", **over)
    policy, tok = build_policy(spec.model, CPU, seed=spec.seed)
    svc = WeightService(keep=0)
    shared = svc.shared_handle(policy.state_dict(), readers=readers)
    return spec, policy, tok, svc, shared


def _generate(engine, tok, spec, seed: int = 0):
    params = sampling_params(spec.rollout, n=4, stop_ids=tok.stop_ids)
    prompts = [tok.encode_prompt(text) for text in ("abc", "hello", "reverse me")]
    with torch.no_grad():
        out = engine.generate(prompts, params, torch.Generator().manual_seed(seed))
    return [(c.token_ids, c.logprobs) for c in out]


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_the_engine_computes_on_the_buffers_tensors_and_generates_what_a_copy_would(tmp_path):
    spec, policy, tok, _, shared = _setup(tmp_path)
    engine = engine_on_shared_weights(spec, CPU, shared, 0)
    assert engine is not None
    copying = build_engine(None, None, CPU, spec)
    copying.update_weights(dict(policy.state_dict()), 0)

    assert _generate(engine, tok, spec) == _generate(copying, tok, spec)
    buffer = _storages(shared.tensors.values())
    assert _storages(engine.model.parameters()) <= buffer  # no weights of its own
    fused = [t for layer in engine.runner.layers for t in (layer.qkv_w, layer.qkv_b, layer.gate_up_w)]
    assert _storages(fused) <= buffer  # q/k/v and gate/up read as one matrix each, still without a copy


def test_a_publish_reaches_the_engine_at_its_next_step_without_a_copy(tmp_path):
    spec, policy, tok, svc, shared = _setup(tmp_path)
    engine = engine_on_shared_weights(spec, CPU, shared, 0)
    assert engine is not None
    sub = WeightSubscriber(shared)
    before = _generate(engine, tok, spec)

    with torch.no_grad():  # a training step's worth of change (tied parameters stay tied)
        for param in policy.parameters():
            param.add_(0.05 * torch.randn_like(param))
    newer = policy.state_dict()
    svc.publish(newer)
    with sub.reading(0) as version:
        engine.update_weights(None, version)  # what the instance does: the version moves, nothing is copied
        after = _generate(engine, tok, spec)
    copying = build_engine(None, None, CPU, spec)
    copying.update_weights(newer, 1)
    assert engine.version == 1
    assert after == _generate(copying, tok, spec) and after != before


@pytest.mark.parametrize(
    ("why", "over", "readers", "env"),
    [
        ("asked to copy", {}, 1, "copy"),
        ("no reader slot for its rank", {}, 0, ""),
        ("a buffer in another dtype than model.dtype", {"model__dtype": "bfloat16"}, 1, ""),
    ],
)
def test_the_engine_copies_where_it_cannot_read_in_place(tmp_path, monkeypatch, why, over, readers, env):
    spec, policy, _, _, _ = _setup(tmp_path, readers=readers, **over)
    if over:  # the trainer published float32 weights; the engine computes in bfloat16
        shared = WeightService().shared_handle(policy.float().state_dict(), readers=readers)
    else:
        shared = WeightService().shared_handle(policy.state_dict(), readers=readers)
    monkeypatch.setenv("TANDEM_SHARED_WEIGHTS", env)
    assert engine_on_shared_weights(spec, CPU, shared, 0) is None, why


def test_a_bad_shared_weights_setting_is_refused_by_name(tmp_path, monkeypatch):
    spec, _, _, _, shared = _setup(tmp_path)
    monkeypatch.setenv("TANDEM_SHARED_WEIGHTS", "mmap")
    with pytest.raises(WeightError, match="TANDEM_SHARED_WEIGHTS: 'mmap' is not in_place or copy"):
        engine_on_shared_weights(spec, CPU, shared, 0)


def test_a_bad_shared_weights_setting_fails_an_async_run_before_any_instance_starts(tmp_path, monkeypatch):
    from runtime.pipeline import run

    spec = tiny_spec(tmp_path, "bad-mode", TINY, pipeline__mode="async", pipeline__steps=2)
    monkeypatch.setenv("TANDEM_SHARED_WEIGHTS", "mmap")
    with pytest.raises(WeightError, match="TANDEM_SHARED_WEIGHTS: 'mmap' is not in_place or copy"):
        run(spec)
    metrics = tmp_path / "bad-mode" / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    assert not any('"time/step"' in line for line in lines)  # no step ran
