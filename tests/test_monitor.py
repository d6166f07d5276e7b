"""Input-aware step hooks, Monitor, NonFiniteFinder and the plot command, against references."""

from __future__ import annotations

import copy
import functools
import gc
import json
import math
import os
import pickle
import socket
import subprocess
import sys
import warnings
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn.utils import prune

from inputaware_optim import (
    FOOF,
    KFAC,
    NLMS,
    Capture,
    Eva,
    InputAwareAdamW,
    InputAwareSGD,
    LazyAdamW,
    Monitor,
    NonFiniteError,
    NonFiniteFinder,
    NonFiniteWarning,
    Reduction,
)

from .conftest import hooks_on, mlp
from .multiprocess import mark_done, run_spawned

ROOT = Path(__file__).resolve().parent.parent


class _Poison(torch.autograd.Function):
    """Identity that can put a NaN into its output (forward) or into the gradient it passes on (backward)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, forward_nan: bool, backward_nan: bool) -> Tensor:
        ctx.backward_nan = backward_nan
        out = x.clone()
        if forward_nan:
            out[0, 0] = math.nan
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        if ctx.backward_nan:  # everywhere: a ReLU behind it would let a single NaN through only where active
            return torch.full_like(grad, math.nan), None, None
        return grad.clone(), None, None


class Poison(nn.Module):
    """Puts a NaN in the forward or the backward of its call number ``at`` (``None``: never)."""

    def __init__(self) -> None:
        super().__init__()
        self.forward_at: int | None = None
        self.backward_at: int | None = None
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        call, self.calls = self.calls, self.calls + 1
        return _Poison.apply(x, call == self.forward_at, call == self.backward_at)


class Reused(nn.Module):
    """``shared`` and ``poison`` run twice in one forward; ReLU makes exact zeros."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 8)
        self.shared = nn.Linear(8, 8)
        self.poison = Poison()
        self.out = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        self.poison.calls = 0
        h = torch.relu(self.first(x))
        h = self.poison(torch.tanh(self.shared(h)))
        h = self.poison(torch.relu(self.shared(h)))
        return self.out(h)


def batch(seed: int, rows: int = 6) -> Tensor:
    return torch.randn(rows, 4, generator=torch.Generator().manual_seed(seed))


def inputs_by_module(calls: Any) -> dict[nn.Module, list[Tensor]]:
    found: dict[nn.Module, list[Tensor]] = {}
    for call in calls:
        found.setdefault(call.module, []).append(call.input.clone())
    return found


