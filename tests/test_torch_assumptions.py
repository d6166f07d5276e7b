"""Each assumption ``inputaware_optim/_torch.py`` makes about torch.optim, checked on the torch installed.

A torch release that changes one fails here, by name, rather than somewhere in a rule.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch import nn

from inputaware_optim._torch import entry_step, unhooked


def _fresh_sgd_subclass() -> type[torch.optim.SGD]:
    class Fresh(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # its own, so torch wraps it whatever SGD's is
            return None

    return Fresh


def test_optimizer_init_wraps_the_class_step_once_and_marks_it_hooked() -> None:
    cls = _fresh_sgd_subclass()
    raw = cls.__dict__["step"]
    cls([nn.Parameter(torch.zeros(1))], lr=0.1)
    wrapped = cls.__dict__["step"]
    assert wrapped is not raw and wrapped.hooked is True
    cls([nn.Parameter(torch.zeros(1))], lr=0.1)
    assert cls.__dict__["step"] is wrapped  # not wrapped twice


def test_a_step_marked_hooked_is_left_alone() -> None:
    cls = _fresh_sgd_subclass()

    def step(self: Any, closure: Any = None) -> None:
        return None

    step.hooked = True  # type: ignore[attr-defined]
    cls.step = step  # type: ignore[method-assign]
    cls([nn.Parameter(torch.zeros(1))], lr=0.1)
    assert cls.__dict__["step"] is step


def test_the_wrapper_leads_back_through_wrapped() -> None:
    cls = _fresh_sgd_subclass()
    raw = cls.step
    cls([nn.Parameter(torch.zeros(1))], lr=0.1)
    assert cls.__dict__["step"].__wrapped__ is raw
    assert unhooked(cls.step) is raw


def test_profile_hook_step_runs_global_and_instance_hooks_around_the_call_and_takes_new_arguments() -> None:
    order: list[str] = []
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)

    def func(self: Any, *args: Any, **kwargs: Any) -> str:
        order.append(f"step{args}{kwargs}")
        return "out"

    wrapped = torch.optim.Optimizer.profile_hook_step(func)
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: order.append("global pre")),
        register_optimizer_step_post_hook(lambda o, a, k: order.append("global post")),
        optimizer.register_step_pre_hook(lambda o, a, k: ((a[0], "replaced"), {"x": 1})),
        optimizer.register_step_post_hook(lambda o, a, k: order.append("post")),
    ]
    try:
        assert wrapped(optimizer, "given") == "out"
    finally:
        for handle in handles:
            handle.remove()
    assert order == ["global pre", "step('replaced',){'x': 1}", "post", "global post"]


def test_entry_step_runs_hooks_only_for_the_outermost_call() -> None:
    calls: list[str] = []
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    depth = {"in": False}

    def step(self: Any, closure: Any = None, inputs: Any = None) -> None:
        calls.append("step")

    def outermost(self: Any, *args: Any, **kwargs: Any) -> None:
        depth["in"] = True
        try:
            entry(self)  # a nested call, as super().step() from an override
        finally:
            depth["in"] = False

    entry = entry_step(step, outermost, step, lambda self: depth["in"])
    handle = optimizer.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    try:
        entry(optimizer)
    finally:
        handle.remove()
    assert calls == ["pre", "step"]
    assert entry.hooked is True


def test_a_forward_hook_may_remove_itself_by_its_key_while_the_module_runs() -> None:
    from inputaware_optim._torch import remove_hooks_of

    class Owner:
        calls = 0

        def hook(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            self.calls += 1
            remove_hooks_of(module, self)

        def pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
            self.calls += 1
            remove_hooks_of(module, self)

    owner, layer = Owner(), nn.Linear(2, 2)
    layer.register_forward_hook(owner.hook, with_kwargs=True, always_call=True)
    layer.register_forward_pre_hook(owner.pre, with_kwargs=True)
    kept = layer.register_forward_hook(lambda m, a, o: None)
    layer(torch.zeros(1, 2))
    assert owner.calls == 1  # the pre-hook removed both before the forward hook ran
    layer(torch.zeros(1, 2))
    assert owner.calls == 1
    assert list(layer._forward_hooks) == [kept.id]
    for name in ("_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs"):
        assert not getattr(layer, name), name
