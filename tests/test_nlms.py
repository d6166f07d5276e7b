"""NLMS against the textbook recursion, on badly scaled system identification, and its invariances."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from inputaware_optim import NLMS, InputAwareSGD


def test_follows_the_textbook_recursion() -> None:
    torch.manual_seed(0)
    d, mu, eps = 5, 0.5, 1e-3
    layer = nn.Linear(d, 1, bias=False).double()
    optimizer = NLMS(layer, lr=mu, damping=eps)
    w = layer.weight.detach().clone().reshape(-1)
    target = torch.randn(d, dtype=torch.float64)
    for _ in range(50):
        x = torch.randn(d, dtype=torch.float64) * 10 ** torch.randint(-2, 3, (1,)).double()
        y = target @ x
        optimizer.zero_grad()
        e = y - layer(x[None]).squeeze()
        (0.5 * e**2).backward()
        optimizer.step()
        w = w + mu * (y - w @ x) * x / (eps + x @ x)  # w <- w + mu e x / (eps + |x|^2)
        torch.testing.assert_close(layer.weight.detach().reshape(-1), w, rtol=1e-12, atol=1e-12)


def identify(optimizer_cls: type, steps: int = 400, lr: float = 0.5) -> float:
    """Relative error of an identified FIR filter from inputs whose scale spans 6 orders of magnitude."""
    generator = torch.Generator().manual_seed(0)
    d = 8
    target = torch.randn(d, generator=generator)
    layer = nn.Linear(d, 1, bias=False)
    nn.init.zeros_(layer.weight)
    optimizer = optimizer_cls(layer, lr=lr)
    scales = 10.0 ** torch.linspace(-3, 3, steps)[torch.randperm(steps, generator=generator)]
    for scale in scales:
        x = torch.randn(1, d, generator=generator) * scale
        optimizer.zero_grad()
        (0.5 * (layer(x).squeeze() - (x @ target)) ** 2).sum().backward()
        optimizer.step()
    error = (layer.weight.detach().reshape(-1) - target).norm() / target.norm()
    return float(error) if torch.isfinite(error) else float("inf")


def test_identifies_a_filter_from_badly_scaled_inputs_where_sgd_fails() -> None:
    assert identify(NLMS) < 1e-6
    assert not identify(InputAwareSGD) < 1.0  # plain SGD at the same step size diverges
    assert identify(InputAwareSGD, lr=1e-7) > 0.1  # and crawls at a step size small enough to be stable


@given(
    scale=st.floats(1e-3, 1e3),
    batch=st.integers(1, 4),
    sequence=st.integers(1, 3),
)
def test_prediction_change_is_invariant_to_input_scale(scale: float, batch: int, sequence: int) -> None:
    """Scaling inputs by c (and weights by 1/c) leaves the predictions after one step unchanged."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, sequence, 3, generator=generator, dtype=torch.float64)
    y = torch.randn(batch, sequence, 2, generator=generator, dtype=torch.float64)
    predictions = []
    for c in (1.0, scale):
        layer = nn.Linear(3, 2, bias=False).double()
        with torch.no_grad():
            layer.weight.copy_(torch.arange(6, dtype=torch.float64).reshape(2, 3) / 10 / c)
        optimizer = NLMS(layer, lr=0.7, damping=0.0)
        (0.5 * (layer(x * c) - y).pow(2).sum()).backward()
        optimizer.step()
        predictions.append(layer(x * c).detach())
    torch.testing.assert_close(predictions[0], predictions[1], rtol=1e-9, atol=1e-9)


def test_normalizes_by_the_mean_power_over_every_call_with_the_bias_coordinate() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    optimizer = NLMS(layer, lr=1.0, damping=0.1)
    xs = [torch.randn(2, 3), torch.randn(4, 3)]
    for x in xs:
        layer(x).sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    before = [p.detach().clone() for p in layer.parameters()]
    rows = torch.cat(xs)
    power = (rows.pow(2).sum(dim=1) + 1).mean()  # |x~|^2 = |x|^2 + 1 with the bias
    optimizer.step()
    for p, b, g in zip(layer.parameters(), before, grads, strict=True):
        torch.testing.assert_close(p.detach(), b - g / (0.1 + power))


def test_bad_damping_and_the_renamed_eps() -> None:
    with pytest.raises(ValueError, match="Invalid damping"):
        NLMS(nn.Linear(2, 2), lr=0.1, damping=-1.0)
    with pytest.raises(TypeError, match="NLMS's eps was renamed damping"):
        NLMS(nn.Linear(2, 2), lr=0.1, eps=1e-6)


