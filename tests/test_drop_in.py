"""With no rule, the input-aware optimizers are the stock ones: same steps, state, hooks, formats."""

from __future__ import annotations

import copy
import io
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from inputaware_optim import InputAwareAdamW, InputAwareSGD

from .cases import DROP_IN_CASES, IMPLEMENTATIONS, DropInCase
from .conftest import mlp

CASE_IDS = [c.name for c in DROP_IN_CASES]


def train_pair(
    case: DropInCase, hyperparameters: dict[str, Any], steps: int, seed: int = 0
) -> tuple[nn.Module, Any, nn.Module, Any]:
    ours_model, stock_model = mlp(seed), mlp(seed)
    ours = case.cls(ours_model, **hyperparameters)
    stock = case.stock(stock_model.parameters(), **hyperparameters)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(6, 4, generator=generator)
        for model, optimizer in ((ours_model, ours), (stock_model, stock)):
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
    return ours_model, ours, stock_model, stock


def assert_same(ours_model: nn.Module, ours: Any, stock_model: nn.Module, stock: Any) -> None:
    for p, q in zip(ours_model.parameters(), stock_model.parameters(), strict=True):
        assert torch.equal(p, q)
    for p, q in zip(ours_model.parameters(), stock_model.parameters(), strict=True):
        ours_state, stock_state = ours.state[p], stock.state[q]
        assert ours_state.keys() == stock_state.keys()
        for key in stock_state:
            a, b = ours_state[key], stock_state[key]
            assert torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b, key


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("case", DROP_IN_CASES, ids=CASE_IDS)
def test_bitwise_identical_to_stock(case: DropInCase, implementation: str) -> None:
    @given(hyperparameters=case.hyperparameters, steps=st.integers(1, 4))
    def check(hyperparameters: dict[str, Any], steps: int) -> None:
        hyperparameters = {**hyperparameters, **IMPLEMENTATIONS[implementation]}
        ours_model, ours, stock_model, stock = train_pair(case, hyperparameters, steps)
        assert_same(ours_model, ours, stock_model, stock)
        assert set(ours.state[next(ours_model.parameters())]) >= set(case.state_keys) - {
            "momentum_buffer" if not hyperparameters.get("momentum") else ""
        }

    check()


@pytest.mark.parametrize("case", DROP_IN_CASES, ids=CASE_IDS)
def test_is_a_subclass_with_stock_defaults(case: DropInCase) -> None:
    model = mlp()
    ours = case.cls(model)
    stock = case.stock(mlp().parameters())
    assert isinstance(ours, case.stock)
    assert ours.defaults == stock.defaults
    assert [p for g in ours.param_groups for p in g["params"]] == list(model.parameters())


@pytest.mark.parametrize("case", DROP_IN_CASES, ids=CASE_IDS)
@pytest.mark.parametrize(
    "bad",
    [{"lr": -1.0}, {"weight_decay": -0.5}, {"momentum": -1}, {"betas": (1.5, 0.9)}, {"eps": -1.0}, {"bogus": 1}],
    ids=["lr", "weight_decay", "momentum", "betas", "eps", "unknown"],
)
def test_invalid_hyperparameters_fail_like_stock_and_attach_nothing(case: DropInCase, bad: dict[str, Any]) -> None:
    model = mlp()
    try:
        case.stock(mlp().parameters(), **bad)
    except Exception as stock_error:  # the stock class refuses it: so must we, with the same message
        with pytest.raises(type(stock_error)) as ours_error:
            case.cls(model, **bad)
        if "unexpected keyword argument" in str(stock_error):  # named by the class that was called
            (keyword,) = bad
            assert str(ours_error.value).startswith(
                f"{case.cls.__name__}() got an unexpected keyword argument '{keyword}'"
            )
        else:
            assert str(ours_error.value) == str(stock_error)
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    else:
        case.cls(model, **bad)


@pytest.mark.parametrize("case", DROP_IN_CASES, ids=CASE_IDS)
def test_explicit_params_and_groups(case: DropInCase) -> None:
    model = mlp()
    first, second = model[0], model[2]
    ours = case.cls(model, [{"params": first.parameters(), "lr": 0.5}, {"params": second.parameters()}], lr=0.1)
    assert [g["lr"] for g in ours.param_groups] == [0.5, 0.1]
    del ours
    only = case.cls(model, params=first.parameters())
    assert set(only.capture.modules) == {first}  # only the owners of its parameters are hooked
    assert not second._forward_hooks  # the first optimizer's hooks left with it


