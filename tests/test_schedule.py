"""Statistics on a schedule: collected every ``statistics_every`` steps, nothing held in between."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from inputaware_optim import FOOF, KFAC, Eva

from .references import backward_with_inputs, preconditioned_sgd_step, with_ones


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def batch(step: int) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(step), dtype=torch.float64)


def train_step(model: nn.Module, optimizer: Any, step: int) -> None:
    optimizer.zero_grad()
    model(batch(step)).pow(2).mean().backward()
    optimizer.step()


def foof_reference(model: nn.Sequential, steps: int, every: int, lr: float, damping: float, decay: float) -> None:
    """FOOF by hand: A from the inputs on steps 0, every, 2 every, ...; the last inverse in between."""
    layers = [model[0], model[2]]
    moments: dict[nn.Module, torch.Tensor] = {}
    inverses: dict[nn.Module, torch.Tensor] = {}
    for step in range(steps):
        inputs = backward_with_inputs(model, layers, lambda m, step=step: m(batch(step)).pow(2).mean())
        for layer in layers:
            if step % every == 0:
                rows = with_ones(inputs[layer].detach())
                moment = rows.T @ rows / len(rows)
                if layer in moments:
                    moment = decay * moments[layer] + (1 - decay) * moment
                moments[layer] = moment
                inverses[layer] = torch.linalg.inv(moment + damping * torch.eye(len(moment)))
            preconditioned_sgd_step(layer, inverses[layer], lr)


@pytest.mark.parametrize("every", [1, 3])
def test_foof_collects_statistics_on_schedule_and_keeps_its_inverse_between(every: int) -> None:
    model = net()
    reference = copy.deepcopy(model)
    optimizer = FOOF(model, lr=0.1, momentum=0.0, damping=0.3, stat_decay=0.8, update_every=1, statistics_every=every)
    for step in range(7):
        train_step(model, optimizer, step)
    foof_reference(reference, 7, every, lr=0.1, damping=0.3, decay=0.8)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-7, atol=1e-9)  # inv vs Cholesky, 7 steps
    assert optimizer.rules[0].state[model[0].weight]["statistics_steps"] == len(range(0, 7, every))


@pytest.mark.parametrize("rule", [FOOF, KFAC, Eva])
def test_between_statistics_steps_the_hooks_hold_nothing(rule: type) -> None:
    model = net()
    optimizer = rule(model, lr=0.05, statistics_every=4)
    handles = len(optimizer.capture._handles)
    for step in range(8):
        optimizer.zero_grad()
        model(batch(step)).pow(2).mean().backward()
        held = (
            optimizer.capture.reduced(optimizer.rules[0]._statistics)
            if optimizer.rules[0]._statistics in optimizer.capture.reductions
            else {}
        )
        assert bool(held) == (step % 4 == 0), step  # statistics only on steps 0 and 4
        assert not optimizer.capture._log.tasks  # nothing pending either
        optimizer.step()
        assert len(optimizer.capture._handles) == handles  # the hooks stay: a compiled model is not retraced
    assert optimizer.rules[0].state[model[0].weight]["statistics_steps"] == 2


@pytest.mark.parametrize("rule", [FOOF, Eva])
def test_resume_mid_schedule_is_bitwise(rule: type) -> None:
    def make(model: nn.Module) -> Any:
        return rule(model, lr=0.05, statistics_every=3)

    model, resumed_model = net(), net()
    uninterrupted = make(model)
    for step in range(7):
        train_step(model, uninterrupted, step)
    first = make(resumed_model)
    for step in range(4):
        train_step(resumed_model, first, step)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = make(resumed_model)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for step in range(4, 7):
        train_step(resumed_model, resumed, step)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True))


@pytest.mark.parametrize("rule", [FOOF, KFAC, Eva])
@pytest.mark.filterwarnings("error::inputaware_optim.UncapturedInputsWarning")
def test_statistics_every_changed_mid_run_is_read_at_the_step(rule: type) -> None:
    # The hooks for a step's forward are armed at the end of the step before, with the schedule of
    # that moment: a step made due by a later change used to find no statistics, warn that its
    # layers were uncaptured and give them the plain step. It is now a step between statistics,
    # and the change applies from the next forward: every 3 changed to every 1 after step 0 trains
    # as every 2 does (statistics on steps 0 and 2), bitwise.
    def make(model: nn.Module, every: int) -> Any:
        return rule(model, lr=0.05, statistics_every=every, **({} if rule is Eva else {"update_every": 1}))

    changed_model, reference_model = net(), net()
    changed, reference = make(changed_model, 3), make(reference_model, 2)
    for step in range(3):
        train_step(changed_model, changed, step)
        train_step(reference_model, reference, step)
        for group in changed.param_groups:
            group["statistics_every"] = 1
    assert changed.rules[0].state[changed_model[0].weight]["statistics_steps"] == 2
    assert all(torch.equal(p, q) for p, q in zip(changed_model.parameters(), reference_model.parameters(), strict=True))


@pytest.mark.parametrize("rule", [FOOF, KFAC, Eva])
@pytest.mark.filterwarnings("error::inputaware_optim.UncapturedInputsWarning")
def test_a_state_dict_loaded_into_a_stepped_optimizer_arms_its_schedule(rule: type) -> None:
    # An optimizer that stepped off-schedule (its hooks paused) loads a state due for statistics:
    # the next forward is read, as in the run the state came from.
    model, other_model = net(), net()
    source = rule(model, lr=0.05, statistics_every=2)
    for step in range(2):
        train_step(model, source, step)
    loaded = rule(other_model, lr=0.05, statistics_every=2)
    train_step(other_model, loaded, 0)  # its hooks now paused for a step between statistics
    other_model.load_state_dict(model.state_dict())
    loaded.load_state_dict(copy.deepcopy(source.state_dict()))  # (a live state dict shares its tensors)
    train_step(model, source, 2)
    train_step(other_model, loaded, 2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), other_model.parameters(), strict=True))


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_statistics_every_must_be_a_positive_integer(value: Any) -> None:
    with pytest.raises(ValueError, match="statistics_every"):
        FOOF(net(), lr=0.1, statistics_every=value)


def refresh_steps(steps: int, statistics_every: int, update_every: int) -> list[int]:
    """The optimizer steps that refresh the inverses: the first statistics step at least
    ``update_every`` optimizer steps after the last refresh (kfac-pytorch's inv_update_steps)."""
    refreshed: list[int] = []
    for step in range(0, steps, statistics_every):
        if not refreshed or step - refreshed[-1] >= update_every:
            refreshed.append(step)
    return refreshed


@settings(max_examples=12, deadline=None)
@given(statistics_every=st.integers(1, 4), update_every=st.integers(1, 9))
def test_update_every_counts_optimizer_steps(statistics_every: int, update_every: int) -> None:
    model = net()
    optimizer = FOOF(model, lr=0.05, update_every=update_every, statistics_every=statistics_every)
    seen, changed = None, []
    for step in range(12):
        train_step(model, optimizer, step)
        inverse = optimizer.rules[0].state[model[0].weight]["input_inverse"]
        if seen is None or not torch.equal(inverse, seen):
            changed.append(step)
        seen = inverse.clone()
    assert changed == refresh_steps(12, statistics_every, update_every)
