"""The capture's rule where passes do not simply accumulate into ``.grad``: gradients returned by
``torch.autograd.grad``, gradient penalties, input-gradient passes, and in-place changes of a
gradient that is all zeros. Each against a rule written out by hand, or stock ``torch.optim``."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from inputaware_optim import FOOF, KFAC, NLMS, UncapturedInputsWarning

from .references import backward_with_inputs, preconditioned_sgd_step, with_ones
from .test_capture import Recorder

LR, DAMPING, DECAY, EPS = 0.1, 0.3, 0.8, 0.5


def net(activation: type[nn.Module] = nn.Tanh) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), activation(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2)).double()


def layers_of(model: nn.Sequential) -> list[nn.Linear]:
    return [m for m in model if isinstance(m, nn.Linear)]


def batch(step: int, size: int = 6) -> torch.Tensor:
    return torch.randn(size, 4, generator=torch.Generator().manual_seed(step), dtype=torch.float64)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def penalized_loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A gradient penalty (WGAN-GP, R1): the loss plus the squared norm of its input gradient."""
    x = x.clone().requires_grad_()
    loss = loss_of(model, x)
    (input_grad,) = torch.autograd.grad(loss, x, create_graph=True)
    return loss + input_grad.pow(2).sum()


def parameter_penalized_loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A penalty on the parameters' gradient (gradient-norm regularization)."""
    loss = loss_of(model, x)
    grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    return loss + sum(g.pow(2).sum() for g in grads)


PENALTIES = {"input": penalized_loss_of, "parameters": parameter_penalized_loss_of}


def make(rule: str, model: nn.Module) -> Any:
    if rule == "FOOF":
        return FOOF(model, lr=LR, momentum=0.0, damping=DAMPING, stat_decay=DECAY, update_every=1)
    return NLMS(model, lr=LR, damping=EPS)


class ByHand:
    """FOOF (no momentum) and NLMS written out: the rule's step from the inputs each layer saw."""

    def __init__(self, rule: str, model: nn.Sequential) -> None:
        self.rule, self.model, self.layers = rule, model, layers_of(model)
        self.moments: dict[nn.Module, torch.Tensor] = {}

    def step(self, loss_of: Callable[[nn.Module], torch.Tensor], between: Callable[[], None] = lambda: None) -> None:
        inputs = backward_with_inputs(self.model, self.layers, loss_of)
        between()  # (what the user does between backward and step: clipping)
        for layer in self.layers:
            rows = with_ones(inputs[layer].detach())
            if self.rule == "FOOF":
                moment = rows.T @ rows / len(rows)
                if layer in self.moments:
                    moment = DECAY * self.moments[layer] + (1 - DECAY) * moment
                self.moments[layer] = moment
                preconditioned_sgd_step(layer, torch.linalg.inv(moment + DAMPING * torch.eye(len(moment))), LR)
            else:  # NLMS: the gradient over the mean input power, then SGD
                scale = 1.0 / (EPS + rows.pow(2).sum() / len(rows))
                with torch.no_grad():
                    for param in (layer.weight, layer.bias):
                        param -= LR * scale * param.grad


def assert_same(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-7, atol=1e-9, msg=name)  # (inv against Cholesky)


# -- item: gradients from torch.autograd.grad, assigned to .grad (custom training loops) ----------


@pytest.mark.parametrize("rule", ["FOOF", "NLMS"])
def test_gradients_from_autograd_grad_assigned_to_grad_take_the_rules_step(rule: str) -> None:
    model = net()
    reference = ByHand(rule, copy.deepcopy(model))
    optimizer = make(rule, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncapturedInputsWarning)
        for step in range(3):
            grads = torch.autograd.grad(loss_of(model, batch(step)), list(model.parameters()))
            for param, grad in zip(model.parameters(), grads, strict=True):
                param.grad = grad  # the very tensors autograd returned: their calls' gradient
            optimizer.step()
            reference.step(lambda m, step=step: loss_of(m, batch(step)))
            assert_same(model, reference.model)


