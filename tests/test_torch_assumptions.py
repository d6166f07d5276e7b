"""Each assumption ``inputaware_optim/_torch.py`` makes about torch.optim, checked on the torch installed.

A torch release that changes one fails here, by name, rather than somewhere in a rule.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from inputaware_optim._torch import (
    drop_scaler_handoff,
    entry_step,
    grad_scaler_unscale_,
    hide_scaler_handoff,
    in_place_values,
    pause_function_mode,
    remove_function_mode,
    resume_function_mode,
    scaler_handoff,
    unhooked,
    unscales_itself,
)


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


def test_entry_step_skips_the_wrapper_only_while_nothing_observes_it() -> None:
    """Unobserved, the outermost call goes straight to ``outermost``; a global or instance hook, or a
    running profiler (which then shows torch's ``Optimizer.step#<class>.step`` range), brings the wrapper back."""
    from torch.profiler import profile

    calls: list[str] = []
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)

    def step(self: Any, closure: Any = None, inputs: Any = None) -> None:
        calls.append("step")

    optimizer._optimizer_step_code = lambda: calls.append("wrapper")  # type: ignore[method-assign]
    entry = entry_step(step, step, step, lambda self: False)
    entry(optimizer)
    handle = register_optimizer_step_post_hook(lambda o, a, k: calls.append("global post"))
    try:
        entry(optimizer)
    finally:
        handle.remove()
    handle = optimizer.register_step_post_hook(lambda o, a, k: calls.append("post"))
    try:
        entry(optimizer)
    finally:
        handle.remove()
    with profile() as prof:
        entry(optimizer)
    assert calls == ["step", "step", "wrapper", "global post", "step", "wrapper", "post", "step", "wrapper"]
    assert "Optimizer.step#SGD.step" in {event.key for event in prof.key_averages()}


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
    assert list(layer._forward_hooks) == [kept.id] and not layer._forward_pre_hooks


def test_a_pre_hook_may_remove_a_later_with_kwargs_pre_hook_of_the_same_module_while_it_runs() -> None:
    from inputaware_optim._torch import remove_hooks_of

    class Owner:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def first(self, module: nn.Module, args: Any, kwargs: Any) -> None:
            self.calls.append("first")
            remove_hooks_of(module, self)

        def second(self, module: nn.Module, args: Any, kwargs: Any) -> None:
            self.calls.append("second")  # still runs this once, with its kwargs

    owner, layer = Owner(), nn.Linear(2, 2)
    layer.register_forward_pre_hook(owner.first, with_kwargs=True)
    layer.register_forward_pre_hook(owner.second, with_kwargs=True)
    layer(torch.zeros(1, 2))
    layer(torch.zeros(1, 2))
    assert owner.calls == ["first", "second"] and not layer._forward_pre_hooks


def test_graph_task_id_is_one_per_backward_pass_and_a_queued_callback_runs_after_its_hooks() -> None:
    from inputaware_optim._torch import graph_task_id, queue_end_of_backward

    assert graph_task_id() == -1
    seen: list[Any] = []

    def hook(grad: torch.Tensor) -> None:
        seen.append(graph_task_id())
        if len(seen) == 1:
            queue_end_of_backward(lambda: seen.append("end"))

    x = torch.ones(2, requires_grad=True)
    for _ in range(2):
        y = x * 2
        y.register_hook(hook)
        z = y * 3
        z.register_hook(hook)
        z.sum().backward()
    first, second = seen[:3], seen[3:]
    assert first[0] == first[1] != -1 and first[2] == "end"
    assert second[0] == second[1] != first[0] and len(second) == 2  # queued only by the first pass


def test_a_reentrant_checkpoint_region_is_a_backward_pass_of_its_own() -> None:
    from torch.utils.checkpoint import checkpoint

    from inputaware_optim._torch import graph_task_id

    ids: list[int] = []

    def region(h: torch.Tensor) -> torch.Tensor:
        out = h * 2
        if torch.is_grad_enabled():  # the re-run in backward
            out.register_hook(lambda g: ids.append(graph_task_id()))
        return out

    x = torch.ones(2, requires_grad=True)
    y = x * 1.0
    y.register_hook(lambda g: ids.append(graph_task_id()))
    checkpoint(region, y, use_reentrant=True).sum().backward()
    assert len(ids) == 2 and ids[0] != ids[1]


def test_functorch_level_is_none_outside_transforms_only() -> None:
    from inputaware_optim._torch import functorch_level

    assert functorch_level() is None
    seen: list[Any] = []
    torch.func.vmap(lambda t: seen.append(functorch_level()) or t)(torch.ones(2, 3))
    assert seen and seen[0] is not None


