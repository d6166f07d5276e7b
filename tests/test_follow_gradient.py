"""Captures follow the gradient: a step reads the calls whose gradient is in ``.grad``, and
nothing is held that nobody reads."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

from inputaware_optim import DPSGD, FOOF, KFAC, NLMS, InputAwareAdamW, InputAwareSGD, LazyAdamW

from .test_capture import Recorder


class Net(nn.Module):
    """An embedding (for LazyAdamW) and two linear layers (for the Kronecker rules, NLMS, DP)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(30, 6)
        self.hidden = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(tokens).mean(1))))


RULES: dict[str, Callable[[nn.Module], Any]] = {
    "FOOF": lambda m: FOOF(m, lr=0.1, update_every=1),
    "KFAC": lambda m: KFAC(m, lr=0.1, update_every=1),
    "NLMS": lambda m: NLMS(m, lr=0.1),
    "LazyAdamW": lambda m: LazyAdamW(m, lr=0.05),
    "DPSGD": lambda m: DPSGD(m, lr=0.5, max_grad_norm=0.3, noise_multiplier=0.0),
}
EVIDENCE = {  # what shows the rule acted (state only it creates, on a layer it covers)
    "FOOF": ("hidden", "input_second_moment"),
    "KFAC": ("hidden", "output_grad_second_moment"),
}