@pytest.mark.parametrize("case", DROP_IN_CASES, ids=CASE_IDS)
def test_foreign_parameter_is_refused_and_nothing_attached(case: DropInCase) -> None:
    model, other = mlp(), mlp(1)
    with pytest.raises(ValueError, match="not a parameter of the model"):
        case.cls(model, params=[*model.parameters(), next(other.parameters())])
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    ours = case.cls(model)
    with pytest.raises(ValueError, match="not a parameter of the model"):
        ours.add_param_group({"params": [next(other.parameters())]})
    assert len(ours.param_groups) == 1


@pytest.mark.parametrize("case", DROP_IN_CASES, ids=CASE_IDS)
def test_add_param_group_hooks_the_new_owners(case: DropInCase) -> None:
    model = mlp()
    ours = case.cls(model, params=model[0].parameters())
    ours.capture.keep_calls = True  # a reader, so that calls are recorded
    ours.add_param_group({"params": model[2].parameters(), "lr": 0.01})
    model(torch.randn(2, 4)).sum().backward()
    assert {c.module for c in ours.capture.calls()} == {model[0], model[2]}


@pytest.mark.parametrize("case", DROP_IN_CASES, ids=CASE_IDS)
def test_model_that_is_not_a_module(case: DropInCase) -> None:
    model = mlp()
    with pytest.raises(TypeError, match="takes the model itself"):
        case.cls(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"expects an nn\.Module"):
        case.cls(3.0)


def test_model_without_trainable_parameters() -> None:
    model = mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter that requires grad"):
        InputAwareSGD(model, lr=0.1)


def test_invalid_storage() -> None:
    with pytest.raises(ValueError, match="storage"):
        InputAwareSGD(mlp(), lr=0.1, storage="disk")


# -- step hooks ----------------------------------------------------------------------------


class Rule(InputAwareSGD):
    """A rule that reads inputs and defers to the stock update."""

    seen: list[Any]

    @torch.no_grad()
    def step(self, closure: Any = None, inputs: Any = None) -> Any:
        self.seen.append(inputs)
        return super().step(inputs=inputs)


def count_step_hooks(optimizer: Any) -> Counter[str]:
    """Run one step of ``optimizer`` and count the step hooks that ran for it."""
    counts: Counter[str] = Counter()

    def counter(name: str) -> Any:
        return lambda opt, *_: counts.update([name] if opt is optimizer else [])

    optimizer.register_step_pre_hook(counter("pre"))
    optimizer.register_step_post_hook(counter("post"))
    handles = [
        register_optimizer_step_pre_hook(counter("global_pre")),
        register_optimizer_step_post_hook(counter("global_post")),
    ]
    try:
        optimizer.model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    finally:
        for handle in handles:
            handle.remove()
    return counts


def test_step_hooks_run_once_even_after_stock_instances_exist() -> None:
    # Creating stock instances patches their classes' step; a naive subclass then runs hooks twice.
    torch.optim.SGD(mlp().parameters(), lr=0.1)
    torch.optim.AdamW(mlp().parameters(), lr=0.1)
    InputAwareSGD(mlp(), lr=0.1)
    for cls in (Rule, InputAwareSGD, InputAwareAdamW):
        optimizer = cls(mlp(), lr=0.1)
        optimizer.seen = []
        assert count_step_hooks(optimizer) == {"pre": 1, "post": 1, "global_pre": 1, "global_post": 1}, cls


def test_inputs_injected_by_a_pre_hook_reach_the_rule_once() -> None:
    torch.optim.SGD(mlp().parameters(), lr=0.1)  # patch the stock class first
    model = mlp()
    optimizer = Rule(model, lr=0.1)
    optimizer.seen = []
    other = InputAwareSGD(mlp(1), lr=0.1)
    other.model(torch.randn(3, 4)).sum().backward()
    injected = other.capture.inputs()
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: (args, {**kwargs, "inputs": injected}))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    assert optimizer.seen == [injected]


def test_step_inputs_argument_is_handed_over_itself() -> None:
    model = mlp()
    optimizer = Rule(model, lr=0.1)
    optimizer.seen = []
    model(torch.randn(2, 4)).sum().backward()
    snapshot = optimizer.capture.inputs()
    optimizer.step(inputs=snapshot)
    assert optimizer.seen[0] is snapshot