def test_checkpoint_frame_is_the_region_in_its_forward_and_its_rerun() -> None:
    from torch.utils.checkpoint import checkpoint

    from inputaware_optim._torch import checkpoint_frame, recomputing_checkpointed_forward

    seen: list[tuple[Any, bool]] = []

    def region(h: torch.Tensor) -> torch.Tensor:
        seen.append((checkpoint_frame(), recomputing_checkpointed_forward()))
        return h.sin()

    assert checkpoint_frame() is None and not recomputing_checkpointed_forward()
    x = torch.ones(3, requires_grad=True)
    checkpoint(region, x, use_reentrant=False).sum().backward()
    (forward_frame, forward_rerun), (backward_frame, backward_rerun) = seen
    assert forward_frame is not None and forward_frame is backward_frame
    assert (forward_rerun, backward_rerun) == (False, True)


def test_dynamo_keeps_code_per_code_object_and_drops_it() -> None:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from inputaware_optim._torch import drop_compiled_code

    class Small(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2 + 1

    module = Small()
    compiled = torch.compile(module, backend="eager")
    compiled(torch.ones(2))
    assert _debug_get_cache_entry_list(Small.forward.__code__)
    assert drop_compiled_code([compiled])
    assert not _debug_get_cache_entry_list(Small.forward.__code__)


def test_grad_scaler_protocol_for_an_optimizer_that_unscales_itself() -> None:
    """An optimizer declared by ``unscales_itself`` is handed the scale and the inf flag
    (``scaler_handoff``) and stepped even on inf; hiding the handoff keeps GradScaler's bookkeeping, and
    GradScaler removes it after a step that returned; ``torch._amp_foreach_non_finite_check_and_unscale_``
    is the scaler's kernel."""
    seen: dict[str, Any] = {}

    class Own(torch.optim.SGD):
        def step(self, closure: Any = None) -> None:
            seen["handoff"] = scaler_handoff(self)
            hide_scaler_handoff(self)
            seen["hidden"] = scaler_handoff(self)

    param = nn.Parameter(torch.ones(2))
    optimizer = Own([param], lr=0.1)
    assert scaler_handoff(optimizer) == (None, None)
    unscales_itself(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale((param * float("inf")).sum()).backward()
    scaler.step(optimizer)
    scale, found_inf = seen["handoff"]
    assert float(scale) == 4.0 and float(found_inf) == 1.0 and seen["hidden"] == (None, None)
    scaler.update()  # the skipped step halves the scale: GradScaler's bookkeeping survived the hiding
    assert scaler.get_scale() == 2.0 and scaler_handoff(optimizer) == (None, None)
    optimizer.grad_scale = optimizer.found_inf = torch.ones(1)  # as left by a step that raised
    drop_scaler_handoff(optimizer)
    assert "grad_scale" not in vars(optimizer) and "found_inf" not in vars(optimizer)
    grads, found = [torch.tensor([8.0, 4.0])], torch.zeros(1)
    grad_scaler_unscale_(grads, found, torch.tensor(0.25))
    assert grads[0].tolist() == [2.0, 1.0] and float(found) == 0.0
    # A sparse gradient (an Embedding(sparse=True)'s, uncoalesced: index 1 twice) is unscaled
    # through its values, in place, as GradScaler.unscale_ does it.
    sparse = torch.sparse_coo_tensor([[1, 3, 1]], [8.0, 4.0, 2.0], (5,))
    dense = sparse.to_dense()
    assert not sparse.is_coalesced()
    grad_scaler_unscale_([in_place_values(sparse)], found, torch.tensor(0.25))
    assert torch.equal(sparse.to_dense(), dense / 4) and in_place_values(dense) is dense


def test_foreach_kernels_are_the_per_tensor_ones() -> None:
    from inputaware_optim._torch import foreach_norm, foreach_sub

    a, b = [torch.randn(3), torch.randn(2, 2)], [torch.randn(3), torch.randn(2, 2)]
    assert all(torch.equal(x, y - z) for x, y, z in zip(foreach_sub(a, b), a, b, strict=True))
    assert all(torch.equal(n, torch.linalg.vector_norm(x)) for n, x in zip(foreach_norm(a), a, strict=True))


def test_the_engine_query_behind_returned_gradients() -> None:
    """pass_reaches reads a private engine call: accumulate, return or skip, as torch says today."""
    from inputaware_optim._torch import ACCUMULATES, RETURNS, SKIPS, pass_reaches

    layer = nn.Linear(3, 2)
    accumulator = torch.autograd.graph.get_gradient_edge(layer.weight).node
    x = torch.randn(4, 3, requires_grad=True)
    seen: list[str] = []
    output = layer(x)
    assert output.grad_fn is not None
    output.grad_fn.register_prehook(lambda grads: seen.append(pass_reaches(accumulator)))
    torch.autograd.grad(output.sum(), [layer.weight], retain_graph=True)
    torch.autograd.grad(output.sum(), [x], retain_graph=True)
    output.sum().backward(inputs=[x], retain_graph=True)
    output.sum().backward()
    assert seen == [RETURNS, SKIPS, SKIPS, ACCUMULATES]


@pytest.mark.parametrize("padding", [0, 2, (1, 3), "same", "valid"])
@pytest.mark.parametrize("kernel", [1, 2, 3, (2, 5)])
@pytest.mark.parametrize("dilation", [1, 2])
def test_conv_padding_is_what_the_convolution_pads(padding: Any, kernel: Any, dilation: int) -> None:
    from inputaware_optim.layers import conv_padding

    conv = nn.Conv2d(2, 3, kernel, padding=padding, dilation=dilation)
    assert conv_padding(conv) == tuple(conv._reversed_padding_repeated_twice)
    x = torch.randn(1, 2, 9, 10)
    padded = torch.nn.functional.pad(x, conv_padding(conv))
    expected = torch.nn.functional.conv2d(padded, conv.weight, conv.bias, dilation=dilation)
    torch.testing.assert_close(conv(x), expected)


def test_the_batch_norms_dp_names_are_every_batch_norm_torch_has() -> None:
    from torch.nn.modules.batchnorm import _BatchNorm

    from inputaware_optim.dp import _BATCH_NORMS

    def subclasses(cls: type) -> set[type]:
        return {cls, *(c for s in cls.__subclasses__() for c in subclasses(s))}

    trainable = {c for c in subclasses(_BatchNorm) if c.__module__.startswith("torch.nn.")} - {_BatchNorm}
    assert trainable and all(issubclass(c, _BATCH_NORMS) for c in trainable), trainable


def test_fused_adamw_is_adamw_fused_on_the_tensors_it_is_given() -> None:
    from inputaware_optim._torch import fused_adamw_

    torch.manual_seed(0)
    param, grad = torch.randn(4, 3), torch.randn(4, 3)
    reference = nn.Parameter(param.clone())
    reference.grad = grad.clone()
    stock = torch.optim.AdamW([reference], lr=0.1, weight_decay=0.01, fused=True)
    stock.step()
    exp_avg, exp_avg_sq, step = torch.zeros(4, 3), torch.zeros(4, 3), torch.tensor(1.0)
    fused_adamw_(
        [param], [grad], [exp_avg], [exp_avg_sq], [], [step], amsgrad=False, lr=0.1, beta1=0.9, beta2=0.999,
        weight_decay=0.01, eps=1e-8, maximize=False,
    )  # fmt: skip
    assert torch.equal(param, reference.detach())


def test_multihead_attention_says_whether_it_packs_its_projections() -> None:
    from inputaware_optim._torch import packs_projections

    assert packs_projections(nn.MultiheadAttention(8, 2))
    assert not packs_projections(nn.MultiheadAttention(8, 2, kdim=4, vdim=4))
    assert nn.MultiheadAttention(8, 2).in_proj_weight is not None  # what packing means: one matrix


def test_a_lazily_disabled_function_imports_no_dynamo_and_is_skipped_once_compiling() -> None:
    # In a fresh process: the library's import leaves torch._dynamo alone; once torch.compile runs, the
    # function is torch.compiler.disable'd (a graph break at its call, its body run eagerly).
    script = """
import sys, torch
import inputaware_optim
from inputaware_optim._torch import compiler_disabled
assert "torch._dynamo" not in sys.modules, "import inputaware_optim imported torch._dynamo"
seen = []
@compiler_disabled
def side(x):
    seen.append(torch.compiler.is_compiling())
side(torch.ones(1))
assert "torch._dynamo" not in sys.modules and seen == [False]
from torch._dynamo.utils import counters
compiled = torch.compile(lambda x: (side(x), x + 1)[1], backend="eager")
compiled(torch.ones(2))
assert seen == [False, False], seen
assert sum(counters["graph_break"].values()) >= 1
"""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_the_function_mode_stack_pauses_resumes_and_removes_a_mode() -> None:
    """``Capture.follow_samples``'s mode is taken off the stack while the library's hooks run, and off it for good
    when the forward returns, wherever it is; a mode's ``__torch_function__`` runs with the mode off the stack."""
    seen: list[str] = []

    class Names(torch.overrides.TorchFunctionMode):
        def __init__(self, tag: str) -> None:
            super().__init__()
            self.tag = tag

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            seen.append(self.tag)
            return func(*args, **(kwargs or {}))  # (no recursion: the mode is off the stack here)

    x = torch.ones(2)
    ours, theirs = Names("ours"), Names("theirs")
    ours.__enter__()
    try:
        torch.add(x, x)
        assert seen == ["ours"]
        assert pause_function_mode(ours)
        torch.add(x, x)
        assert seen == ["ours"] and not torch.overrides._is_torch_function_mode_enabled()
        resume_function_mode(ours)
        torch.add(x, x)
        assert seen == ["ours", "ours"]
        with theirs:
            assert not pause_function_mode(ours)  # not on top: left where it is
            assert remove_function_mode(ours)  # taken from under another mode, which stays
            seen.clear()
            torch.add(x, x)
            assert seen == ["theirs"]
        assert not remove_function_mode(ours) and not torch.overrides._is_torch_function_mode_enabled()
    finally:
        remove_function_mode(ours)
