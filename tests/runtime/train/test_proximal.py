"""``algorithm.proximal_logprobs``: with several updates per step the proximal log-probs of samples made
wholly by the current weights can be the engine's own (no scoring forward); stale samples are still scored,
and the engine-trainer gap is still reported."""

from __future__ import annotations

import copy

import pytest
import torch

from runtime.contract import CONSISTENCY_DIFF_MEAN, CONSISTENCY_KL
from runtime.train.trainer import Trainer
from tests.runtime.train.test_trainer import _on_policy, _params, _policy, _samples, _spec

torch.set_num_threads(1)


def _counting_no_grad_forwards(policy) -> list[int]:
    """Batch sizes of the policy's forwards that run without gradients (scoring passes)."""
    seen: list[int] = []
    policy.register_forward_hook(
        lambda mod, args, kwargs, out: (
            seen.append(kwargs["input_ids"].shape[0]) if not torch.is_grad_enabled() else None
        ),
        with_kwargs=True,
    )
    return seen


def _trainer(mode: str, padded: bool = False):
    policy, tok = _policy()
    layout = ("trainer.layout=padded",) if padded else ()
    spec = _spec("trainer.updates_per_step=2", f"algorithm.proximal_logprobs={mode}", *layout)
    trainer = Trainer(spec, policy, tok, "cpu")
    if padded:  # one forward per micro-batch, one row per sample: the rows scored are the samples scored
        trainer.shared_prefix_allowed = False
    return trainer, policy


def test_fresh_samples_take_the_engines_logprobs_and_train_as_recomputing_does():
    samples = _samples(2, 4)
    results = {}
    for mode in ("recompute", "behaviour"):
        trainer, policy = _trainer(mode)
        batch = _on_policy(trainer, copy.deepcopy(samples))  # the trainer's own scores stand in for the engine's
        scoring = _counting_no_grad_forwards(policy)
        got = trainer.train_step(batch, step=0)
        results[mode] = (_params(policy), scoring, got)
    (recomputed, recompute_forwards, recompute_metrics), (reused, reuse_forwards, reuse_metrics) = (
        results["recompute"],
        results["behaviour"],
    )
    assert recompute_forwards and not reuse_forwards  # the scoring pass is gone
    for name in recomputed:  # the scores were the trainer's own: the same update, to the bit
        assert torch.equal(recomputed[name], reused[name]), name
    # The gap is still measured (in the first update's forwards), here zero: the "engine" was the trainer.
    assert reuse_metrics[CONSISTENCY_DIFF_MEAN] == pytest.approx(0.0, abs=1e-6)
    assert reuse_metrics[CONSISTENCY_KL] == pytest.approx(0.0, abs=1e-6)
    assert recompute_metrics[CONSISTENCY_DIFF_MEAN] == pytest.approx(0.0, abs=1e-6)


def test_stale_samples_are_still_scored():
    trainer, policy = _trainer("behaviour", padded=True)
    trainer.train_step(_on_policy(trainer, _samples(2, 4, seed=1)), step=0)  # the trainer is now at version 1
    fresh = _on_policy(trainer, _samples(1, 4, seed=2, version=1))
    stale = _samples(1, 3, seed=3, version=0)  # made by version 0: their engine log-probs are not proximal
    scoring = _counting_no_grad_forwards(policy)
    got = trainer.train_step(fresh + stale, step=1)
    assert sum(scoring) == 3  # only the stale samples' rows (in one or more micro-batches)
    assert CONSISTENCY_DIFF_MEAN in got  # measured on the fresh ones


def test_a_sample_spanning_a_weight_update_is_stale():
    trainer, policy = _trainer("behaviour", padded=True)
    trainer.version = 2
    mixed = _samples(1, 2, version=2)
    for s in mixed:
        s.versions = [1] + [2] * (len(s.versions) - 1)  # its first token came from version 1
    scoring = _counting_no_grad_forwards(policy)
    trainer.train_step(mixed, step=0)
    assert sum(scoring) == 2


def test_proximal_logprobs_is_refused_where_it_cannot_act():
    from runtime.spec import SpecError, load_spec

    with pytest.raises(SpecError, match="algorithm.proximal_logprobs"):
        load_spec({"algorithm": {"proximal_logprobs": "behaviour"}})  # one update per step
    with pytest.raises(SpecError, match="algorithm.proximal_logprobs"):
        load_spec(
            {
                "algorithm": {"proximal_logprobs": "behaviour", "off_policy": "truncated"},
                "trainer": {"updates_per_step": 2},
            }
        )
