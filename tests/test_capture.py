"""What is captured: which calls, in which order, kept how, and released when."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from inputaware_optim import Capture, InputAwareAdamW, InputAwareSGD, Inputs

from .conftest import hooks_on, mlp


class Recorder(InputAwareSGD):
    """A rule that records what it was handed (as plain tensors, so they survive the step)."""

    @torch.no_grad()
    def step(self, closure: Any = None, inputs: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.log = {m: [c.args[0].clone() for c in entry] for m, entry in inputs.items()}
        super().step(inputs=inputs)
        return loss


def test_every_grad_enabled_call_of_each_owning_module_in_order() -> None:
    model = mlp()
    optimizer = Recorder(model, lr=0.1)
    xs = [torch.randn(n, 4) for n in (2, 3, 5)]
    for x in xs:  # gradient accumulation over micro-batches
        model(x).sum().backward()
    with torch.no_grad():
        model(torch.randn(7, 4))
    with torch.inference_mode():
        model(torch.randn(7, 4))
    optimizer.step()
    assert set(optimizer.log) == {model[0], model[2]}
    assert [t.shape[0] for t in optimizer.log[model[0]]] == [2, 3, 5]
    assert all(torch.equal(a, b) for a, b in zip(optimizer.log[model[0]], xs, strict=True))


def test_only_parameter_owners_are_hooked() -> None:
    model = mlp()
    before = hooks_on(model)
    optimizer = InputAwareSGD(model, lr=0.1)
    assert not model[1]._forward_hooks and not model[1]._forward_pre_hooks  # Tanh owns nothing
    assert set(optimizer.capture.modules) == {model[0], model[2]}
    assert not nn.modules.module._global_forward_hooks and not nn.modules.module._global_forward_pre_hooks
    del optimizer
    gc.collect()
    assert hooks_on(model) == before


def test_module_called_twice_and_tied_weights() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.block = nn.Linear(4, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.embed(tokens)
            h = self.block(torch.tanh(self.block(h)))  # the same module twice
            return self.head(h)

    model = Tied()
    capture = Capture(model)
    tokens = torch.tensor([[1, 2, 3]])
    model(tokens).sum().backward()
    inputs = capture.inputs()
    assert len(inputs[model.block]) == 2
    assert [c.module for c in inputs[model.embed.weight]] == [model.embed, model.head]  # both owners, in order
    assert torch.equal(inputs[model.embed.weight].calls[0].args[0], tokens)
    assert inputs[model.head].calls[0].args[0].shape == (1, 3, 4)


def test_args_kwargs_and_detached() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor, scale: float = 1.0, *, shift: torch.Tensor | None = None) -> torch.Tensor:
            y = self.linear(x) * scale
            return y if shift is None else y + shift

    model = Scaled()
    capture = Capture(model, modules=[model])  # a module that owns no parameter, watched by request
    x = torch.randn(2, 3, requires_grad=True)
    shift = torch.randn(3, requires_grad=True)
    model(x, 2.0, shift=shift).sum().backward()
    (call,) = capture.inputs()[model].calls
    assert call.args[1] == 2.0 and call.kwargs["shift"] is not shift
    assert torch.equal(call.kwargs["shift"], shift) and not call.kwargs["shift"].requires_grad
    assert not call.args[0].requires_grad and call.args[0].grad_fn is None
    assert call.args[0].data_ptr() == x.data_ptr()  # zero-copy


def test_in_place_change_after_capture_is_detected() -> None:
    model = mlp()
    capture = Capture(model)
    x = torch.randn(3, 4)
    model(x).sum().backward()
    x.mul_(2)  # the caller reuses its buffer for the next batch
    with pytest.raises(RuntimeError, match=r"modified in place.*storage='clone'"):
        capture.inputs()


@pytest.mark.parametrize("storage", ["clone", "cpu"])
def test_copying_storage_keeps_the_value_that_was_seen(storage: str) -> None:
    model = mlp()
    capture = Capture(model, storage=storage)
    x = torch.randn(3, 4)
    expected = x.clone()
    model(x).sum().backward()
    x.mul_(2)
    (call,) = capture.inputs()[model[0]].calls
    assert torch.equal(call.args[0], expected)
    assert call.args[0].data_ptr() != x.data_ptr()
    assert call.args[0].device.type == "cpu"


def test_forward_that_raises_leaves_nothing_behind() -> None:
    class Fragile(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, fail: bool = False) -> torch.Tensor:
            h = self.a(x)
            if fail:
                raise RuntimeError("out of memory (simulated)")
            return self.b(h)

    model = Fragile()
    capture = Capture(model)
    good = torch.randn(2, 4)
    model(good).sum().backward()
    with pytest.raises(RuntimeError, match="simulated"):
        model(torch.randn(9, 4), fail=True)
    assert [c.module for c in capture.calls()] == [model.a, model.b]
    assert capture.calls()[0].args[0] is not None and capture.calls()[0].args[0].shape[0] == 2
    model(good).sum().backward()
    assert [c.module for c in capture.calls()] == [model.a, model.b, model.a, model.b]


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_delivers_each_call_once(reentrant: bool) -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    capture = Capture(model)
    x = torch.randn(3, 4, requires_grad=True)
    inner = nn.Sequential(*model[:4])
    h = checkpoint(inner, x, use_reentrant=reentrant)
    model[4](h).sum().backward()
    calls = capture.inputs()
    assert [len(calls[m]) for m in (model[0], model[2], model[4])] == [1, 1, 1]
    assert torch.equal(calls[model[0]].calls[0].args[0], x.detach())
    assert torch.allclose(calls[model[2]].calls[0].args[0], torch.tanh(model[0](x)).detach())


def test_captures_are_released_after_step_and_zero_grad() -> None:
    model = mlp()
    optimizer = Recorder(model, lr=0.1)  # a rule that reads raw calls: they are kept until its step
    refs = []

    def keep_ref(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        refs.append(weakref.ref(output))

    handle = model[1].register_forward_hook(keep_ref)  # Tanh's output is model[2]'s input
    loss = model(torch.randn(4, 4)).sum()
    loss.backward()
    del loss
    gc.collect()
    assert refs[0]() is not None  # held by the capture until the step
    optimizer.step()
    gc.collect()
    assert refs[0]() is None and optimizer.capture.calls() == []
    model(torch.randn(4, 4)).sum().backward()
    optimizer.zero_grad()
    assert optimizer.capture.calls() == []
    handle.remove()


@pytest.mark.parametrize("cls", [InputAwareSGD, InputAwareAdamW])
def test_a_drop_in_without_a_rule_holds_nothing_and_attaches_no_hook(cls: type) -> None:
    model = mlp()
    optimizer = cls(model, lr=0.1)
    assert hooks_on(model) == 0 and not optimizer.capture.active
    refs = []
    handle = model[1].register_forward_hook(lambda m, a, out: refs.append(weakref.ref(out)))
    loss = model(torch.randn(4, 4)).sum()
    loss.backward()
    del loss
    gc.collect()
    assert refs[0]() is None  # as with the stock optimizer: autograd freed it, nobody else held it
    optimizer.step()
    handle.remove()


def test_a_watch_by_predicate_follows_modules_put_into_the_model_and_comes_off() -> None:
    """``Capture.watch(select, ...)`` watches what ``select`` picks as the model holds it at each forward:
    a Linear swapped in is seen from its first call, the one it replaced no more; ``remove()`` leaves no hook."""
    model = mlp()
    capture = Capture(model, [])
    seen: list[nn.Module] = []
    handle = capture.watch(lambda m: isinstance(m, nn.Linear), lambda m, args, kwargs, out: seen.append(m))
    model(torch.randn(3, 4)).sum().backward()
    assert seen == [m for m in model if isinstance(m, nn.Linear)]
    old, model[0] = model[0], nn.Linear(4, model[0].out_features)
    seen.clear()
    model(torch.randn(3, 4)).sum().backward()
    assert seen[0] is model[0] and old not in seen and hooks_on(old) == 0
    assert capture.name(model[0]) == "0"
    handle.remove()
    capture.remove()
    assert hooks_on(model) == 0


def test_a_thousand_steps_hold_memory_flat() -> None:
    model = mlp()
    optimizer = InputAwareAdamW(model, lr=1e-3)

    def run(steps: int) -> None:
        for _ in range(steps):
            optimizer.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            optimizer.step()

    run(50)
    gc.collect()
    tensors_before = sum(isinstance(o, torch.Tensor) for o in gc.get_objects())
    objects_before = len(gc.get_objects())
    run(1000)
    gc.collect()
    assert sum(isinstance(o, torch.Tensor) for o in gc.get_objects()) <= tensors_before
    assert len(gc.get_objects()) - objects_before < 100
    assert optimizer.capture.calls() == []


def test_garbage_collected_optimizers_take_their_hooks_along() -> None:
    model = mlp()
    before = hooks_on(model)
    for cls in (InputAwareSGD, InputAwareAdamW, Recorder):
        optimizer = cls(model, lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        assert hooks_on(model) == before + (2 if cls is Recorder else 0) + (cls is Recorder)
        del optimizer
        gc.collect()
        assert hooks_on(model) == before


def test_capture_on_its_own() -> None:
    model = mlp()
    with Capture(model, modules=[model[2]]) as capture:
        model(torch.randn(5, 4)).sum().backward()
        assert capture.modules == (model[2],)
    assert hooks_on(model) == 0  # leaving the block takes the hooks off
    inputs = capture.inputs()
    assert isinstance(inputs, Inputs) and list(inputs) == [model[2]]
    model(torch.randn(5, 4)).sum().backward()
    assert len(capture.inputs()[model[2]]) == 1  # nothing new recorded after remove()
    capture.clear()
    assert capture.calls() == []


def test_capture_refuses_foreign_modules_and_bad_arguments() -> None:
    model = mlp()
    with pytest.raises(ValueError, match="not a submodule"):
        Capture(model, modules=[nn.Linear(2, 2)])
    with pytest.raises(TypeError, match=r"nn\.Module"):
        Capture([model])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="storage"):
        Capture(model, storage="gpu")  # type: ignore[arg-type]


def test_closure_forward_reaches_the_rule() -> None:
    model = mlp()
    optimizer = Recorder(model, lr=0.1)
    model(torch.randn(9, 4)).sum().backward()  # before the closure; zero_grad() inside drops it
    x = torch.randn(3, 4)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert isinstance(loss, torch.Tensor)
    assert [t.shape[0] for t in optimizer.log[model[0]]] == [3]
    assert torch.equal(optimizer.log[model[0]][0], x)


def test_data_parallel_wrapper_is_unwrapped() -> None:
    inner = mlp()
    wrapped = nn.DataParallel(inner)
    optimizer = Recorder(wrapped, lr=0.1)
    wrapped(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    assert set(optimizer.log) == {inner[0], inner[2]}


def test_data_parallel_over_several_devices_is_refused_by_name() -> None:
    wrapped = nn.DataParallel(mlp())
    wrapped.device_ids = [0, 1]  # as on a two-GPU machine: every forward would run on replicas
    with pytest.raises(ValueError, match=r"nn.DataParallel over 2 devices.*DistributedDataParallel"):
        InputAwareSGD(wrapped, lr=0.1)
    with pytest.raises(ValueError, match=r"nn.DataParallel over 2 devices"):
        Capture(wrapped)


def reference_output_grads(model: nn.Module, x: torch.Tensor, modules: list[nn.Module]) -> list[torch.Tensor]:
    """The gradients reaching each module's output, by retain_grad on a plain forward."""
    outputs: list[torch.Tensor] = []

    def keep(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        output.retain_grad()
        outputs.append(output)

    handles = [m.register_forward_hook(keep) for m in modules]
    model(x).pow(2).sum().backward()
    for handle in handles:
        handle.remove()
    model.zero_grad()
    return [o.grad for o in outputs]


def test_output_gradients_match_each_call_even_when_a_module_runs_twice() -> None:
    torch.manual_seed(0)
    block = nn.Linear(4, 4)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), block, nn.Tanh(), block)
    x = torch.randn(5, 3)
    expected = reference_output_grads(model, x, [model[0], block])
    capture = Capture(model, grad_outputs=True)
    model(x).pow(2).sum().backward()
    calls = capture.calls()
    assert [c.module for c in calls] == [model[0], block, block]
    for call, want in zip(calls, expected, strict=True):
        torch.testing.assert_close(call.grad_output, want)
    entry = capture.inputs()[block]
    torch.testing.assert_close(entry.grad_output_rows(), torch.cat(expected[1:]))


