"""runtime.train.optimizer.AdamW: the same updates and state as torch.optim.AdamW, without importing torch._dynamo."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from runtime.train.optimizer import AdamW
from tests.runtime.helpers import ROOT


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _groups(model: torch.nn.Module) -> list[dict]:
    """Two groups with their own learning rate and weight decay."""
    first, second = model[0], model[2]
    return [
        {"params": list(first.parameters()), "lr": 3e-3, "weight_decay": 0.1},
        {"params": list(second.parameters()), "lr": 1e-3, "weight_decay": 0.0},
    ]


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range, seed: int = 1) -> None:
    """Steps of a regression loss; the first layer's bias gets no gradient every third step."""
    for i in steps:
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(seed * 1000 + i))  # step i's batch
        optimizer.zero_grad()
        model(x).pow(2).sum().backward()
        if i % 3 == 0:
            model[0].bias.grad = None
        optimizer.step()


def test_updates_match_torch_adamw_bit_for_bit():
    ours, theirs = _model(), _model()
    opt_ours = AdamW(_groups(ours), betas=(0.8, 0.99), eps=1e-6)
    opt_theirs = torch.optim.AdamW(_groups(theirs), betas=(0.8, 0.99), eps=1e-6)
    _train(ours, opt_ours, range(25))
    _train(theirs, opt_theirs, range(25))
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(p, q)
    assert not torch.equal(ours[0].weight, _model()[0].weight)  # it did train
    # the skipped bias stepped fewer times, exactly as torch counts
    assert opt_ours.state[ours[0].bias]["step"].item() == opt_theirs.state[theirs[0].bias]["step"].item() == 16


@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
def test_state_dicts_move_between_the_two_and_training_continues_identically(direction):
    first_cls, then_cls = (torch.optim.AdamW, AdamW) if direction == "torch_to_ours" else (AdamW, torch.optim.AdamW)
    reference = _model()
    reference_opt = torch.optim.AdamW(_groups(reference))
    _train(reference, reference_opt, range(12))

    model = _model()
    first = first_cls(_groups(model))
    _train(model, first, range(6))
    then = then_cls(_groups(model))
    then.load_state_dict(first.state_dict())
    _train(model, then, range(6, 12))

    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)
    assert then.state_dict()["param_groups"] == reference_opt.state_dict()["param_groups"]


def test_a_closure_is_evaluated_with_gradients_and_its_loss_returned():
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-2)
    x = torch.ones(2, 7)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss

    before = model[2].weight.clone()
    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() > 0
    assert not torch.equal(model[2].weight, before)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"lr": -1.0}, "lr"),
        ({"eps": -1e-8}, "eps"),
        ({"betas": (1.0, 0.9)}, "betas"),
        ({"weight_decay": -0.1}, "weight_decay"),
    ],
)
def test_bad_hyper_parameters_are_refused_by_name(kwargs, names):
    with pytest.raises(ValueError, match=names):
        AdamW(_model().parameters(), **kwargs)


def test_sparse_gradients_are_refused():
    emb = torch.nn.Embedding(4, 3, sparse=True)
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        AdamW(emb.parameters()).step()


def test_building_stepping_scheduling_and_checkpointing_import_no_dynamo():
    """torch.optim.AdamW would import torch._dynamo (about a second of start-up) on its first add_param_group."""
    script = (
        "import sys, torch\n"
        "from runtime.train.optimizer import AdamW\n"
        "m = torch.nn.Linear(3, 2)\n"
        "o = AdamW(m.parameters(), lr=1e-3)\n"
        "s = torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1.0)\n"
        "m(torch.randn(2, 3)).sum().backward()\n"
        "torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)\n"
        "o.step(); s.step(); o.zero_grad(set_to_none=True)\n"
        "o.load_state_dict(o.state_dict())\n"
        "print(sorted(k for k in sys.modules if k.startswith('torch._dynamo')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"
