"""What the step reads is read at the step: a layer frozen mid-run is a layer without gradient."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from inputaware_optim import FOOF, KFAC, NLMS, Eva, InputAwareAdamW, LazyAdamW

from .test_step_protocol import Rule

RULES: dict[str, Callable[[nn.Module], Any]] = {
    "InputAwareAdamW": lambda m: InputAwareAdamW(m, lr=0.01),
    "Rule": lambda m: Rule(m, lr=0.05, momentum=0.9),
    "FOOF": lambda m: FOOF(m, lr=0.05, update_every=2),
    "KFAC": lambda m: KFAC(m, lr=0.05, update_every=2),
    "Eva": lambda m: Eva(m, lr=0.05),
    "NLMS": lambda m: NLMS(m, lr=0.05),
    "LazyAdamW": lambda m: LazyAdamW(m, lr=0.01),
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 4)
        self.first = nn.Linear(4, 6)
        self.second = nn.Linear(6, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(self.embed(tokens).mean(1))))


def backward(model: Net, step: int) -> None:
    tokens = torch.randint(0, 10, (5, 3), generator=torch.Generator().manual_seed(step))
    model.zero_grad()
    model(tokens).pow(2).mean().backward()


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("frozen", ["first", "second", "embed"])
def test_a_layer_frozen_mid_run_is_updated_as_one_without_gradient(rule: str, frozen: str) -> None:
    model = Net()
    optimizer = RULES[rule](model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # coverage notes about the embedding, alike in both runs
        for step in range(3):
            backward(model, step)
            optimizer.step()
        reference_model, reference = copy.deepcopy((model, optimizer))
        getattr(model, frozen).requires_grad_(False)  # fine-tuning: frozen after construction
        for step in range(3, 7):
            backward(model, step)
            optimizer.step()
            backward(reference_model, step)
            for p in getattr(reference_model, frozen).parameters():
                p.grad = None  # the same layer, trainable but without a gradient this step
            reference.step()
    for (name, p), q in zip(model.named_parameters(), reference_model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert all(p.grad is None for p in getattr(model, frozen).parameters())


def test_stepping_twice_on_one_backward_says_so_by_name_and_takes_the_stock_step() -> None:
    from inputaware_optim import UncapturedInputsWarning

    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    reference = copy.deepcopy(model)
    optimizer = NLMS(model, lr=0.1)
    stock = torch.optim.SGD(reference.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    model(x).pow(2).mean().backward()
    optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        q.data.copy_(p.data)
        q.grad = p.grad.clone()
    with pytest.warns(UncapturedInputsWarning, match=r"0 \(Linear\).*already stepped with.*Step once per backward"):
        optimizer.step()
    stock.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))


def test_an_error_in_a_readers_hook_code_reaches_the_step_as_its_own_type_from_the_original() -> None:
    from inputaware_optim import InputAwareSGD, Reduction

    class Broken(LookupError):
        pass

    class Faulty(Reduction):
        def forward(self, call: Any) -> Any:
            raise Broken("no such statistic")

    model = nn.Sequential(nn.Linear(4, 3))
    optimizer = InputAwareSGD(model, lr=0.1)
    optimizer.register_inputs_hook(lambda opt, inputs: inputs.reduced(faulty), reads=(faulty := Faulty()))
    model(torch.randn(2, 4)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(Broken, match=r"no such statistic.*reader's code") as raised:
        optimizer.step()
    assert isinstance(raised.value.__cause__, Broken) and raised.value.__cause__.__traceback__ is not None
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_a_post_hook_reading_updates_sees_them_on_a_closure_step() -> None:
    model = nn.Sequential(nn.Linear(4, 3))
    reference = copy.deepcopy(model)
    optimizer = InputAwareAdamW(model, lr=0.1)
    stock = torch.optim.AdamW(reference.parameters(), lr=0.1)
    seen: list[Any] = []
    optimizer.register_inputs_hook(lambda opt, inputs, updates: seen.append(updates), when="post", reads="updates")
    x = torch.randn(5, 4)

    def closure(net: nn.Module, opt: Any) -> Any:
        def run() -> torch.Tensor:
            opt.zero_grad()
            loss = net(x).pow(2).mean()
            loss.backward()
            return loss

        return run

    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step(closure(model, optimizer))
    stock.step(closure(reference, stock))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))
    (updates,) = seen
    for p, b in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(updates[p], p.detach() - b, rtol=0, atol=0)


@pytest.mark.parametrize("keyword", ["max_grad_norm", "noise_multiplier"])
def test_dp_without_a_clip_or_noise_is_refused_by_name(keyword: str) -> None:
    from inputaware_optim import DPSGD

    with pytest.raises(TypeError, match=rf"Invalid {keyword}: None \(must be a number"):
        DPSGD(nn.Linear(2, 2), **{keyword: None})


def test_the_command_line_help_is_plain_text() -> None:
    import subprocess
    import sys

    shown = subprocess.run(
        [sys.executable, "-m", "inputaware_optim", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "plot LOG.jsonl" in shown and "``" not in shown


def test_dp_under_a_gradient_penalty_is_refused_naming_it() -> None:
    from inputaware_optim import DPSGD

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    optimizer = DPSGD(model, lr=0.1, max_grad_norm=1.0, noise_multiplier=0.0)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    out = model(x).sum()
    (penalty,) = torch.autograd.grad(out, x, create_graph=True)
    (out + penalty.pow(2).sum()).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="gradient penalty"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_a_stepped_gradient_zeroed_in_place_and_refilled_uncaptured_is_not_called_stepped_twice() -> None:
    """The "already stepped with" diagnosis names only the gradient the last step released: after a
    ``zero_grad(set_to_none=False)`` and a backward the capture did not see, it is the usual one."""
    from inputaware_optim import UncapturedInputsWarning

    model = nn.Sequential(nn.Linear(4, 3))
    optimizer = NLMS(model, lr=0.1)
    x = torch.randn(5, 4)
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # the same gradient tensor, zeroed in place
    optimizer.zero_grad(set_to_none=False)
    layer = model[0]
    torch.nn.functional.linear(x, layer.weight, layer.bias).pow(2).mean().backward()  # no call of the module
    with pytest.warns(UncapturedInputsWarning) as caught:
        optimizer.step()
    messages = [str(w.message) for w in caught if issubclass(w.category, UncapturedInputsWarning)]
    assert messages and all("holds no captured call" in m for m in messages), messages