def test_a_param_group_with_the_renamed_eps_is_refused_as_the_constructor_refuses_it() -> None:
    # add_param_group kept the group's eps and normalized it by the default damping, with no word.
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    optimizer = NLMS(model, lr=0.1, params=list(model[0].parameters()))
    with pytest.raises(TypeError, match=r"NLMS's eps was renamed damping.*give the group 'damping' instead of 'eps'"):
        optimizer.add_param_group({"params": list(model[1].parameters()), "eps": 0.5})
    assert len(optimizer.param_groups) == 1
    with pytest.raises(TypeError, match=r"NLMS's eps was renamed damping"):
        NLMS(model, lr=0.1, params=[{"params": list(model.parameters()), "eps": 0.5}])
    optimizer.add_param_group({"params": list(model[1].parameters()), "damping": 0.5})
    assert optimizer.param_groups[1]["damping"] == 0.5 and "eps" not in optimizer.param_groups[1]
    beside = NLMS(model, lr=0.1, base=torch.optim.AdamW, params=list(model[0].parameters()))
    beside.add_param_group({"params": list(model[1].parameters()), "eps": 1e-3})  # the base's own eps
    assert beside.param_groups[1]["eps"] == 1e-3 and beside.param_groups[1]["damping"] == 1e-6


@pytest.mark.parametrize("base", [torch.optim.AdamW, torch.optim.Adam, torch.optim.RMSprop])
def test_the_damping_is_its_own_beside_a_base_that_has_an_eps(base: type) -> None:
    # NLMS's regularizer was the group's "eps", which the base's own eps (1e-8) already held: with
    # base=AdamW the normalization used AdamW's eps and ignored NLMS's, silently.
    layer = nn.Linear(3, 1, bias=False)
    reference = copy.deepcopy(layer)
    optimizer = NLMS(layer, lr=0.1, damping=0.5, base=base, eps=1e-3)
    stock = base(reference.parameters(), lr=0.1, eps=1e-3)
    assert optimizer.param_groups[0]["damping"] == 0.5 and optimizer.param_groups[0]["eps"] == 1e-3
    x = torch.full((1, 3), 0.1)
    layer(x).sum().backward()
    reference.weight.grad = layer.weight.grad / (0.5 + x.pow(2).sum())  # the rule's gradient, by hand
    optimizer.step()
    stock.step()
    assert torch.equal(layer.weight, reference.weight)


def test_a_checkpoint_from_before_the_rename_loads_its_eps_as_the_damping() -> None:
    optimizer = NLMS(nn.Linear(2, 2), lr=0.1)
    state = optimizer.state_dict()
    del state["param_groups"][0]["damping"]
    state["param_groups"][0]["eps"] = 0.25
    optimizer.load_state_dict(state)
    assert optimizer.param_groups[0]["damping"] == 0.25 and "eps" not in optimizer.param_groups[0]


def test_a_layer_of_width_zero_takes_the_stock_sgd_step() -> None:
    """Linear(6, 0) and Linear(0, 3) take SGD's step (nothing to normalize), the other layers NLMS's, as if the
    empty layers were not there. Linear(0, 3)'s input rows (width 0) crashed the step in a reshape."""
    from .test_kfac import WithEmptyLayers

    model = WithEmptyLayers().double()
    reference = copy.deepcopy(model)
    optimizer = NLMS(model, lr=0.1, damping=0.1, momentum=0.9)
    ruled = [p for n, p in reference.named_parameters() if n.startswith(("hidden", "head"))]
    empty = [p for n, p in reference.named_parameters() if n.startswith("no_")]
    references = [
        NLMS(reference, lr=0.1, damping=0.1, momentum=0.9, params=ruled),
        torch.optim.SGD(empty, lr=0.1, momentum=0.9),
    ]
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, target = (torch.randn(5, n, generator=generator, dtype=torch.float64) for n in (6, 3))
        for m, optimizers in ((model, [optimizer]), (reference, references)):
            for o in optimizers:
                o.zero_grad()
            nn.functional.mse_loss(m(x), target).backward()
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # nothing to warn about: the stock step is the rule's here
                for o in optimizers:
                    o.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14, msg=name)
    assert not torch.equal(model.no_inputs.bias, WithEmptyLayers().double().no_inputs.bias)  # it did move
    torch.testing.assert_close(
        optimizer.state[model.no_inputs.bias]["momentum_buffer"],
        references[1].state[reference.no_inputs.bias]["momentum_buffer"],
    )


def test_gradient_accumulation_equals_the_concatenated_batch() -> None:
    generator = torch.Generator().manual_seed(3)
    micro = [[torch.randn(4, 5, 3, generator=generator, dtype=torch.float64) for _ in range(3)] for _ in range(3)]
    models = []
    for accumulate in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        optimizer = NLMS(model, lr=0.3, momentum=0.5)
        for step in micro:
            optimizer.zero_grad()
            for x in step if accumulate else [torch.cat(step)]:
                (model(x).pow(2).mean() * len(x) / sum(len(s) for s in step)).backward()
            optimizer.step()
        models.append(model)
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(p, q)