def test_a_rule_reading_raw_calls_gets_the_calls_of_gradients_autograd_grad_returned() -> None:
    # The headline API (a step override reading inputs.items()) in a loop that assigns what
    # torch.autograd.grad returned: each layer's calls are those of the pass that made its gradient.
    model = net()
    optimizer = Recorder(model, lr=LR)
    linears = layers_of(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncapturedInputsWarning)
        for step in range(2):
            x = batch(step)
            expected = {linears[0]: x, linears[1]: torch.tanh(linears[0](x)).detach()}
            unused = torch.autograd.grad(loss_of(model, batch(50 + step)), list(model.parameters()))
            grads = torch.autograd.grad(loss_of(model, x), list(model.parameters()))
            for param, grad in zip(model.parameters(), grads, strict=True):
                param.grad = grad
            optimizer.step()
            del unused
            assert set(optimizer.log) == set(linears)
            for layer, want in expected.items():
                (got,) = optimizer.log[layer]
                assert torch.equal(got, want)
            optimizer.zero_grad()


def test_returned_gradients_are_followed_in_any_order_and_accumulate_with_backward() -> None:
    model = net()
    reference = ByHand("FOOF", copy.deepcopy(model))
    optimizer = make("FOOF", model)
    params = list(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncapturedInputsWarning)
        for step in range(2):
            first = torch.autograd.grad(loss_of(model, batch(step)) / 2, params)
            unused = torch.autograd.grad(loss_of(model, batch(50 + step)), params)  # never assigned
            optimizer.zero_grad()  # between the pass and the assignment: the returned tensors are not in .grad
            for param, grad in zip(params, first, strict=True):
                param.grad = grad
            (loss_of(model, batch(step)) / 2).backward()  # accumulates into the assigned gradients
            optimizer.step()
            del unused
            reference.step(lambda m, step=step: loss_of(m, batch(step)))
            assert_same(model, reference.model)
    assert not optimizer.capture._log.ledger.returned  # nothing kept for tensors that died


@pytest.mark.parametrize("rule", [FOOF, KFAC, NLMS])
def test_a_gradient_set_by_hand_falls_back_to_sgd_with_a_warning_at_every_step(rule: type) -> None:
    model = net()
    stock_model = copy.deepcopy(model)
    optimizer = rule(model, lr=LR)
    stock = torch.optim.SGD(stock_model.parameters(), lr=LR, momentum=optimizer.param_groups[0]["momentum"])
    for step in range(3):
        grads = torch.autograd.grad(loss_of(model, batch(step)), list(model.parameters()))
        for param, grad in zip(model.parameters(), grads, strict=True):
            param.grad = grad.clone()  # not the returned tensor: whose calls it holds is unknown
        with pytest.warns(UncapturedInputsWarning, match=r"set by hand"):
            optimizer.step()
        stock.zero_grad()
        loss_of(stock_model, batch(step)).backward()
        stock.step()
        assert_same(model, stock_model)


# -- item: clip_grad_norm_ with a layer whose gradient is all zeros (dead ReLUs) -----------------


def dead_net() -> nn.Sequential:
    """The first layer's ReLUs are all dead: its gradient and the second layer's weight gradient are
    exactly zero (no input reaches it), while the second layer's bias and the third layer train."""
    model = net(nn.ReLU)
    with torch.no_grad():
        model[0].bias.fill_(-100.0)
    return model


