"""runtime.train.optimizer.AdamW: torch's AdamW on its fused kernel, kept across checkpoints, including checkpoints
written by the runtime's own AdamW before it was retired."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.train.optimizer import AdamW

OLD_CHECKPOINT = Path(__file__).parent / "data" / "adamw_runtime_v1.pt"  # 3 steps of the retired AdamW


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


def _close(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_cpu_parameters_get_the_fused_kernel_and_match_the_multi_tensor_update():
    fused, reference = _model(), _model()
    opt = AdamW(_groups(fused), betas=(0.8, 0.99), eps=1e-6)
    assert opt.fused and all(g["fused"] is True and g["foreach"] is None for g in opt.param_groups)
    ref_opt = torch.optim.AdamW(_groups(reference), betas=(0.8, 0.99), eps=1e-6, foreach=True)
    _train(fused, opt, range(25))
    _train(reference, ref_opt, range(25))
    assert _close(fused, reference) < 1e-6
    assert _close(fused, _model()) > 1e-3  # it did train
    # the skipped bias stepped fewer times, as torch counts
    assert opt.state[fused[0].bias]["step"].item() == ref_opt.state[reference[0].bias]["step"].item() == 16


def test_a_device_without_a_fused_kernel_gets_the_multi_tensor_update():
    param = torch.nn.Parameter(torch.zeros(3, device="meta"))
    opt = AdamW([param])
    assert not opt.fused and opt.param_groups[0]["foreach"] is True and opt.param_groups[0]["fused"] is None


def test_a_state_dict_saved_without_the_fused_flag_resumes_on_the_fused_kernel_and_continues_identically():
    reference = _model()
    reference_opt = AdamW(_groups(reference))
    _train(reference, reference_opt, range(12))

    model = _model()
    first = torch.optim.AdamW(_groups(model))  # fused=None, foreach=None: the flags old checkpoints carry
    _train(model, first, range(6))
    saved = first.state_dict()
    assert all(g["fused"] is None for g in saved["param_groups"])
    then = AdamW(_groups(model))
    then.load_state_dict(saved)
    assert all(g["fused"] is True and g["foreach"] is None for g in then.param_groups)
    _train(model, then, range(6, 12))
    assert _close(model, reference) < 1e-6


def test_a_checkpoint_of_the_retired_runtime_adamw_loads_and_training_goes_on():
    saved = torch.load(OLD_CHECKPOINT, weights_only=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    model.load_state_dict(saved["model"])
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    opt.load_state_dict(saved["optimizer"])
    assert opt.fused and opt.param_groups[0]["fused"] is True
    assert [opt.state[p]["step"].item() for p in model.parameters()] == [3.0, 3.0]

    twin = torch.nn.Linear(4, 3)  # the same state continued on torch's reference single-tensor update
    twin.load_state_dict(saved["model"])
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    twin_opt.load_state_dict(torch.load(OLD_CHECKPOINT, weights_only=True)["optimizer"])  # its own step tensors
    twin_opt.param_groups[0].update(foreach=False, fused=None)
    for m, o in ((model, opt), (twin, twin_opt)):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
        o.zero_grad()
        m(x).pow(2).sum().backward()
        o.step()
    assert opt.state[model.weight]["step"].item() == 4.0
    assert _close(model, twin) < 1e-6
    assert not torch.equal(model.weight, saved["model"]["weight"])


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"lr": -1.0}, "learning rate"),
        ({"eps": -1e-8}, "epsilon"),
        ({"betas": (1.0, 0.9)}, "beta"),
        ({"weight_decay": -0.1}, "weight_decay"),
    ],
)
def test_bad_hyper_parameters_are_refused_by_name(kwargs, names):
    with pytest.raises(ValueError, match=names):
        AdamW(_model().parameters(), **kwargs)


def test_an_empty_parameter_list_is_refused():
    with pytest.raises(ValueError, match="empty parameter list"):
        AdamW([])
