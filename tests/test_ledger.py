"""The gradient ledger on its own (``inputaware_optim.ledger``): what each parameter's ``.grad`` holds through
commits, replacements, in-place rescaling and zeroing, returned gradients and releases, against hand-written
expectations (the capture's tests check it through real backward passes)."""

from __future__ import annotations

import gc
from types import SimpleNamespace
from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st

from inputaware_optim.ledger import GradientLedger
from inputaware_optim.reduction import Reduction


def call(index: int) -> Any:
    return SimpleNamespace(index=index)


def params(count: int = 2) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(3)) for _ in range(count)]


def accumulate(param: torch.nn.Parameter, value: float = 1.0) -> None:
    """What a backward pass does to ``param.grad``: a new tensor the first time, in place after."""
    if param.grad is None:
        param.grad = torch.full_like(param, value)
    else:
        param.grad.add_(value)


def test_commits_add_each_pass_calls_in_call_order_and_bump_the_generation() -> None:
    ledger, (p, q) = GradientLedger(), params()
    a, b = ledger.entry(p), ledger.entry(q)
    accumulate(p), accumulate(q)
    ledger.commit({a, b}, {a: [call(2), call(0)], b: [call(1)]}, {}, [])
    generation = ledger.generation
    accumulate(p)
    ledger.commit({a}, {a: [call(5), call(3)]}, {}, [])
    assert [c.index for c in a.calls] == [0, 2, 3, 5] and [c.index for c in b.calls] == [1]
    assert ledger.generation > generation
    ledger.refresh()
    assert [c.index for c in a.calls] == [0, 2, 3, 5]  # (accumulated in place by the pass: the same gradient)


def test_a_replaced_gradient_holds_nothing_and_one_rescaled_in_place_holds_what_it_held() -> None:
    ledger, (p, q) = GradientLedger(), params()
    a, b = ledger.entry(p), ledger.entry(q)
    accumulate(p), accumulate(q)
    ledger.commit({a, b}, {a: [call(0)], b: [call(1)]}, {}, [])
    p.grad = None  # zero_grad(set_to_none=True)
    q.grad.mul_(0.5)  # clip_grad_norm_, unscaling
    ledger.refresh()
    assert not a.holds() and [c.index for c in b.calls] == [1]
    q.grad = torch.ones(3)  # assigned by hand
    ledger.refresh()
    assert not b.holds()


@given(rescale=st.booleans())
def test_a_gradient_zeroed_in_place_holds_nothing_unless_every_gradient_was_rescaled_with_it(rescale: bool) -> None:
    ledger, (p, q) = GradientLedger(), params()
    a, b = ledger.entry(p), ledger.entry(q)
    p.grad, q.grad = torch.zeros(3), torch.ones(3)  # p's gradient happens to be zero
    ledger.commit({a, b}, {a: [call(0)], b: [call(1)]}, {}, [])
    if rescale:  # GradScaler's unscaling: every gradient, in place
        p.grad.mul_(0.5), q.grad.mul_(0.5)
    else:  # zero_grad(set_to_none=False)
        p.grad.zero_(), q.grad.zero_()
    ledger.refresh()
    assert a.holds() == b.holds() == rescale


def test_a_gradient_autograd_grad_returned_holds_its_calls_once_assigned_and_goes_when_it_dies() -> None:
    ledger, (p,) = GradientLedger(), params(1)
    entry = ledger.entry(p)
    returned = torch.full((3,), 2.0)
    ledger.commit(set(), {}, {entry: (returned, [call(4)])}, [])
    assert not entry.holds() and id(returned) in ledger.returned
    p.grad = returned
    ledger.refresh()
    assert [c.index for c in entry.calls] == [4] and not ledger.returned
    other = torch.ones(3)
    ledger.commit(set(), {}, {entry: (other, [call(7)])}, [])
    del other
    gc.collect()
    assert not ledger.returned  # nothing kept for a tensor that died (its id may be reused)


def test_a_release_drops_what_entries_hold_and_remembers_the_gradient_it_released() -> None:
    ledger, (p,) = GradientLedger(), params(1)
    entry = ledger.entry(p)
    accumulate(p)
    ledger.commit({entry}, {entry: [call(0)]}, {}, [])
    ledger.release([entry])
    assert not entry.holds() and ledger.released(p)  # a step reading this gradient again: stepped twice
    p.grad = None
    assert not ledger.released(p)


def test_statistics_combine_over_passes_by_the_reductions_combine() -> None:
    class Concatenated(Reduction):
        combine = Reduction.concatenate

    summed, joined = Reduction(), Concatenated()
    ledger, (p,) = GradientLedger(), params(1)
    entry = ledger.entry(p)
    for value in (1.0, 2.0):
        accumulate(p)
        rows = torch.tensor([value, value])
        ledger.commit({entry}, None, {}, [(summed, {p: rows}), (joined, {p: rows})])
    torch.testing.assert_close(ledger.totals(summed)[p], torch.tensor([3.0, 3.0]))
    torch.testing.assert_close(ledger.totals(joined)[p], torch.tensor([1.0, 1.0, 2.0, 2.0]))
    assert entry.calls == []  # (raw calls not kept: None)