@pytest.mark.parametrize("rule", ["FOOF", "NLMS"])
def test_clipping_a_zero_gradient_keeps_its_calls(rule: str) -> None:
    model = dead_net()
    reference = ByHand(rule, copy.deepcopy(model))
    optimizer = make(rule, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncapturedInputsWarning)
        for step in range(3):
            optimizer.zero_grad()
            loss_of(model, batch(step)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            optimizer.step()
            reference.step(
                lambda m, step=step: loss_of(m, batch(step)),
                lambda: torch.nn.utils.clip_grad_norm_(reference.model.parameters(), 0.05),
            )
            assert_same(model, reference.model)
    if rule == "FOOF":  # the statistics of the dead layers too: their inputs were seen
        for layer in layers_of(model):
            expected = reference.moments[layers_of(reference.model)[layers_of(model).index(layer)]]
            torch.testing.assert_close(optimizer.rules[0].state[layer.weight]["input_second_moment"], expected)


@pytest.mark.parametrize("set_to_none", [False, True])
def test_a_zero_gradient_cleared_in_place_drops_its_calls(set_to_none: bool) -> None:
    model = dead_net()
    reference = ByHand("FOOF", copy.deepcopy(model))
    optimizer = make("FOOF", model)
    for step in range(3):
        loss_of(model, batch(100 + step)).backward()  # a stale backward...
        model.zero_grad(set_to_none=set_to_none)  # ...cleared by the model, in place or not
        loss_of(model, batch(step)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        reference.step(
            lambda m, step=step: loss_of(m, batch(step)),
            lambda: torch.nn.utils.clip_grad_norm_(reference.model.parameters(), 0.05),
        )
        assert_same(model, reference.model)
    for layer, twin in zip(layers_of(model), layers_of(reference.model), strict=True):
        torch.testing.assert_close(
            optimizer.rules[0].state[layer.weight]["input_second_moment"], reference.moments[twin]
        )


# -- item: a training backward, then a pass that does not reach .grad ------------------------------


@pytest.mark.parametrize("create_graph", [False, True])
def test_an_input_gradient_pass_after_backward_is_not_the_steps(create_graph: bool) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    optimizer = Recorder(model, lr=0.0)
    model(torch.randn(5, 3)).sum().backward()
    x = torch.randn(2, 3, requires_grad=True)
    saliency = torch.autograd.grad(model(x).sum(), x, create_graph=create_graph)  # reaches no .grad
    optimizer.step()  # (with create_graph, its calls still wait in the graph saliency holds)
    del saliency
    assert [len(c) for c in optimizer.log[model[0]]] == [5]
    assert [len(c) for c in optimizer.log[model[2]]] == [5]


@pytest.mark.parametrize("rule", ["FOOF", "NLMS"])
def test_an_input_gradient_pass_after_backward_leaves_the_rules_step_alone(rule: str) -> None:
    model = net()
    reference = ByHand(rule, copy.deepcopy(model))
    optimizer = make(rule, model)
    for step in range(2):
        optimizer.zero_grad()
        loss_of(model, batch(step)).backward()
        x = batch(70 + step, size=2).requires_grad_()
        torch.autograd.grad(loss_of(model, x), x)  # saliency of a validation batch
        optimizer.step()
        reference.step(lambda m, step=step: loss_of(m, batch(step)))
        assert_same(model, reference.model)


# -- item: gradient penalties (torch.autograd.grad(create_graph=True), then backward) -------------


@pytest.mark.parametrize("penalty", list(PENALTIES))
@pytest.mark.parametrize("rule", ["FOOF", "NLMS"])
def test_a_gradient_penalty_takes_the_rules_step(rule: str, penalty: str) -> None:
    penalized_loss_of = PENALTIES[penalty]
    model = net()
    reference = ByHand(rule, copy.deepcopy(model))
    optimizer = make(rule, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncapturedInputsWarning)
        for step in range(3):
            optimizer.zero_grad()
            penalized_loss_of(model, batch(step)).backward()
            optimizer.step()
            reference.step(lambda m, step=step: penalized_loss_of(m, batch(step)))
            assert_same(model, reference.model)


def test_a_gradient_penalty_delivers_each_call_once() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    optimizer = Recorder(model, lr=0.1)
    for size in (2, 5):  # two micro-batches, each with its penalty
        x = torch.randn(size, 3, requires_grad=True)
        loss = model(x).pow(2).sum()
        (input_grad,) = torch.autograd.grad(loss, x, create_graph=True)
        (loss + input_grad.pow(2).sum()).backward()
    optimizer.step()
    assert [len(c) for c in optimizer.log[model[0]]] == [2, 5]
    assert [len(c) for c in optimizer.log[model[2]]] == [2, 5]


def test_kfac_factors_under_a_gradient_penalty_are_those_of_the_penalized_loss() -> None:
    model = net()
    reference = copy.deepcopy(model)
    optimizer = KFAC(model, lr=LR, update_every=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncapturedInputsWarning)
        optimizer.zero_grad()
        penalized_loss_of(model, batch(0)).backward()
        optimizer.step()
    # By hand: each layer's input and the gradient of the penalized loss at its output (autograd.grad,
    # not retain_grad, which also sums the penalty's own input-gradient pass into .grad).
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    handles = [m.register_forward_hook(lambda m, a, y: calls.append((a[0], y))) for m in layers_of(reference)]
    total = penalized_loss_of(reference, batch(0))
    for handle in handles:
        handle.remove()
    grads = torch.autograd.grad(total, [y for _, y in calls])
    for layer, (x, _), g in zip(layers_of(model), calls, grads, strict=True):
        rows = with_ones(x.detach())
        state = optimizer.rules[0].state[layer.weight]
        torch.testing.assert_close(state["input_second_moment"], rows.T @ rows / len(rows))
        # G = E[Ds Ds^T] with Ds = B g (a loss averaged over the batch B): B g^T g
        torch.testing.assert_close(state["output_grad_second_moment"], len(g) * g.T @ g)