# -- the step hook --------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["plain", "tutorial", "closure"])
def test_hook_runs_once_per_step_and_sees_exactly_the_calls_in_the_gradient(order: str) -> None:
    model = Reused()
    torch.optim.SGD(nn.Linear(1, 1).parameters())  # a plain SGD wraps its step: no second run of ours
    opt = InputAwareSGD(model, lr=0.1)
    reference = Capture(model)  # follows the gradient on its own: what the step reads
    seen: list[dict[nn.Module, list[Tensor]]] = []
    expected: list[dict[nn.Module, list[Tensor]]] = []

    def hook(optimizer: Any, inputs: Any) -> None:
        assert optimizer is opt
        seen.append(inputs_by_module(inputs.calls))
        expected.append(inputs_by_module(reference.calls()))

    opt.register_inputs_hook(hook)
    for step in range(3):
        model(batch(100 + step)).sum()  # a forward never backpropagated
        model(batch(200 + step)).sum().backward()
        model.zero_grad()  # drops that one
        if order == "plain":
            opt.zero_grad()
            model(batch(step)).sum().backward()
            model(batch(300 + step)).sum().backward()  # accumulated: counts
            opt.step()
        elif order == "tutorial":
            loss = model(batch(step)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        else:

            def closure(step: int = step) -> Tensor:
                loss = model(batch(step)).sum()
                opt.zero_grad()
                loss.backward()
                return loss

            opt.step(closure)
        reference.clear()
    assert len(seen) == 3
    for got, want in zip(seen, expected, strict=True):
        assert list(got) == list(want) and want
        for module in want:
            assert (
                len(got[module])
                == len(want[module])
                == (2 if module is model.shared else 1) * (2 if order == "plain" else 1)
            )
            for a, b in zip(got[module], want[module], strict=True):
                assert torch.equal(a, b)


def test_hook_runs_once_with_a_rule_that_calls_super_step() -> None:
    class Rule(InputAwareAdamW):
        def step(self, closure: Any = None, inputs: Any = None) -> Any:
            return super().step(closure, inputs=inputs)

    torch.optim.AdamW(nn.Linear(1, 1).parameters())
    model = mlp()
    opt = Rule(model, lr=0.1)
    runs: list[str] = []
    opt.register_inputs_hook(lambda o, i: runs.append("pre"))
    opt.register_inputs_hook(lambda o, i, u: runs.append("post"), when="post")
    opt.zero_grad()
    model(batch(0)).sum().backward()
    opt.step()
    assert runs == ["pre", "post"]


def test_post_hook_gets_each_parameters_update() -> None:
    model = mlp()
    opt = InputAwareAdamW(model, lr=0.1)
    got: list[dict[Tensor, Tensor]] = []
    opt.register_inputs_hook(lambda o, i, updates: got.append(updates), when="post", reads="updates")
    opt.zero_grad()
    model(batch(0)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    (updates,) = got
    for p, b in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(updates[p], p.detach() - b)
    with pytest.raises(ValueError, match="when='post'"):
        opt.register_inputs_hook(lambda o, i: None, reads="updates")
    with pytest.raises(ValueError, match="every"):
        opt.register_inputs_hook(lambda o, i: None, every=0)
    with pytest.raises(TypeError, match="reads="):
        opt.register_inputs_hook(lambda o, i: None, reads=["everything"])


def test_removed_hook_no_longer_runs_and_leaves_no_hook_on_the_model() -> None:
    model = mlp()
    opt = InputAwareSGD(model, lr=0.1)
    assert hooks_on(model) == 0
    runs: list[int] = []
    handle = opt.register_inputs_hook(lambda o, i: runs.append(len(i.calls)))
    assert hooks_on(model) > 0
    for _ in range(2):
        opt.zero_grad()
        model(batch(0)).sum().backward()
        opt.step()
    handle.remove()
    opt.zero_grad()
    model(batch(0)).sum().backward()
    opt.step()
    assert runs == [2, 2]
    assert hooks_on(model) == 0 and not opt.capture.active


class _InputSum(Reduction):
    def forward(self, call: Any) -> Any:
        return call.input.sum()


@pytest.mark.parametrize("reads", ["calls", "reduction"])
def test_nothing_is_kept_on_the_steps_every_skips(reads: str) -> None:
    model = mlp()
    opt = InputAwareSGD(model, lr=0.1)
    reduction = _InputSum()
    runs: list[int] = []

    def hook(optimizer: Any, inputs: Any) -> None:
        runs.append(handle.step)
        if reads == "calls":
            assert len(inputs.calls) == 2
        else:
            assert set(inputs.reduced(reduction)) == set(model.parameters())

    handle = opt.register_inputs_hook(hook, every=3, reads="calls" if reads == "calls" else reduction)
    activations: list[weakref.ref[Tensor]] = []
    model[2].register_forward_pre_hook(lambda m, args: activations.append(weakref.ref(args[0])))
    alive = []
    for step in range(7):
        opt.zero_grad()
        hooked = hooks_on(model) - 1  # less ours
        model(batch(step)).sum().backward()
        gc.collect()
        alive.append(activations[-1]() is not None)
        due = step % 3 == 0
        assert hooked > 0 if due else hooked == 0, step
        assert bool(opt.capture.reductions) == (due and reads == "reduction")
        opt.step()
    assert runs == [0, 3, 6]
    # The activation outlives its backward only where raw calls are read, on the steps the hook runs.
    assert alive == [reads == "calls" and step % 3 == 0 for step in range(7)]


# -- Monitor statistics -------------------------------------------------------------------


def by_hand(tensors: list[Tensor]) -> dict[str, float]:
    x = torch.cat([t.detach().double().reshape(-1) for t in tensors])
    return {
        "mean": x.mean().item(),
        "rms": x.pow(2).mean().sqrt().item(),
        "max_abs": x.abs().max().item(),
        "zero_fraction": (x == 0).double().mean().item(),
        "nonfinite": (~torch.isfinite(x)).sum().item(),
    }


def assert_statistics(got: dict[str, float], want: dict[str, float], prefix: str, *, absolute: float = 1e-9) -> None:
    for name, value in want.items():
        assert got[f"{prefix}_{name}"] == pytest.approx(value, rel=1e-6, abs=absolute, nan_ok=True), (prefix, name)


@pytest.mark.parametrize("optimizer", ["InputAwareAdamW", "torch.optim.AdamW"])
def test_every_monitor_statistic_equals_the_same_by_hand_in_float64(optimizer: str) -> None:
    model = Reused()
    if optimizer == "InputAwareAdamW":
        opt: torch.optim.Optimizer = InputAwareAdamW(model, lr=0.05)
        monitor = Monitor(opt, grad_outputs=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        monitor = Monitor(opt, model, grad_outputs=True)
    reference = Capture(model, grad_outputs=True)
    names = {m: n for n, m in model.named_modules()}
    for step in range(3):
        model(batch(50 + step)).sum().backward()
        opt.zero_grad()  # the forward above does not count
        for micro in range(2):
            x = batch(10 * step + micro)
            if step == 2 and micro == 1:
                x[0, 0] = math.inf  # counted as non-finite (and makes this step's gradient NaN)
            (model(x).pow(2).mean() / 2).backward()
        calls = reference.calls()
        grads = {p: p.grad.detach().double().clone() for p in model.parameters()}
        weights = {p: p.detach().double().clone() for p in model.parameters()}
        opt.step()
        reference.clear()
        record = monitor.last
        assert record is not None and record["step"] == step
        for module in (model.first, model.shared, model.out):
            mine = [c for c in calls if c.module is module]
            got = record["modules"][names[module]]
            assert_statistics(got, by_hand([c.input for c in mine]), "input")
            assert_statistics(got, by_hand([c.grad_output for c in mine]), "grad_output")
        for name, param in model.named_parameters():
            got = record["parameters"][name]
            update = param.detach().double() - weights[param]
            assert got["grad_norm"] == pytest.approx(grads[param].norm().item(), rel=1e-6, nan_ok=True)
            assert got["update_norm"] == pytest.approx(update.norm().item(), rel=1e-5, abs=1e-9, nan_ok=True)
            ratio = update.norm().item() / weights[param].norm().item()
            assert got["update_to_weight"] == pytest.approx(ratio, rel=1e-5, abs=1e-9, nan_ok=True)
    assert record["modules"]["first"]["input_nonfinite"] == 1
    monitor.remove()
    assert hooks_on(model) == len(reference._handles)


def test_monitor_every_100_computes_nothing_in_between() -> None:
    model = mlp()
    opt = InputAwareSGD(model, lr=0.1)
    records: list[dict[str, Any]] = []
    monitor = Monitor(opt, every=100, callback=records.append)
    for step in range(3):
        opt.zero_grad()
        assert (hooks_on(model) > 0) == (step == 0)
        model(batch(step)).sum().backward()
        opt.step()
    assert [r["step"] for r in records] == [0]
    monitor.remove()


def _sgd_monitor(plain: bool, every: int) -> tuple[nn.Module, torch.optim.Optimizer, Monitor, list[dict[str, Any]]]:
    """``mlp()`` with SGD (input-aware, or stock with ``plain``) and a Monitor logging every ``every`` steps."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if plain else InputAwareSGD(model, lr=0.1)
    records: list[dict[str, Any]] = []
    return model, opt, Monitor(opt, model if plain else None, every=every, callback=records.append), records


@pytest.mark.parametrize("plain", [False, True])
def test_monitor_every_is_fixed_and_says_so(plain: bool) -> None:
    # It was a plain attribute: set mid-run, an input-aware optimizer's Monitor ignored it and a plain
    # one's logged a step whose statistics the hooks had not been armed for (no module statistics).
    model, opt, monitor, records = _sgd_monitor(plain, every=2)
    with pytest.raises(AttributeError, match=r"fixed at construction.*attach a new one"):
        monitor.every = 1
    for step in range(3):
        opt.zero_grad()
        model(batch(step)).sum().backward()
        opt.step()
    assert monitor.every == 2 and [r["step"] for r in records] == [0, 2]
    assert all(r["modules"] for r in records)
    monitor.remove()


def _monitored_run(
    plain: bool, every: int, steps: range, state: dict[str, Any] | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``steps`` AdamW steps of ``mlp()`` on ``batch(step)`` under a Monitor, from ``state`` (model, optimizer
    and monitor state dicts) if given; the records and the state after."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01) if plain else InputAwareAdamW(model, lr=0.01)
    records: list[dict[str, Any]] = []
    monitor = Monitor(opt, model if plain else None, every=every, callback=records.append)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        monitor.load_state_dict(state["monitor"])
    for step in steps:
        opt.zero_grad()
        model(batch(step)).sum().backward()
        opt.step()
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict(), "monitor": monitor.state_dict()}
    monitor.remove()
    assert monitor.state_dict() == saved["monitor"]  # (what a removed Monitor says: where it stopped)
    return records, saved


@pytest.mark.parametrize("plain", [False, True])
@given(every=st.integers(1, 4), split=st.integers(0, 7))
def test_a_resumed_monitor_logs_what_the_run_without_a_break_logs(plain: bool, every: int, split: int) -> None:
    # It numbered its steps from 0 again: a resumed raw loop logged over the first run's steps.
    whole, _ = _monitored_run(plain, every, range(8), None)
    first, state = _monitored_run(plain, every, range(split), None)
    assert state["monitor"] == {"step": split}
    second, state = _monitored_run(plain, every, range(split, 8), state)
    assert state["monitor"] == {"step": 8}
    assert [r["step"] for r in whole] == list(range(0, 8, every))
    assert first + second == whole  # the same steps, statistics and norms, bit for bit


@pytest.mark.parametrize("plain", [False, True])
def test_monitor_load_state_dict_refuses_bad_steps_and_a_step_half_taken(plain: bool) -> None:
    model, opt, monitor, records = _sgd_monitor(plain, every=2)
    for bad in ({"step": -1}, {"step": 1.0}, {"step": True}, {}, [3]):
        with pytest.raises(ValueError, match=r"takes \{'step': n\}"):
            monitor.load_state_dict(bad)  # type: ignore[arg-type]
    model(batch(0)).sum().backward()
    with pytest.raises(RuntimeError, match="backward has run already"):
        monitor.load_state_dict({"step": 5})
    assert monitor.state_dict() == {"step": 0}  # nothing changed: this step is still logged as step 0
    opt.step()
    assert [r["step"] for r in records] == [0] and records[0]["modules"]
    monitor.load_state_dict({"step": 5})  # between steps: the coming one is 5, not logged (every 2)
    for step in range(2):
        opt.zero_grad()
        model(batch(step)).sum().backward()
        opt.step()
    assert [r["step"] for r in records] == [0, 6] and records[1]["modules"]
    monitor.remove()
    with pytest.raises(RuntimeError, match="was removed"):
        monitor.load_state_dict({"step": 0})


@pytest.mark.parametrize("tool", ["Monitor", "NonFiniteFinder"])
@pytest.mark.parametrize("plain", [False, True])
def test_a_step_saved_as_a_numpy_integer_or_a_0d_tensor_loads(tool: str, plain: bool) -> None:
    # Refused before: checkpoints (and Lightning's and Hugging Face's state) often hold the step as
    # np.int64 or a 0-d tensor. Any integral number >= 0 loads, as an int; bools, floats and negatives do not.
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if plain else InputAwareSGD(model, lr=0.1)
    made = Monitor(opt, model if plain else None) if tool == "Monitor" else NonFiniteFinder(opt, model)
    for step in (np.int64(7), np.uint8(3), torch.tensor(5), torch.tensor(4, dtype=torch.int32), 6):
        made.load_state_dict({"step": step})
        saved = made.state_dict()
        assert saved == {"step": int(step)} and type(saved["step"]) is int
    for bad in (
        np.bool_(True), torch.tensor(True), True, 2.0, np.float64(2.0), torch.tensor(2.0),
        np.int64(-1), torch.tensor(-1), torch.tensor([3]), "3",
    ):  # fmt: skip
        with pytest.raises(ValueError, match=r"takes \{'step': n\} with n an integer >= 0"):
            made.load_state_dict({"step": bad})
    assert made.state_dict() == {"step": 6}
    opt.zero_grad()
    model(batch(0)).sum().backward()
    opt.step()
    assert made.state_dict() == {"step": 7}
    made.remove()


def test_a_step_hooks_coming_step_renumbers_its_interval() -> None:
    model = mlp()
    opt = InputAwareSGD(model, lr=0.1)
    seen: list[int] = []
    handle = opt.register_inputs_hook(lambda o, inputs: seen.append(handle.step), every=4, reads=None)
    assert handle.coming_step == 0
    handle.coming_step = 6
    for step in range(7):
        opt.zero_grad()
        model(batch(step)).sum().backward()
        opt.step()
    assert seen == [8, 12] and handle.coming_step == 13
    with pytest.raises(ValueError, match="coming_step"):
        handle.coming_step = -2
    handle.remove()


RULES = {
    "InputAwareSGD": lambda m: InputAwareSGD(m, lr=0.1, momentum=0.9),
    "FOOF": lambda m: FOOF(m, lr=0.05, update_every=2),
    "KFAC": lambda m: KFAC(m, lr=0.05, update_every=2, damping=1e-2),
    "NLMS": lambda m: NLMS(m, lr=0.1),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_monitoring_changes_nothing_about_training(rule: str) -> None:
    trained = []
    for monitored in (False, True):
        model = mlp()
        opt = RULES[rule](model)
        if monitored:
            Monitor(opt, every=2, grad_outputs=True)
            NonFiniteFinder(opt)
            opt.register_inputs_hook(lambda o, i: None, every=3)
        for step in range(5):
            opt.zero_grad()
            model(batch(step)).pow(2).mean().backward()
            opt.step()
        trained.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*trained, strict=True):
        assert torch.equal(a, b), rule


class Mixed(nn.Module):
    """An embedding, Linear layers and a LayerNorm: no rule's scope holds them all."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.hidden = nn.Embedding(20, 8), nn.Linear(8, 16)
        self.norm, self.head = nn.LayerNorm(16), nn.Linear(16, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(torch.tanh(self.norm(self.hidden(self.embed(tokens)))))


SCOPED = {
    "LazyAdamW": lambda m: LazyAdamW(m, lr=0.01),
    "FOOF": lambda m: FOOF(m, lr=0.05, update_every=2),
    "KFAC": lambda m: KFAC(m, lr=0.05, update_every=2, damping=1e-2),
    "Eva": lambda m: Eva(m, lr=0.05),
    "NLMS": lambda m: NLMS(m, lr=0.1),
}


@pytest.mark.parametrize("rule", list(SCOPED))
def test_monitor_sees_every_trained_module_whatever_the_rules_scope(rule: str) -> None:
    # A rule watches only the layers it reads (LazyAdamW its embeddings, K-FAC its Linear layers); a
    # Monitor on it reads every module owning a trained parameter, as on the drop-in, and once it is
    # removed the capture and the model's hooks are the rule's alone again.
    logged, hooks = {}, {}
    for name in ("InputAwareAdamW", rule):
        model = Mixed()
        opt = SCOPED[name](model) if name in SCOPED else InputAwareAdamW(model, lr=0.01)
        alone = opt.capture.modules
        before = {(n, a): list(getattr(m, a)) for n, m in model.named_modules() for a in HOOK_DICTS}
        monitor = Monitor(opt)
        tokens = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(1))
        opt.zero_grad()
        model(tokens).sum().backward()
        opt.step()
        logged[name] = monitor.last["modules"]
        monitor.remove()
        assert opt.capture.modules == alone, name
        hooks[name] = ({(n, a): list(getattr(m, a)) for n, m in model.named_modules() for a in HOOK_DICTS}, before)
    assert set(logged[rule]) == {"hidden", "norm", "head"}  # (the embedding's inputs are integers)
    assert logged[rule] == logged["InputAwareAdamW"]
    after, before = hooks[rule]
    assert after == before


def test_a_param_group_added_under_a_monitor_is_monitored_and_its_modules_unwatched_after() -> None:
    model = Mixed()
    opt = KFAC(model, lr=0.05, params=model.hidden.parameters())
    monitor = Monitor(opt)
    opt.add_param_group({"params": [*model.norm.parameters(), *model.head.parameters()]})
    tokens = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(1))
    opt.zero_grad()
    model(tokens).sum().backward()
    opt.step()
    assert set(monitor.last["modules"]) == {"hidden", "norm", "head"}
    monitor.remove()
    assert opt.capture.modules == (model.hidden, model.head)  # K-FAC's own layers, the new one included


@pytest.mark.parametrize("rule", ["LazyAdamW", "KFAC"])
def test_a_hook_reading_calls_gets_every_trained_modules_calls_whatever_the_rules_scope(rule: str) -> None:
    seen = {}
    for name in ("InputAwareAdamW", rule):
        model = Mixed()
        opt = SCOPED[name](model) if name in SCOPED else InputAwareAdamW(model, lr=0.01)
        got: list[tuple[str, Tensor]] = []
        handle = opt.register_inputs_hook(
            lambda o, i, got=got: got.extend((o.capture.name(c.module), c.args[0]) for c in i.calls)
        )
        opt.zero_grad()
        model(torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(1))).sum().backward()
        opt.step()
        handle.remove()
        seen[name] = got
    assert [n for n, _ in seen[rule]] == [n for n, _ in seen["InputAwareAdamW"]] == ["embed", "hidden", "norm", "head"]
    for (_, a), (_, b) in zip(seen[rule], seen["InputAwareAdamW"], strict=True):
        assert torch.equal(a, b)


def test_monitor_keeps_no_input_between_forward_and_step() -> None:
    model = mlp()
    opt = InputAwareSGD(model, lr=0.1)
    monitor = Monitor(opt, grad_outputs=True)
    activations: list[weakref.ref[Tensor]] = []
    model[2].register_forward_pre_hook(lambda m, args: activations.append(weakref.ref(args[0])))
    for step in range(3):
        opt.zero_grad()
        model(batch(step)).sum().backward()
        gc.collect()
        assert activations[-1]() is None  # freed by backward: the monitor holds only its statistics
        opt.step()
    assert monitor.last is not None and monitor.last["step"] == 2


# -- sinks ----------------------------------------------------------------------------------


def train(monitor_kwargs: dict[str, Any], steps: int = 3) -> tuple[nn.Module, Monitor]:
    model = Reused()
    opt = InputAwareSGD(model, lr=0.05)
    monitor = Monitor(opt, **monitor_kwargs)
    for step in range(steps):
        opt.zero_grad()
        model(batch(step)).pow(2).mean().backward()
        opt.step()
    return model, monitor


def test_tensorboard_event_file_holds_the_expected_tags(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, monitor = train({"tensorboard": tmp_path / "runs", "grad_outputs": True})
    monitor.remove()
    events = EventAccumulator(str(tmp_path / "runs"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for module in ("first", "shared", "out"):
        for statistic in ("mean", "rms", "max_abs", "zero_fraction", "nonfinite"):
            assert f"input_{statistic}/{module}" in tags
            assert f"grad_output_{statistic}/{module}" in tags
    for name in ("first.weight", "shared.bias", "out.weight"):
        for statistic in ("grad_norm", "update_norm", "update_to_weight"):
            assert f"{statistic}/{name}" in tags
    assert [e.step for e in events.Scalars("input_rms/shared")] == [0, 1, 2]


def test_jsonl_csv_and_callback_carry_the_same_records(tmp_path: Path) -> None:
    records: list[dict[str, Any]] = []
    _, monitor = train({"jsonl": tmp_path / "log.jsonl", "csv": tmp_path / "log.csv", "callback": records.append})
    monitor.remove()
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert lines == records and len(records) == 3
    rows = (tmp_path / "log.csv").read_text().splitlines()
    assert rows[0] == "step,kind,name,statistic,value"
    step, kind, name, statistic, value = rows[1].split(",")
    table = records[0]["modules" if kind == "module" else "parameters"]
    assert int(step) == 0 and float(value) == table[name][statistic]
    assert len(rows) == 1 + sum(len(s) for r in records for t in ("modules", "parameters") for s in r[t].values())


def test_plot_command_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    train({"jsonl": tmp_path / "log.jsonl"})[1].remove()
    out = tmp_path / "out.png"
    finished = subprocess.run(
        [sys.executable, "-m", "inputaware_optim", "plot", str(tmp_path / "log.jsonl"), "-o", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert finished.returncode == 0, finished.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the first non-finite value -------------------------------------------------------------


@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("call", [0, 1])
@pytest.mark.parametrize("optimizer", ["InputAwareSGD", "torch.optim.SGD"])
def test_nonfinite_finder_names_the_module_and_call(phase: str, call: int, optimizer: str) -> None:
    model = Reused()
    if optimizer == "InputAwareSGD":
        opt: torch.optim.Optimizer = InputAwareSGD(model, lr=0.1)
        finder = NonFiniteFinder(opt)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        finder = NonFiniteFinder(opt, model)
    for step in range(2):  # (after a non-finite step the weights are not finite either)
        if step == 1:
            setattr(model.poison, f"{phase}_at", call)
        opt.zero_grad()
        model(batch(step)).sum().backward()
        if step == 1:
            with pytest.warns(NonFiniteWarning, match=rf"step 1: poison \(call {call}\) in the {phase}"):
                opt.step()
            model.poison.forward_at = model.poison.backward_at = None
        else:
            opt.step()
    assert finder.found is not None
    assert (finder.found.module, finder.found.call, finder.found.step, finder.found.phase) == (
        "poison",
        call,
        1,
        phase,
    )
    finder.remove()


@pytest.mark.parametrize("optimizer", ["InputAwareSGD", "SGD"])
def test_the_finder_watches_a_module_put_into_the_model_after_it_was_built(optimizer: str) -> None:
    """A layer swapped in mid-run (a new head, a module replaced for an experiment) is watched from the
    next step: its NaN is named, not left to whichever watched module it reaches next."""
    model = Reused()
    opt: torch.optim.Optimizer = (
        InputAwareSGD(model, lr=0.1) if optimizer == "InputAwareSGD" else torch.optim.SGD(model.parameters(), lr=0.1)
    )
    finder = NonFiniteFinder(opt, action="raise") if optimizer == "InputAwareSGD" else NonFiniteFinder(opt, model)
    finder.action = "raise"
    opt.zero_grad()
    model(batch(0)).sum().backward()
    opt.step()
    model.poison = Poison()  # replaces the old one: a new module the finder has not seen
    model.poison.forward_at = 0
    opt.zero_grad()
    model(batch(1)).sum().backward()
    with pytest.raises(NonFiniteError, match="poison"):
        opt.step()
    assert finder.found is not None and (finder.found.module, finder.found.phase) == ("poison", "forward")
    finder.remove()


def test_nonfinite_finder_raises_before_the_update_and_names_data_and_loss() -> None:
    model = Reused()
    opt = InputAwareSGD(model, lr=0.1)
    finder = NonFiniteFinder(opt, action="raise")
    opt.zero_grad()
    model.poison.backward_at = 1
    model(batch(0)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteError, match="poison") as raised:
        opt.step()
    assert raised.value.origin == finder.found
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    model.poison.backward_at = None
    x = batch(1)
    x[2, 1] = math.nan
    opt.zero_grad()
    model(x).sum().backward()
    with pytest.raises(NonFiniteError, match="first"):
        opt.step()
    assert finder.found is not None and (finder.found.module, finder.found.phase) == ("first", "input")
    opt.zero_grad()
    (model(batch(2)).sum() * math.inf).backward()
    with pytest.raises(NonFiniteError, match="gradient of the loss"):
        opt.step()
    assert finder.found.phase == "loss"
    opt.zero_grad()
    model(batch(3)).sum().backward()
    opt.step()  # finite again: a step
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


# -- data parallel --------------------------------------------------------------------------

WORLD, BATCH, STEPS = 2, 8, 2


def ddp_batches() -> list[Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(BATCH, 4, generator=generator) for _ in range(STEPS)]


def monitored_run(model: nn.Module, part: slice, **options: Any) -> list[dict[str, Any]]:
    opt = InputAwareSGD(model, lr=0.1, momentum=0.9, **options)
    monitor = Monitor(opt)
    records = []
    for x in ddp_batches():
        opt.zero_grad()
        model(x[part]).pow(2).mean().backward()
        opt.step()
        records.append(monitor.last)
    monitor.remove()
    return records


def ddp_worker(rank: int, directory: str, port: int) -> None:
    from torch.nn.parallel import DistributedDataParallel

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    local = BATCH // WORLD
    records = monitored_run(DistributedDataParallel(Reused()), slice(rank * local, (rank + 1) * local))
    whole = monitored_run(Reused(), slice(None), process_group=None)  # this rank alone
    for got, want in zip(records, whole, strict=True):
        assert got["modules"].keys() == want["modules"].keys()
        for table in ("modules", "parameters"):
            for name, statistics in want[table].items():
                for statistic, value in statistics.items():
                    assert got[table][name][statistic] == pytest.approx(value, rel=1e-5, abs=1e-7), (name, statistic)
    dist.barrier()
    mark_done(directory, rank)
    os._exit(0)  # see tests/test_distributed.py: gloo's teardown may abort a finished rank


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_ddp_statistics_over_two_ranks_equal_one_process_on_the_whole_batch() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_spawned(ddp_worker, args=(port,), world=WORLD, timeout=120)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_cpu_shortcuts_count_as_the_plain_kernels_do(dtype: torch.dtype) -> None:
    from inputaware_optim.monitor import _cpu_summary, _device_summary

    x = torch.randn(1000, generator=torch.Generator().manual_seed(0), dtype=dtype)
    x[::7] = 0.0
    for values in ({}, {3: -0.0}, {5: math.nan, 9: math.inf}, {2: -math.inf, 4: -0.0}):
        y = x.clone()
        for index, value in values.items():
            y[index] = value
        assert torch.equal(_cpu_summary(y).isnan(), _device_summary(y).isnan())
        torch.testing.assert_close(_cpu_summary(y), _device_summary(y), equal_nan=True, rtol=1e-6, atol=1e-9)


SPECIAL = st.sampled_from([0.0, -0.0, math.nan, math.inf, -math.inf])
VALUES = st.lists(st.floats(-1e6, 1e6, width=32) | SPECIAL, min_size=1, max_size=60)


@given(VALUES, st.sampled_from([torch.float32, torch.float64]))
def test_summary_statistics_equal_float64_by_hand(values: list[float], dtype: torch.dtype) -> None:
    from inputaware_optim.monitor import _describe, _summary

    x = torch.tensor(values, dtype=dtype)
    summary = _summary([x])
    assert summary is not None
    got = {f"input_{k}": v for k, v in _describe(summary.tolist()).items()}
    want = by_hand([x])
    scale = max((abs(v) for v in values if math.isfinite(v)), default=1.0) * len(values)
    for name, value in want.items():
        assert got[f"input_{name}"] == pytest.approx(value, rel=1e-5, abs=1e-6 * scale, nan_ok=True), name


# -- a plain optimizer's closure (issue 19) ------------------------------------------------------


def test_monitor_on_a_plain_optimizer_stepped_with_a_closure_logs_what_the_step_used() -> None:
    model, twin = Reused(), Reused()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    stock = torch.optim.AdamW(twin.parameters(), lr=0.05)
    monitor = Monitor(opt, model, grad_outputs=True)
    reference = Capture(model, grad_outputs=True)
    names = {m: n for n, m in model.named_modules()}
    for step in range(3):

        def closure(net: nn.Module = model, o: Any = opt, step: int = step) -> Tensor:
            net(batch(70 + step)).sum().backward()  # (dropped by the zero_grad below)
            o.zero_grad()
            loss = net(batch(step)).pow(2).mean() / 2
            loss.backward()
            return loss

        weights = {p: p.detach().double().clone() for p in model.parameters()}
        opt.step(closure)
        stock.step(functools.partial(closure, twin, stock))
        calls = reference.calls()
        reference.clear()
        record = monitor.last
        assert record is not None and record["step"] == step
        for module in (model.first, model.shared, model.out):
            mine = [c for c in calls if c.module is module]
            assert len(mine) == (2 if module is model.shared else 1)
            got = record["modules"][names[module]]
            assert_statistics(got, by_hand([c.input for c in mine]), "input")
            assert_statistics(got, by_hand([c.grad_output for c in mine]), "grad_output")
        for name, param in model.named_parameters():
            got = record["parameters"][name]
            update = param.detach().double() - weights[param]
            assert got["grad_norm"] == pytest.approx(param.grad.double().norm().item(), rel=1e-6)
            assert got["update_norm"] == pytest.approx(update.norm().item(), rel=1e-5, abs=1e-9)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)  # monitoring changed nothing about training
    monitor.remove()


def test_monitor_leaves_an_lbfgs_closure_as_it_was() -> None:
    trained = []
    for monitored in (False, True):
        model = mlp()
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
        records: list[dict[str, Any]] = []
        if monitored:
            Monitor(opt, model, callback=records.append)
        for step in range(3):

            def closure(step: int = step, opt: Any = opt, model: nn.Module = model) -> Tensor:
                opt.zero_grad()
                loss = model(batch(step)).pow(2).mean()
                loss.backward()
                return loss

            opt.step(closure)
        trained.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*trained, strict=True):
        assert torch.equal(a, b)  # each evaluation of the closure recomputed the loss
    assert [r["step"] for r in records] == [0, 1, 2]
    assert set(records[-1]["modules"]) == {"0", "2"}


def test_finder_checks_the_gradient_of_a_plain_optimizers_closure() -> None:
    model = Reused()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    finder = NonFiniteFinder(opt, model)

    def closure() -> Tensor:
        opt.zero_grad()
        loss = model(batch(0)).sum()
        loss.backward()
        return loss

    opt.step(closure)
    model.poison.backward_at = 1
    with pytest.warns(NonFiniteWarning, match=r"step 1: poison \(call 1\) in the backward"):
        opt.step(closure)
    assert finder.found is not None and finder.found.step == 1
    finder.remove()


@pytest.mark.parametrize("plain", [False, True])
def test_a_resumed_finder_reports_the_step_of_the_run_without_the_break(plain: bool) -> None:
    # Its reports numbered steps from 0 again: a non-finite step 1003 of a resumed run was reported as step 3.
    def attach(state: dict[str, int] | None) -> tuple[Reused, torch.optim.Optimizer, NonFiniteFinder]:
        model = Reused()
        opt = torch.optim.SGD(model.parameters(), lr=0.1) if plain else InputAwareSGD(model, lr=0.1)
        finder = NonFiniteFinder(opt, model if plain else None)
        if state is not None:
            finder.load_state_dict(state)
        return model, opt, finder

    model, opt, finder = attach(None)
    for step in range(2):
        opt.zero_grad()
        model(batch(step)).sum().backward()
        opt.step()
    saved = finder.state_dict()
    finder.remove()
    assert saved == {"step": 2}
    model, opt, finder = attach(saved)
    for bad in ({"step": -1}, {"step": 2.0}, {}, None):
        with pytest.raises(ValueError, match=r"takes \{'step': n\}"):
            finder.load_state_dict(bad)  # type: ignore[arg-type]
    model.poison.backward_at = 1
    opt.zero_grad()
    model(batch(2)).sum().backward()
    with pytest.warns(NonFiniteWarning, match=r"step 2: poison \(call 1\) in the backward"):
        opt.step()
    assert finder.found is not None and finder.found.step == 2 and finder.state_dict() == {"step": 3}
    finder.remove()


@pytest.mark.parametrize("plain", [False, True])
def test_a_step_the_finder_refuses_is_not_counted_by_it_either(plain: bool) -> None:
    # The finder counted the step it refused: one ahead of the Monitor's and the optimizer's count from
    # then on, and the offset was saved in its state_dict and resumed.
    model = Reused()
    opt: torch.optim.Optimizer = (
        torch.optim.AdamW(model.parameters(), lr=0.01) if plain else InputAwareAdamW(model, lr=0.01)
    )
    monitor = Monitor(opt, model if plain else None)
    finder = NonFiniteFinder(opt, model if plain else None, action="raise")
    for step in range(3):
        opt.zero_grad()
        loss = model(batch(step)).sum()
        if step == 1:
            (loss * math.inf).backward()
            with pytest.raises(NonFiniteError, match="step 1: every module's output was finite"):
                opt.step()
        else:
            loss.backward()
            opt.step()
    taken = int(opt.state[model.out.weight]["step"])
    assert taken == 2 and finder.state_dict() == monitor.state_dict() == {"step": taken}
    saved = finder.state_dict()
    finder.remove()
    finder = NonFiniteFinder(opt, model if plain else None)  # resumed: warns
    finder.load_state_dict(saved)
    model.poison.backward_at = 1
    opt.zero_grad()
    model(batch(3)).sum().backward()
    with pytest.warns(NonFiniteWarning, match=r"step 2: poison \(call 1\) in the backward"):
        opt.step()
    assert monitor.last is not None and monitor.last["step"] == 2 == int(opt.state[model.out.weight]["step"]) - 1
    assert finder.state_dict() == monitor.state_dict() == {"step": 3}
    finder.remove()
    monitor.remove()


@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle"])
@pytest.mark.parametrize("plain", [False, True])
def test_a_copy_of_a_tool_is_refused_naming_what_to_do_and_that_works(plain: bool, how: str) -> None:
    # deepcopy((model, optimizer, monitor)) gave a Monitor attached to nothing (the copied optimizer is built
    # without its hooks): it never logged, with no word. Pickling failed on a weakref, naming neither.
    copier = {"deepcopy": copy.deepcopy, "copy": copy.copy, "pickle": lambda x: pickle.loads(pickle.dumps(x))}[how]
    model = mlp()
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if plain else InputAwareSGD(model, lr=0.1)
    tools = {"Monitor": Monitor(opt, model if plain else None), "NonFiniteFinder": NonFiniteFinder(opt, model)}
    for step in range(2):
        opt.zero_grad()
        model(batch(step)).sum().backward()
        opt.step()
    for name, tool in tools.items():
        refused = rf"a {name} attached to an optimizer cannot be copied or pickled.*attach a new {name} to the copy"
        with pytest.raises(TypeError, match=refused):
            copier((model, opt, tool) if how != "copy" else tool)  # (copy.copy of a tuple shares its items)
    # What the error says to do: the model and the optimizer copy with the tools attached; attach anew.
    copied_model, copied = copy.deepcopy((model, opt)) if how != "pickle" else pickle.loads(pickle.dumps((model, opt)))
    monitor = Monitor(copied, copied_model if plain else None)
    finder = NonFiniteFinder(copied, copied_model)
    monitor.load_state_dict(tools["Monitor"].state_dict())
    finder.load_state_dict(tools["NonFiniteFinder"].state_dict())
    for m, o in ((model, opt), (copied_model, copied)):
        o.zero_grad()
        m(batch(2)).sum().backward()
        o.step()
    assert monitor.last is not None and tools["Monitor"].last is not None
    assert monitor.last["step"] == tools["Monitor"].last["step"] == 2
    assert monitor.last["parameters"] == tools["Monitor"].last["parameters"]
    assert finder.state_dict() == tools["NonFiniteFinder"].state_dict() == {"step": 3}
    for tool in (monitor, finder, *tools.values()):
        tool.remove()


# -- lifecycle (issue 19) -------------------------------------------------------------------------

HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def assert_as_it_was(model: nn.Module) -> None:
    for name, module in model.named_modules():
        for attribute in HOOK_DICTS:
            assert not getattr(module, attribute), (name, attribute)
    for name, param in model.named_parameters():
        assert not param._backward_hooks and not getattr(param, "_post_accumulate_grad_hooks", None), name


@pytest.mark.parametrize("ending", ["del", "remove"])
@pytest.mark.parametrize("tools", ["Monitor", "NonFiniteFinder", "both"])
@pytest.mark.parametrize("optimizer", ["InputAwareAdamW", "torch.optim.AdamW"])
def test_dropping_the_tools_and_their_optimizer_leaves_the_model_as_it_was(
    optimizer: str, tools: str, ending: str
) -> None:
    model = Reused()
    plain = optimizer == "torch.optim.AdamW"
    opt: Any = torch.optim.AdamW(model.parameters(), lr=0.01) if plain else InputAwareAdamW(model, lr=0.01)
    made: list[Any] = []
    if tools in ("Monitor", "both"):
        made.append(Monitor(opt, model, grad_outputs=True) if plain else Monitor(opt, grad_outputs=True))
    if tools in ("NonFiniteFinder", "both"):
        made.append(NonFiniteFinder(opt, model) if plain else NonFiniteFinder(opt))
    for step in range(2):
        opt.zero_grad()
        model(batch(step)).sum().backward()
        opt.step()
    model(batch(9)).sum()  # a forward left half-way (never backpropagated)
    if ending == "remove":
        for each in made:
            each.remove()
        assert_as_it_was(model)
        del each
    refs = [weakref.ref(opt), *(weakref.ref(tool) for tool in made)]
    del opt, made
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
    assert_as_it_was(model)
    model(batch(0)).sum().backward()  # and it trains as a plain model


# -- statistics a module's gradient holds (issue 21, item 4) -------------------------------------


@pytest.mark.parametrize("optimizer", ["InputAwareAdamW", "torch.optim.AdamW"])
def test_a_module_with_a_frozen_weight_and_a_trained_bias_is_logged(optimizer: str) -> None:
    model = Reused()
    model.shared.weight.requires_grad_(False)
    if optimizer == "InputAwareAdamW":
        opt: torch.optim.Optimizer = InputAwareAdamW(model, lr=0.05)
        monitor = Monitor(opt, grad_outputs=True)
    else:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
        monitor = Monitor(opt, model, grad_outputs=True)
    reference = Capture(model, grad_outputs=True)
    opt.zero_grad()
    model(batch(0)).sum().backward()
    calls = [c for c in reference.calls() if c.module is model.shared]
    opt.step()
    assert monitor.last is not None and len(calls) == 2
    got = monitor.last["modules"]["shared"]
    assert_statistics(got, by_hand([c.input for c in calls]), "input")
    assert_statistics(got, by_hand([c.grad_output for c in calls]), "grad_output")
    assert "shared.bias" in monitor.last["parameters"] and "shared.weight" not in monitor.last["parameters"]
    monitor.remove()


@pytest.mark.parametrize("optimizer", ["InputAwareAdamW", "AdamW"])
def test_parameters_are_logged_by_the_names_the_model_gives_them_at_that_step(optimizer: str) -> None:
    """Pruning mid-run registers the weight as ``weight_orig`` (the same tensor): the log says so from that
    step on, not the name it had when the Monitor was built; a layer added since is named too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    if optimizer == "InputAwareAdamW":
        opt: torch.optim.Optimizer = InputAwareAdamW(model, lr=0.05)
        monitor = Monitor(opt)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        monitor = Monitor(opt, model)

    def step() -> dict[str, Any]:
        opt.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        assert monitor.last is not None
        return monitor.last["parameters"]

    assert set(step()) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    assert set(step()) == {"0.weight_orig", "0.bias", "2.weight", "2.bias"}
    model.add_module("head", nn.Linear(3, 2))
    assert monitor.capture.name(model.head) == "head"
    monitor.remove()


@pytest.mark.parametrize("optimizer", ["InputAwareAdamW", "AdamW"])
def test_output_gradient_statistics_under_a_grad_scaler_are_the_unscaled_losss(optimizer: str) -> None:
    """With ``grad_scaler=`` the output gradients are logged as the unscaled loss's (they carry the scale
    otherwise: 1024x here, silently, on a plain optimizer); the parameter statistics are alike either way."""
    records = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=1024.0)):
        model = Reused()
        if optimizer == "InputAwareAdamW":
            opt: torch.optim.Optimizer = InputAwareAdamW(model, lr=0.05)
            monitor = Monitor(opt, grad_outputs=True, grad_scaler=scaler)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=0.05)
            monitor = Monitor(opt, model, grad_outputs=True, grad_scaler=scaler)
        loss = model(batch(0)).square().mean()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
        assert monitor.last is not None
        records.append(monitor.last)
    unscaled, scaled = records
    assert scaled["modules"].keys() == unscaled["modules"].keys()
    for kind in ("modules", "parameters"):
        for name, statistics in unscaled[kind].items():
            assert scaled[kind][name] == pytest.approx(statistics, rel=1e-6), name


def test_a_monitor_refuses_a_grad_scaler_other_than_its_optimizers() -> None:
    model = Reused()
    opt = InputAwareAdamW(model, lr=0.05, grad_scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="another GradScaler"):
        Monitor(opt, grad_outputs=True, grad_scaler=torch.amp.GradScaler("cpu"))


def test_the_tools_on_a_private_optimizer_warn_that_what_they_read_is_not_private() -> None:
    from inputaware_optim import DPSGD

    model = nn.Sequential(nn.Linear(4, 3))
    with pytest.warns(UserWarning, match=r"^Monitor on DPSGD: .* which the privacy guarantee does not cover") as caught:
        Monitor(DPSGD(model, lr=0.1))
    assert caught[0].filename == __file__  # (the caller's line)
    with pytest.warns(UserWarning, match=r"^NonFiniteFinder on DPSGD: .*skips a step.* privacy guarantee does not"):
        NonFiniteFinder(DPSGD(model, lr=0.1), action="raise")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Monitor(InputAwareSGD(model, lr=0.1))
        NonFiniteFinder(InputAwareSGD(model, lr=0.1))


@pytest.mark.parametrize("scale", [1e37, 3e20])  # the sum overflows float32; the sum of squares only
def test_finite_inputs_whose_sums_overflow_are_logged_as_float64_computes_them(scale: float) -> None:
    model = nn.Sequential(nn.Linear(4, 3))
    opt = InputAwareSGD(model, lr=0.0)
    monitor = Monitor(opt)
    x = (torch.rand(200, 4, generator=torch.Generator().manual_seed(0)) + 0.5) * scale
    x[0, 0] = 0.0
    opt.zero_grad()
    (model(x) * 0).sum().backward()
    opt.step()
    assert monitor.last is not None
    got, want = monitor.last["modules"]["0"], by_hand([x])
    assert all(math.isfinite(v) for v in want.values())
    assert_statistics(got, want, "input")
    monitor.remove()


# -- a forward that never reached a backward (issue 21, item 5) ----------------------------------


@pytest.mark.parametrize("kept", [False, True])
@pytest.mark.parametrize("optimizer", ["InputAwareSGD", "torch.optim.SGD"])
def test_finder_ignores_a_nan_of_a_forward_that_never_reached_a_backward(optimizer: str, kept: bool) -> None:
    model = Reused()
    if optimizer == "InputAwareSGD":
        opt: torch.optim.Optimizer = InputAwareSGD(model, lr=0.1)
        finder = NonFiniteFinder(opt)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        finder = NonFiniteFinder(opt, model)
    model.poison.forward_at = 0
    validation = model(batch(5))  # an evaluation with grad enabled, NaN in poison's forward
    assert not torch.isfinite(validation).all()
    if not kept:
        del validation
    model.poison.forward_at, model.poison.backward_at = None, 1
    opt.zero_grad()
    model(batch(0)).sum().backward()
    with pytest.warns(NonFiniteWarning, match=r"step 0: poison \(call 1\) in the backward"):
        opt.step()
    assert finder.found is not None and (finder.found.module, finder.found.call, finder.found.phase) == (
        "poison",
        1,
        "backward",
    )
    finder.remove()


# -- cost (issue 22) ------------------------------------------------------------------------------


class Block(nn.Module):
    """A module with a parameter of its own whose input is its first child's, and three children fed one tensor."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.scale = nn.Parameter(torch.ones(8))
        self.norm = nn.LayerNorm(8)
        self.query, self.key, self.value = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        scores = torch.softmax(self.query(h) @ self.key(h).T, dim=-1)
        return (scores @ self.value(h)) * self.scale


def test_monitor_summarises_each_tensor_once_per_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    from inputaware_optim import monitor as monitor_module

    model = Block()
    opt = InputAwareAdamW(model, lr=0.01)
    monitor = Monitor(opt)
    reference = Capture(model)
    summarised: list[Tensor] = []
    original = monitor_module._summarize
    monkeypatch.setattr(monitor_module, "_summarize", lambda t: summarised.append(t) or original(t))
    names = {m: n or "Block" for n, m in model.named_modules()}
    for step in range(2):
        opt.zero_grad()
        for micro in range(2):
            model(torch.randn(5, 8, generator=torch.Generator().manual_seed(10 * step + micro))).sum().backward()
        calls = reference.calls()
        opt.step()
        reference.clear()
        # x for the block and the norm, h for query, key and value: two summaries per forward, not five
        assert len(summarised) == 4 * (step + 1)
        record = monitor.last
        assert record is not None
        for module in (model, model.norm, model.query, model.key, model.value):
            mine = [c for c in calls if c.module is module]
            assert len(mine) == 2
            want = by_hand([c.input for c in mine])  # (float32 sums: a mean near 0 is exact to 1e-7 of the RMS)
            assert_statistics(record["modules"][names[module]], want, "input", absolute=1e-7 * want["rms"])
    monitor.remove()


def test_monitor_tells_a_tensor_changed_in_place_from_the_one_summarised() -> None:
    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
            self.first.weight.requires_grad_(False)  # (so that autograd does not keep x for it)

        def forward(self, x: Tensor) -> Tensor:
            y = self.first(x)
            x.mul_(3.0)  # same storage, view and shape: only the version tells
            return self.second(x) + y

    model = InPlace()
    opt = InputAwareSGD(model, lr=0.0)
    monitor = Monitor(opt)
    x = batch(0)
    want = {"first": by_hand([x]), "second": by_hand([3.0 * x])}
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    assert monitor.last is not None
    for name, statistics in want.items():  # (a stale summary would be 3 times off)
        assert_statistics(monitor.last["modules"][name], statistics, "input", absolute=1e-6)
    monitor.remove()


def test_finder_hooks_only_the_modules_that_compute() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), Block(), nn.Linear(8, 2))
    model[0][0] = nn.Linear(4, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    finder = NonFiniteFinder(opt, model)
    hooked = {n for n, m in model.named_modules() if m._forward_hooks}
    assert hooked == {"0.0", "0.1", "1", "1.norm", "1.query", "1.key", "1.value", "2"}
    assert {n for n, m in model.named_modules() if m._forward_pre_hooks} == {""}
    finder.remove()
    assert_as_it_was(model)


@pytest.mark.parametrize("optimizer", ["InputAwareAdamW", "torch.optim.AdamW"])
def test_monitor_and_finder_share_one_capture_one_hook_per_module(optimizer: str) -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), Block(), nn.Linear(8, 2))
    plain = optimizer == "torch.optim.AdamW"
    opt: Any = torch.optim.AdamW(model.parameters(), lr=0.01) if plain else InputAwareAdamW(model, lr=0.01)
    monitor = Monitor(opt, model) if plain else Monitor(opt)
    finder = NonFiniteFinder(opt, monitor.capture) if plain else NonFiniteFinder(opt)
    assert finder.capture is monitor.capture
    computing = {"0.0", "0.1", "1", "1.norm", "1.query", "1.key", "1.value", "2"}
    assert {n for n, m in model.named_modules() if m._forward_hooks} == computing
    assert all(len(m._forward_hooks) == 1 for m in model.modules() if m._forward_hooks)  # the capture's, once
    assert len(model._forward_pre_hooks) == 1
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    assert monitor.last is not None and finder.found is None
    finder.remove()  # the parameterless modules only the finder watched lose their hook; the rest stay
    owners = {n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))}
    assert {n for n, m in model.named_modules() if m._forward_hooks} == owners
    monitor.remove()
    assert_as_it_was(model)


