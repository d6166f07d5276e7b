"""The Inputs a rule reads: lookups, reasons for misses, conveniences."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from inputaware_optim import Call, Capture, Captured, Inputs, UncapturedInputsWarning

from .conftest import mlp


def captured(model: nn.Module, *batches: torch.Tensor) -> tuple[Capture, Inputs]:
    capture = Capture(model)
    for x in batches:
        model(x).sum().backward()
    return capture, capture.inputs()


def test_lookup_by_module_and_by_parameter() -> None:
    model = mlp()
    _, inputs = captured(model, torch.randn(2, 4))
    by_module, by_weight, by_bias = inputs[model[0]], inputs[model[0].weight], inputs.get(model[0].bias)
    assert isinstance(by_module, Captured)
    assert by_module.calls == by_weight.calls == by_bias.calls
    assert by_module.modules == (model[0],)
    assert model[0] in inputs and model[0].weight in inputs and model[1] not in inputs
    assert list(inputs) == [model[0], model[2]] and len(inputs) == 2
    assert dict(inputs.items()).keys() == {model[0], model[2]}
    assert [c.module for c in inputs.calls] == [model[0], model[2]]


def test_misses_say_why() -> None:
    model = mlp()
    capture = Capture(model)
    inputs = capture.inputs()
    assert inputs.get(model[0]) is None and inputs.get(model[0].weight) is None
    with pytest.raises(KeyError, match="no forward call of 0 was captured"):
        inputs[model[0]]
    with pytest.raises(KeyError, match=r"no forward call of 2 \(which owns this parameter\)"):
        inputs[model[2].weight]
    with pytest.raises(KeyError, match="owns no parameter"):
        inputs[model[1]]
    with pytest.raises(KeyError, match="not a parameter of this optimizer"):
        inputs[torch.zeros(3)]
    with pytest.raises(KeyError, match="module or parameter"):
        inputs["fc"]  # type: ignore[index]
    assert inputs.get("fc") is None  # type: ignore[arg-type]


@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4), sequence=st.integers(1, 3))
def test_conveniences_concatenate_every_call(sizes: list[int], sequence: int) -> None:
    model = nn.Sequential(nn.Linear(4, 5))
    batches = [torch.randn(n, sequence, 4) for n in sizes]
    _, inputs = captured(model, *batches)
    entry = inputs[model[0].weight]
    assert len(entry) == len(sizes)
    assert all(torch.equal(a, b) for a, b in zip(entry.inputs(), batches, strict=True))
    assert torch.equal(entry.cat(), torch.cat(batches))
    if len(set(sizes)) == 1:
        assert torch.equal(entry.cat(dim=1), torch.cat(batches, dim=1))
    assert torch.equal(entry.rows(), torch.cat([b.reshape(-1, 4) for b in batches]))
    assert entry.rows().shape == (sum(sizes) * sequence, 4)
    assert entry[0].input is entry.calls[0].args[0]


def test_positions_that_do_not_exist_and_missing_grad_outputs() -> None:
    model = mlp()
    _, inputs = captured(model, torch.randn(2, 4))
    with pytest.raises(IndexError, match="position 1 does not exist"):
        inputs[model[0]].inputs(1)
    with pytest.raises(RuntimeError, match="grad_outputs=True"):
        inputs[model[0]].grad_outputs()
    call = inputs[model[0]].calls[0]
    assert not call.has_grad_outputs
    for read in (lambda: call.grad_outputs, lambda: call.grad_output):  # an error naming the flag, not a None
        with pytest.raises(RuntimeError, match=r"not captured: ask for them with grad_outputs = True"):
            read()


def test_from_mapping_validates() -> None:
    model = mlp()
    _, inputs = captured(model, torch.randn(2, 4))
    entry = inputs[model[0]]
    built = Inputs.from_mapping({model[0]: entry, model[2].weight: list(inputs[model[2]])})
    assert built[model[0]].calls == entry.calls
    assert built[model[2].weight].calls == inputs[model[2]].calls
    with pytest.raises(TypeError, match="another module"):
        Inputs.from_mapping({model[2]: entry})
    with pytest.raises(
        TypeError, match=r"a parameter of shape \(3, 8\) the calls of Linear \(Linear\), which does not"
    ):
        Inputs.from_mapping({model[2].weight: entry})  # (the calls of model[0]: not its owner)
    with pytest.raises(TypeError, match="lists of Call"):
        Inputs.from_mapping({model[0]: [1, 2]})
    with pytest.raises(TypeError, match="keys must be modules or parameters"):
        Inputs.from_mapping({"fc": entry})


def test_call_repr_and_input() -> None:
    call = Call(nn.Linear(2, 2), (torch.zeros(3, 2), 4), {"mask": torch.ones(3)})
    assert repr(call) == "Call(Linear(Tensor(3, 2), int, mask=Tensor(3,)))"
    assert call.input.shape == (3, 2)
    with pytest.raises(IndexError):
        Call(nn.Linear(2, 2), (), {}).input  # noqa: B018


def test_uncaptured_modules_are_reported_and_warned_once() -> None:
    attention = nn.MultiheadAttention(8, 2, batch_first=True)
    model = nn.Sequential(attention)
    capture = Capture(model)
    x = torch.randn(2, 3, 8)
    attention(x, x, x)[0].sum().backward()
    assert list(capture.uncaptured()) == ["0.out_proj"]  # its weight is used without calling it
    live = capture._live_inputs()
    with pytest.warns(UncapturedInputsWarning, match="0.out_proj"):
        assert live.get(attention.out_proj.weight) is None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert live.get(attention.out_proj.bias) is None  # once per module
