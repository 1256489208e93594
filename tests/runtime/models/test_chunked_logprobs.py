"""Chunked log-probabilities and entropy: the values and gradients of the whole-vocabulary reference
(``log_softmax``), chunk boundaries and temperatures included, without its float32 [n, V] tensors."""

from __future__ import annotations

import pytest
import torch

from runtime.models import logprobs as L
from runtime.models.logprobs import chunked_logprobs, logprobs_and_entropy, logprobs_from_logits


def reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """Float64 ``log_softmax`` over the whole vocabulary."""
    logp = torch.log_softmax(logits.double() / (temperature if temperature > 0 else 1.0), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(L, "CHUNK_ELEMENTS", 3 * 37)  # 3 rows a chunk at V=37: 10 rows end mid-chunk


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_values_and_gradients_equal_the_whole_vocabulary_computation(small_chunks, temperature):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(10, 37, generator=gen) * 3).requires_grad_()
    targets = torch.randint(0, 37, (10,), generator=gen)
    w1, w2 = torch.randn(10, generator=gen), torch.randn(10, generator=gen)

    logp, entropy = logprobs_and_entropy(logits, targets, temperature)
    ((logp * w1).sum() + (entropy * w2).sum()).backward()
    got = logits.grad.clone()

    ref = logits.detach().double().requires_grad_()
    ref_logp, ref_entropy = reference(ref, targets, temperature)
    ((ref_logp * w1.double()).sum() + (ref_entropy * w2.double()).sum()).backward()

    assert logp.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logp.double(), ref_logp.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(got.double(), ref.grad, rtol=0, atol=1e-5)


def test_each_output_alone_gets_its_own_gradient(small_chunks):
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(7, 37, generator=gen)
    targets = torch.randint(0, 37, (7,), generator=gen)
    for pick in (0, 1):
        logits = base.clone().requires_grad_()
        logprobs_and_entropy(logits, targets)[pick].sum().backward()
        ref = base.double().requires_grad_()
        reference(ref, targets, 1.0)[pick].sum().backward()
        torch.testing.assert_close(logits.grad.double(), ref.grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_alone_equal_the_whole_vocabulary_computation(small_chunks, temperature):
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(10, 37, generator=gen) * 3).requires_grad_()
    targets = torch.randint(0, 37, (10,), generator=gen)
    logp = chunked_logprobs(logits, targets, temperature)
    logp.sum().backward()
    ref = logits.detach().double().requires_grad_()
    ref_logp = reference(ref, targets, temperature)[0]
    ref_logp.sum().backward()
    torch.testing.assert_close(logp.double(), ref_logp.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(logits.grad.double(), ref.grad, rtol=0, atol=1e-5)


def test_an_entropy_without_gradient_leaves_the_log_prob_gradient_alone():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 11, generator=gen).requires_grad_()
    targets = torch.randint(0, 11, (5,), generator=gen)
    logp, entropy = logprobs_and_entropy(logits, targets, entropy_grad=False)
    assert not entropy.requires_grad and logp.requires_grad
    (logp.sum() + entropy.sum()).backward()
    ref = logits.detach().double().requires_grad_()
    reference(ref, targets, 1.0)[0].sum().backward()
    torch.testing.assert_close(logits.grad.double(), ref.grad, rtol=0, atol=1e-6)


def test_bfloat16_logits_get_a_bfloat16_gradient_of_the_float32_computation():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=gen).bfloat16().requires_grad_()
    targets = torch.randint(0, 50, (6,), generator=gen)
    logp, _ = logprobs_and_entropy(logits, targets)
    logp.sum().backward()
    ref = logits.detach().float().requires_grad_()
    ref_logp = logprobs_from_logits(ref, targets)  # today's path: float32 of the bf16 logits
    ref_logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logp, ref_logp.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(logits.grad.float(), ref.grad.bfloat16().float(), rtol=0, atol=1e-2)


def test_shapes_that_are_not_flat_rows_are_refused():
    for fn in (logprobs_and_entropy, chunked_logprobs):
        with pytest.raises(ValueError, match=r"logits must be \[n, V\] and token_ids \[n\]"):
            fn(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long))
