"""PyTorch's own database of optimizer cases (``torch.testing._internal.common_optimizers.optim_db``: every
stock optimizer and its keyword variants, as PyTorch's ``test/test_optim.py`` runs them) on compositions:
``InputAwareSGD(model, base=B, **kwargs)`` is ``B(params, **kwargs)`` step for step, state for state,
through ``state_dict`` round trips and older checkpoints whose ``step`` is a number, with and without a rule
in front (then fed the rule's gradient)."""

from __future__ import annotations

import copy
import importlib
import pickle
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

from inputaware_optim import InputAwareSGD, Inputs, Rule

# PyTorch's database is read in a process of its own: importing torch's testing internals disables
# torch.backends' global flags in the importing process for good (common_utils does, at import), which
# breaks code that sets them later (Opacus's embedding sampler).
_READ = """
import pickle, sys, torch
from torch.testing._internal.common_optimizers import optim_db
cases = [(info.optim_cls.__module__, info.optim_cls.__name__, case.desc, case.kwargs)
         for info in optim_db for case in info.optim_inputs_func(device="cpu") if case.params is None]
sys.stdout.buffer.write(pickle.dumps(cases))
"""


def _cases() -> list[tuple[type, str, dict[str, Any]]]:
    found = subprocess.run([sys.executable, "-c", _READ], capture_output=True, timeout=300)
    if found.returncode != 0:
        if b"No module named 'expecttest'" in found.stderr:
            pytest.skip("torch's optimizer database needs expecttest (the test extra)", allow_module_level=True)
        raise RuntimeError(found.stderr.decode())
    return [(getattr(importlib.import_module(m), n), desc, kwargs) for m, n, desc, kwargs in pickle.loads(found.stdout)]


CASES = _cases()


class Halves(Rule):
    """A rule that changes every gradient (so the base is fed the rule's, not backward's)."""

    def update(self, optimizer: Any, inputs: Inputs) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(0.5)


def _model(base: type) -> nn.Module:
    torch.manual_seed(0)
    if base is torch.optim.SparseAdam:
        return nn.Embedding(10, 3, sparse=True)
    if base.__name__ == "Muon":  # (2-D parameters only)
        return nn.Linear(4, 3, bias=False)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    if isinstance(model, nn.Embedding):
        return model(torch.randint(0, 10, (6,), generator=g)).pow(2).sum()
    return model(torch.randn(5, 4, generator=g)).pow(2).mean()


def _step(model: nn.Module, optimizer: Any, step: int, rule: bool) -> None:
    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = _loss(model, step)
        loss.backward()
        if rule and not isinstance(optimizer, InputAwareSGD):  # the reference is fed what the rule hands on
            with torch.no_grad():
                for p in model.parameters():
                    p.grad.mul_(0.5)
        return loss

    if isinstance(optimizer, torch.optim.LBFGS) or getattr(optimizer, "base", None) is torch.optim.LBFGS:
        optimizer.step(closure)
    else:
        closure()
        optimizer.step()


def _same(ours: Any, theirs: Any, where: str) -> None:
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and ours.keys() == theirs.keys(), where
        for key in theirs:
            _same(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _same(a, b, f"{where}[{i}]")
    elif isinstance(theirs, torch.Tensor):
        assert torch.equal(torch.as_tensor(ours), theirs), where
    else:
        assert ours == theirs, where


def _same_run(model: nn.Module, ours: Any, reference: nn.Module, theirs: Any) -> None:
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)
        _same(ours.state[p], theirs.state[q], "state")


@pytest.mark.parametrize("rule", [False, True], ids=["no rule", "a rule"])
@pytest.mark.parametrize("base, desc, kwargs", CASES, ids=[f"{b.__name__}-{d}" for b, d, _ in CASES])
def test_a_composition_is_its_base_on_pytorchs_cases(base: type, desc: str, kwargs: dict[str, Any], rule: bool) -> None:
    kwargs = copy.deepcopy(kwargs)
    if rule and base is torch.optim.LBFGS:
        pytest.skip("a rule that changes gradients refuses a closure-driven base (tested in test_rules.py)")
    model, reference = _model(base), _model(base)
    try:
        theirs = base(reference.parameters(), **kwargs)
    except Exception as refused:  # the stock class refuses it on this machine: so must we, alike
        with pytest.raises(type(refused)):
            InputAwareSGD(model, base=base, rules=[Halves()] if rule else [], **kwargs)
        return
    ours = InputAwareSGD(model, base=base, rules=[Halves()] if rule else [], **kwargs)
    assert ours.base is base and ours.defaults == theirs.defaults
    for step in range(3):
        _step(model, ours, step, rule)
        _step(reference, theirs, step, rule)
    _same_run(model, ours, reference, theirs)
    saved, stock_saved = ours.state_dict(), theirs.state_dict()
    _same(saved, stock_saved, "state_dict")

    # A fresh pair loads the saved states and goes on alike; so do older checkpoints whose step is a number.
    resumed_model, resumed_reference = copy.deepcopy(model), copy.deepcopy(reference)
    resumed = InputAwareSGD(resumed_model, base=base, rules=[Halves()] if rule else [], **kwargs)
    resumed_stock = base(resumed_reference.parameters(), **kwargs)
    as_numbers = [copy.deepcopy(saved), copy.deepcopy(stock_saved)]
    for entries in (as_numbers[0]["state"], as_numbers[1]["state"]):
        for entry in entries.values():
            if torch.is_tensor(entry.get("step")) and entry["step"].numel() == 1:
                entry["step"] = entry["step"].item()
    resumed.load_state_dict(as_numbers[0])
    resumed_stock.load_state_dict(as_numbers[1])
    for step in range(3, 5):
        _step(resumed_model, resumed, step, rule)
        _step(resumed_reference, resumed_stock, step, rule)
    _same_run(resumed_model, resumed, resumed_reference, resumed_stock)
    assert resumed.param_groups[0].keys() == resumed_stock.param_groups[0].keys()