@pytest.mark.parametrize("reentrant", [True, False])
def test_output_gradients_under_checkpointing(reentrant: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(5, 3, requires_grad=True)
    expected = reference_output_grads(model, x, [model[0], model[2]])
    capture = Capture(model, grad_outputs=True)
    h = checkpoint(nn.Sequential(model[0], model[1]), x, use_reentrant=reentrant)
    model[2](h).pow(2).sum().backward()
    grads = {c.module: c.grad_output for c in capture.calls()}
    assert len(capture.calls()) == 2
    torch.testing.assert_close(grads[model[0]], expected[0])
    torch.testing.assert_close(grads[model[2]], expected[1])


def test_output_gradients_accumulate_over_micro_batches_in_order() -> None:
    model = mlp()
    xs = [torch.randn(n, 4) for n in (2, 3)]
    expected = [reference_output_grads(model, x, [model[2]])[0] for x in xs]
    capture = Capture(model, grad_outputs=True)
    for x in xs:
        model(x).pow(2).sum().backward()
    got = capture.inputs()[model[2]].grad_outputs()
    assert [g.shape[0] for g in got] == [2, 3]
    for g, want in zip(got, expected, strict=True):
        torch.testing.assert_close(g, want)


def test_a_copied_model_neither_carries_captures_nor_records() -> None:
    import copy
    import pickle

    model = mlp()
    optimizer = Recorder(model, lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        logs = [h.__self__ for m in twin.modules() for h in m._forward_hooks.values() if hasattr(h, "__self__")]
        assert logs and all(not log.ledger.entries and not log.enabled for log in logs)
        twin(torch.randn(3, 4)).sum().backward()
        assert all(not log.ledger.entries and not log.tasks for log in logs)
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in twin.modules())  # came off
    assert len(optimizer.capture.calls()) == 2  # the original is untouched


def test_nested_arguments_are_detached_and_keep_their_structure() -> None:
    from collections import namedtuple

    Pair = namedtuple("Pair", "left right")

    class Nested(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 3)

        def forward(self, pair: Any, extras: dict[str, Any]) -> torch.Tensor:
            return self.linear(pair.left + pair.right + extras["bias"][0])

    model = Nested()
    capture = Capture(model, modules=[model])
    left, right, bias = (torch.randn(2, 3, requires_grad=True) for _ in range(3))
    model(Pair(left, right), {"bias": [bias]}).sum().backward()
    (call,) = capture.calls()
    pair, extras = call.args
    assert isinstance(pair, Pair) and isinstance(extras["bias"], list)
    assert not pair.left.requires_grad and not extras["bias"][0].requires_grad
    assert torch.equal(pair.right, right) and torch.equal(extras["bias"][0], bias)
