"""Rules in front of any torch.optim optimizer (``base=``): bitwise the base fed the rule's gradient."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from inputaware_optim import DPSGD, FOOF, KFAC, NLMS, Eva, InputAwareSGD, Inputs, LazyAdamW

RULES: dict[str, Callable[..., Any]] = {
    "FOOF": lambda m, **kw: FOOF(m, update_every=2, **kw),
    "KFAC": lambda m, **kw: KFAC(m, update_every=2, **kw),
    "NLMS": lambda m, **kw: NLMS(m, **kw),
    "Eva": lambda m, **kw: Eva(m, **kw),
    "DPSGD": lambda m, **kw: DPSGD(m, max_grad_norm=0.5, noise_multiplier=0.0, **kw),
}
BASES: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "AdamW": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "Adam-amsgrad": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.05}),
}


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def batch(step: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(step), dtype=torch.float64)


def backward(model: nn.Module, step: int) -> None:
    model.zero_grad()
    model(batch(step)).pow(2).mean().backward()


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("rule", list(RULES))
def test_a_rule_in_front_of_a_base_is_the_base_fed_the_rules_gradient(rule: str, base: str) -> None:
    stock_class, kwargs = BASES[base]
    model = net()
    reference = copy.deepcopy(model)
    optimizer = RULES[rule](model, base=stock_class, **kwargs)
    stock = stock_class(reference.parameters(), **kwargs)
    for step in range(4):
        backward(model, step)
        backward(reference, step)
        optimizer.step()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert not torch.equal(p.grad, q.grad) or rule == "DPSGD"  # the rule changed the gradient
            q.grad = p.grad.clone()  # what the rule handed the base
        stock.step()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p, q), (rule, base, step)
    ours, theirs = optimizer.state_dict(), stock.state_dict()
    for index, entry in theirs["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(ours["state"][index][key]), torch.as_tensor(value)), key
    assert optimizer.state_dict()["param_groups"][0]["lr"] == kwargs["lr"]


def _uninterrupted_and_first_half(make: Callable[[nn.Module], Any]) -> tuple[nn.Module, nn.Module, Any]:
    """A model trained 4 steps, and another trained the first 2 by the optimizer returned (to be resumed)."""
    model, resumed_model = net(), net()
    uninterrupted = make(model)
    for step in range(4):
        backward(model, step)
        uninterrupted.step()
    first = make(resumed_model)
    for step in range(2):
        backward(resumed_model, step)
        first.step()
    return model, resumed_model, first


@pytest.mark.parametrize("rule", ["FOOF", "Eva", "DPSGD"])
def test_resume_through_a_saved_state_dict_is_bitwise(rule: str) -> None:
    def make(model: nn.Module) -> Any:
        return RULES[rule](model, base=torch.optim.AdamW, lr=0.01)

    model, resumed_model, first = _uninterrupted_and_first_half(make)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = make(resumed_model)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.param_groups is resumed._base.param_groups
    for step in range(2, 4):
        backward(resumed_model, step)
        resumed.step()
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("base", [None, torch.optim.AdamW], ids=["SGD", "AdamW"])
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.filterwarnings("error::inputaware_optim.UncapturedInputsWarning")
def test_resume_through_torch_distributed_checkpoint_is_bitwise(rule: str, base: Any, tmp_path: Any) -> None:
    # torch.distributed.checkpoint (how FSDP2 runs save) initializes a fresh optimizer's state by a
    # step on zero gradients without a backward: DP refused it, the other rules warned that their
    # layers were uncaptured. Its round trip resumes every rule bitwise now.
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    def make(model: nn.Module) -> Any:
        return RULES[rule](model, lr=0.01, **({} if base is None else {"base": base}))

    model, resumed_model, first = _uninterrupted_and_first_half(make)
    dcp.save(get_optimizer_state_dict(resumed_model, first), checkpoint_id=tmp_path)
    resumed_model.zero_grad()  # (as in a new process)
    resumed = make(resumed_model)
    loaded = get_optimizer_state_dict(resumed_model, resumed)
    dcp.load(loaded, checkpoint_id=tmp_path)
    if rule in ("FOOF", "KFAC", "Eva"):  # a fresh optimizer's template has no statistics: they were lost, silently
        with pytest.raises(ValueError, match=r"took 2 steps but holds no layer's statistics.*Nothing was loaded"):
            set_optimizer_state_dict(resumed_model, resumed, loaded)
        weights = copy.deepcopy(resumed_model.state_dict())  # the recipe: one step before the template
        backward(resumed_model, 0)
        resumed.step()
        resumed_model.zero_grad()
        resumed_model.load_state_dict(weights)
        loaded = get_optimizer_state_dict(resumed_model, resumed)
        dcp.load(loaded, checkpoint_id=tmp_path)
    set_optimizer_state_dict(resumed_model, resumed, loaded)
    for step in range(2, 4):
        backward(resumed_model, step)
        resumed.step()
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)


class InputScaledSGD(InputAwareSGD):
    """A custom rule: each Linear's gradient divided by its inputs' mean square (NLMS-like)."""

    def step(self, closure: Any = None, inputs: Inputs | None = None) -> Any:
        assert inputs is not None
        for module in inputs:
            if isinstance(module, nn.Linear) and module.weight.grad is not None:
                power = inputs[module].cat().pow(2).mean()
                module.weight.grad /= power
        return super().step(closure, inputs=inputs)


def test_a_custom_rule_composes_the_same_way() -> None:
    model = net()
    reference = copy.deepcopy(model)
    optimizer = InputScaledSGD(model, lr=0.01, base=torch.optim.Adam)
    stock = torch.optim.Adam(reference.parameters(), lr=0.01)
    for step in range(3):
        backward(model, step)
        backward(reference, step)
        optimizer.step()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            q.grad = p.grad.clone()
        stock.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))
    assert "stock Adam" in str(optimizer.coverage()) or all(not t.fallback for t in optimizer.coverage())


def test_a_scheduler_drives_the_shared_groups() -> None:
    model = net()
    optimizer = FOOF(model, lr=0.1, base=torch.optim.AdamW)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    backward(model, 0)
    optimizer.step()
    scheduler.step()
    assert optimizer._base.param_groups[0]["lr"] == 0.05


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda m: FOOF(m, lr=0.1, base=123), TypeError, "Invalid base"),
        (lambda m: FOOF(m, lr=0.1, base=InputAwareSGD), TypeError, "input-aware itself"),
        (lambda m: FOOF(m, lr=0.1, momentum=0.5, base=torch.optim.AdamW), ValueError, "momentum=0.5"),
        (lambda m: FOOF(m, lr=0.1, base=torch.optim.AdamW, betas=(1.5, 0.9)), ValueError, "beta"),
        (lambda m: LazyAdamW(m, base=torch.optim.Adam), TypeError, "no base optimizer"),
    ],
)
def test_bad_bases_are_refused_by_name(make: Callable[[nn.Module], Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        make(net())