def test_per_tensor_norms_equal_vector_norm_and_torch_still_has_its_fused_form() -> None:
    from inputaware_optim.monitor import _per_tensor_norms
    from inputaware_optim.nonfinite import _all_finite

    tensors = [
        torch.randn(*shape, generator=torch.Generator().manual_seed(i))
        for i, shape in enumerate([(3,), (4, 5), (2, 3, 4)])
    ]
    want = [torch.linalg.vector_norm(t) for t in tensors]
    for got, expected in zip(_per_tensor_norms(tensors), want, strict=True):
        torch.testing.assert_close(got, expected)
    # The private multi-tensor norm used on accelerators (tests/test_torch_assumptions.py pins it too).
    from inputaware_optim._torch import foreach_norm

    fused = foreach_norm(tensors)
    for got, expected in zip(fused, want, strict=True):
        torch.testing.assert_close(got, expected)
    big = torch.full((100,), 1e37)
    assert _all_finite([big, tensors[0]])  # its sum overflows, its values are finite
    big[3] = math.nan
    assert not _all_finite([tensors[0], big])


# -- the picture (issue 23) -----------------------------------------------------------------------


def test_the_picture_names_layers_has_a_title_colour_bars_and_shows_zero_as_a_value() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from inputaware_optim.plot import PLOTTED, _figure

    records: list[dict[str, Any]] = []
    model = mlp()
    opt = InputAwareSGD(model, lr=0.1)
    with Monitor(opt, callback=records.append):
        for step in range(3):
            opt.zero_grad()
            model(batch(step)).sum().backward()
            if step == 1:
                model[2].bias.grad = None  # a parameter without a step: missing from this record
            if step == 2:
                model[2].weight.grad.zero_()  # an update of exactly zero
            opt.step()
    figure = _figure(records, "run.jsonl")
    assert "run.jsonl" in figure._suptitle.get_text()
    panels = [axis for axis in figure.axes if axis.get_title()]
    assert [axis.get_title() for axis in panels] == [title for _, _, title, _ in PLOTTED]
    assert len(figure.axes) == 2 * len(PLOTTED)  # a colour bar beside each panel
    rows = [label.get_text() for label in panels[0].get_yticklabels()]
    assert rows == ["0 (Linear 8x4)", "2 (Linear 3x8)"]
    ratio = panels[2]
    names = [label.get_text() for label in ratio.get_yticklabels()]
    image = ratio.get_images()[0]
    shown = image.get_array()
    weight = names.index("2.weight (Linear 3x8)")
    bias = names.index("2.bias (Linear 3x8)")
    assert records[2]["parameters"]["2.weight"]["update_to_weight"] == 0.0
    assert not shown.mask[weight, 2] and image.norm(shown[weight, 2]) < 0  # zero: below the range, in its own colour
    assert image.cmap(image.norm(shown[weight, 2])) == matplotlib.colors.to_rgba("black")
    assert shown.mask[bias, 1]  # not logged: masked (grey), told apart from zero
    assert "exactly 0" in figure.axes[-1].get_ylabel()
    plt.close(figure)


BIGGEST = float(torch.finfo(torch.float32).max)
LARGE = st.lists(
    st.floats(-BIGGEST, BIGGEST, width=32) | st.sampled_from([0.0, BIGGEST, -BIGGEST]), min_size=1, max_size=60
)


@given(LARGE)
def test_summaries_of_float32_values_near_its_largest_equal_float64_by_hand(values: list[float]) -> None:
    from inputaware_optim.monitor import _cpu_summary, _describe, _device_summary

    x = torch.tensor(values, dtype=torch.float32)
    want = by_hand([x])
    scale = max(abs(v) for v in values) * len(values)
    for summary in (_cpu_summary(x), _device_summary(x)):  # (the accelerator form, run on CPU)
        got = _describe(summary.tolist())
        for name, value in want.items():
            assert math.isfinite(got[name]), name
            assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6 * scale), name