def batch(step: int, size: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randint(0, 12, (size, 4), generator=generator), torch.randn(size, 3, generator=generator).double()


def loss_of(model: nn.Module, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (model(tokens) - target).pow(2).sum(1).mean()


def plain(model: nn.Module, optimizer: Any, step: int) -> None:
    optimizer.zero_grad()
    loss_of(model, *batch(step)).backward()
    optimizer.step()


def tutorial(model: nn.Module, optimizer: Any, step: int) -> None:
    loss = loss_of(model, *batch(step))  # the forward before zero_grad()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def lightning(model: nn.Module, optimizer: Any, step: int) -> None:
    def closure() -> torch.Tensor:  # Lightning's order: training_step, zero_grad, backward
        loss = loss_of(model, *batch(step))
        optimizer.zero_grad()
        loss.backward()
        return loss

    optimizer.step(closure)


def with_eval_forward(model: nn.Module, optimizer: Any, step: int) -> None:
    optimizer.zero_grad()
    loss_of(model, *batch(step)).backward()
    loss_of(model, *batch(100 + step, size=7))  # validation with grad enabled, never backpropagated
    optimizer.step()


def with_model_zero_grad(model: nn.Module, optimizer: Any, step: int) -> None:
    loss_of(model, *batch(200 + step)).backward()  # a stale backward, cleared by the model
    model.zero_grad(set_to_none=step % 2 == 0)
    loss_of(model, *batch(step)).backward()
    optimizer.step()


ORDERS = [tutorial, lightning, with_eval_forward, with_model_zero_grad]


def trained(rule: str, order: Callable[..., None], steps: int = 3) -> tuple[nn.Module, Any]:
    model = Net().double()
    optimizer = RULES[rule](model)
    for step in range(steps):
        order(model, optimizer, step)
    return model, optimizer


@pytest.mark.parametrize("order", ORDERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("rule", list(RULES))
def test_every_order_gives_the_plain_update(rule: str, order: Callable[..., None]) -> None:
    reference, _ = trained(rule, plain)
    model, optimizer = trained(rule, order)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12, msg=f"{rule}, {order.__name__}: {name}")
    # ...and the plain update is the rule's, not the stock one.
    if rule in EVIDENCE:
        layer, key = EVIDENCE[rule]
        assert key in optimizer.rules[0].state[getattr(model, layer).weight]
    stock_model = Net().double()
    stock = torch.optim.SGD(stock_model.parameters(), lr=0.1) if rule != "LazyAdamW" else None
    if stock is not None:
        for step in range(3):
            plain(stock_model, stock, step)
        assert not torch.allclose(model.hidden.weight, stock_model.hidden.weight)
    else:  # LazyAdamW: the rows no batch touched never moved
        untouched = model.embed.weight[12:]
        torch.testing.assert_close(untouched, Net().double().embed.weight[12:], rtol=0, atol=0)


@given(
    operations=st.lists(
        st.sampled_from(["forward", "backward", "zero_grad", "model.zero_grad", "zero_in_place", "clip"]),
        min_size=1,
        max_size=12,
    )
)
def test_a_step_reads_exactly_the_calls_whose_gradient_is_held(operations: list[str]) -> None:
    """A model of the rule, against any sequence of forwards, backwards and clearings."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    optimizer = Recorder(model, lr=0.0)
    pending: list[tuple[torch.Tensor, int]] = []  # losses not yet backpropagated, with their batch size
    expected: list[int] = []  # the batch sizes of the calls in the gradient, in capture order
    for index, operation in enumerate(operations):
        if operation == "forward":
            size = index + 1
            pending.append((model(torch.randn(size, 3)).pow(2).sum(), size))
        elif operation == "backward" and pending:
            loss, size = pending.pop(0)
            loss.backward()
            expected = sorted([*expected, size])
        elif operation == "zero_grad":
            optimizer.zero_grad()
            expected = []
        elif operation == "model.zero_grad":
            model.zero_grad()
            expected = []
        elif operation == "zero_in_place":
            if all(p.grad is not None for p in model.parameters()):
                optimizer.zero_grad(set_to_none=False)
                expected = []
        elif operation == "clip":  # rescales the gradient in place: it still holds the same calls
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    optimizer.step()
    assert sizes(optimizer, model[0]) == expected
    assert sizes(optimizer, model[2]) == expected


def sizes(recorder: Recorder, module: nn.Module) -> list[int]:
    """The batch sizes of the calls of ``module`` the recorder's last step read."""
    return [x.shape[0] for x in recorder.log.get(module, [])]


def test_backward_into_inputs_only_delivers_nothing() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    optimizer = Recorder(model, lr=0.1)
    x = torch.randn(2, 3, requires_grad=True)
    torch.autograd.grad(model(x).sum(), x)  # a gradient penalty's pass: no parameter gradient
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    assert sizes(optimizer, model[0]) == [5]


def test_retain_graph_double_backward_is_refused_by_name() -> None:
    model = nn.Sequential(nn.Linear(3, 4))
    optimizer = Recorder(model, lr=0.1)
    loss = model(torch.randn(2, 3)).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    with pytest.raises(RuntimeError, match="backward ran twice through one forward call"):
        optimizer.step()
    model(torch.randn(2, 3)).sum().backward()  # the error dropped what could not be followed
    optimizer.step()
    assert sizes(optimizer, model[0]) == [2]


# -- memory: nothing held that nobody reads -----------------------------------------------

OPTIMIZERS: dict[str, Callable[[nn.Module], Any]] = {
    "InputAwareSGD": lambda m: InputAwareSGD(m, lr=0.1),
    "InputAwareAdamW": lambda m: InputAwareAdamW(m, lr=0.1),
    **RULES,
    # Three micro-batches of 4 below, each loss a third of the mean: the step's batch is 12.
    "DPSGD": lambda m: DPSGD(m, lr=0.5, max_grad_norm=0.3, noise_multiplier=0.0, expected_batch_size=12),
}


class Deep(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(30, 6)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.head = nn.Linear(6, 3)
        self.checkpointed = checkpointed
        self.watched: list[weakref.ref[torch.Tensor]] = []

    def _body(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = torch.tanh(layer(h))
            self.watched.append(weakref.ref(h))  # an intermediate activation: another layer's input
        return h

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).mean(1)
        h = checkpoint(self._body, h, use_reentrant=False) if self.checkpointed else self._body(h)
        return self.head(h)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_no_activation_outlives_its_backward(name: str, checkpointed: bool) -> None:
    model = Deep(checkpointed).double()
    optimizer = OPTIMIZERS[name](model)
    optimizer.zero_grad()
    tokens, target = batch(0, size=4)
    earlier: list[weakref.ref[torch.Tensor]] = []
    for _ in range(3):
        loss = loss_of(model, tokens, target) / 3
        gc.collect()  # the earlier micro-batches' activations are gone while this one runs
        assert all(ref() is None for ref in earlier), f"{name}: an earlier micro-batch's activation is held"
        assert any(ref() is not None for ref in model.watched)  # the probe sees live activations
        loss.backward()
        del loss
        gc.collect()
        assert all(ref() is None for ref in model.watched), f"{name}: an activation outlived backward"
        earlier, model.watched = model.watched, []
    optimizer.step()


def test_accumulation_holds_statistics_flat_in_the_micro_batch_count() -> None:
    """What a rule holds before step has the size of its statistics, whatever the micro-batch count."""

    def held_bytes(rule: str, micro_batches: int) -> int:
        model = Net().double()
        optimizer = RULES[rule](model)
        optimizer.zero_grad()
        for micro in range(micro_batches):
            (loss_of(model, *batch(micro)) / micro_batches).backward()
        sizes: dict[int, int] = {}

        def visit(value: Any) -> None:
            if isinstance(value, torch.Tensor):
                sizes[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
            elif isinstance(value, dict):
                for v in value.values():
                    visit(v)
            elif isinstance(value, (tuple, list, frozenset)):
                for v in value:
                    visit(v)

        for reduction in optimizer.capture.reductions:
            visit(list(optimizer.capture.reduced(reduction).values()))
        assert optimizer.capture.calls() == []  # no raw call is kept for a built-in rule
        return sum(sizes.values())

    for rule in ("FOOF", "KFAC", "NLMS", "DPSGD"):
        one = held_bytes(rule, 1)
        assert one > 0 and held_bytes(rule, 8) == one, rule


def test_an_abandoned_optimizer_holds_at_most_one_step() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    abandoned = Recorder(model, lr=0.1)  # built, then never stepped again
    foof = FOOF(model, lr=0.1)
    trainer = torch.optim.SGD(model.parameters(), lr=0.01)
    gc.collect()
    objects = len(gc.get_objects())
    for _ in range(200):
        trainer.zero_grad()
        model(torch.randn(8, 3)).pow(2).mean().backward()
        trainer.step()
        assert len(abandoned.capture.calls()) == 2  # this step's two calls, never more
        held = foof.capture.reduced(foof.rules[0]._statistics)
        assert [float(held[m.weight]["input"][1]) for m in (model[0], model[2])] == [8.0, 8.0]  # this step's rows
    gc.collect()
    assert len(gc.get_objects()) - objects < 200


def test_a_failed_step_keeps_its_captures_for_a_retry() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(4, 2, bias=False).double()
    optimizer = FOOF(layer, lr=1.0, damping=0.0, update_every=1)
    x = torch.randn(3, 4, dtype=torch.float64)
    x[:, 3] = 0  # a direction the inputs never excite: singular without damping
    before = layer.weight.detach().clone()
    optimizer.zero_grad()
    layer(x).pow(2).sum().backward()
    with pytest.raises(RuntimeError, match="increase damping"):
        optimizer.step()
    assert torch.equal(layer.weight, before)
    optimizer.param_groups[0]["damping"] = 0.1
    optimizer.step()  # the retry reads the same statistics
    moment = optimizer.rules[0].state[layer.weight]["input_second_moment"]
    torch.testing.assert_close(moment, x.T @ x / 3)


def test_calls_inside_torch_func_transforms_are_not_recorded() -> None:
    from torch.func import functional_call, grad, vmap

    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    optimizer = Recorder(model, lr=0.1)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_of_one(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (x[None],)).sum()

    vmap(grad(loss_of_one), in_dims=(None, 0))(params, torch.randn(6, 3))  # a user's per-sample pass
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()  # used to raise "tensor escaped the vmap"
    assert sizes(optimizer, model[0]) == [2]