def test_bad_inputs_argument_raises_and_loses_nothing() -> None:
    model = mlp()
    optimizer = Rule(model, lr=0.1)
    optimizer.seen = []
    model(torch.randn(2, 4)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    for bad in ([1, 2], "inputs", {"a": 1}, {model[0]: 3}):
        with pytest.raises(TypeError, match="inputs"):
            optimizer.step(inputs=bad)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert len(optimizer.capture.calls()) == 2  # the captures are still there for a proper step
    optimizer.step()
    assert len(optimizer.seen) == 1
    with pytest.raises(RuntimeError, match="step\\(\\) that has returned"):
        optimizer.seen[0].calls  # noqa: B018  # the view expired with its step
    assert optimizer.capture.calls() == []  # and the captures were released


def test_a_mapping_of_calls_is_accepted_as_inputs() -> None:
    model = mlp()
    optimizer = Rule(model, lr=0.1)
    optimizer.seen = []
    model(torch.randn(2, 4)).sum().backward()
    calls = optimizer.capture.inputs()
    optimizer.step(inputs={model[0]: calls[model[0]]})
    handed = optimizer.seen[0]
    assert handed.get(model[0].weight).calls == calls[model[0]].calls
    assert handed.get(model[2]) is None


def test_a_step_without_inputs_parameter_is_refused_at_construction() -> None:
    class Forgetful(InputAwareSGD):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            return super().step(closure)

    with pytest.raises(TypeError, match="inputs=None"):
        Forgetful(mlp(), lr=0.1)


# -- schedulers and state_dict -----------------------------------------------------------------


@pytest.mark.parametrize("case", DROP_IN_CASES, ids=CASE_IDS)
def test_lr_scheduler_matches_stock(case: DropInCase, recwarn: pytest.WarningsRecorder) -> None:
    ours_model, stock_model = mlp(), mlp()
    ours, stock = case.cls(ours_model, lr=0.1), case.stock(stock_model.parameters(), lr=0.1)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (ours, stock)]
    for _ in range(5):
        x = torch.randn(4, 4)
        for model, optimizer, scheduler in zip((ours_model, stock_model), (ours, stock), schedulers, strict=True):
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()
            scheduler.step()
    assert schedulers[0].get_last_lr() == schedulers[1].get_last_lr()
    assert_same(ours_model, ours, stock_model, stock)
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message)]


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("case", DROP_IN_CASES, ids=CASE_IDS)
@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_state_dict_round_trips_through_the_stock_class(case: DropInCase, implementation: str) -> None:
    hyperparameters = {"lr": 0.05, **IMPLEMENTATIONS[implementation]}
    if case.stock is torch.optim.SGD:
        hyperparameters["momentum"] = 0.9
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(5, 4, generator=generator) for _ in range(6)]

    def run(model: nn.Module, optimizer: Any, xs: list[torch.Tensor]) -> None:
        for x in xs:
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()

    # An uninterrupted run of ours.
    straight_model = mlp()
    straight = case.cls(straight_model, **hyperparameters)
    run(straight_model, straight, batches)

    # Ours for 3 steps, saved, resumed in the stock class for 2, saved, back in ours for 1.
    model = mlp()
    first = case.cls(model, **hyperparameters)
    run(model, first, batches[:3])
    saved = roundtrip({"model": model.state_dict(), "optim": first.state_dict()})
    stock_model = mlp(5)
    stock_model.load_state_dict(saved["model"])
    stock = case.stock(stock_model.parameters(), **hyperparameters)
    stock.load_state_dict(saved["optim"])
    run(stock_model, stock, batches[3:5])
    saved = roundtrip({"model": stock_model.state_dict(), "optim": stock.state_dict()})
    resumed_model = mlp(7)
    resumed_model.load_state_dict(saved["model"])
    resumed = case.cls(resumed_model, **hyperparameters)
    resumed.load_state_dict(saved["optim"])
    run(resumed_model, resumed, batches[5:])

    assert_same(resumed_model, resumed, straight_model, straight)
    assert roundtrip(resumed.state_dict()).keys() == straight.state_dict().keys()


def test_deepcopy_is_the_same_optimizer_on_a_copy_of_the_model() -> None:
    model = mlp()
    optimizer = InputAwareSGD(model, lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    clone = copy.deepcopy(optimizer)
    assert clone.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
    assert clone.model is not model and set(clone.capture.modules) <= set(clone.model.modules())
    assert [p for g in clone.param_groups for p in g["params"]] == list(clone.model.parameters())
