"""Every assumption this library makes about torch's private internals, in one place.

Each is checked by ``tests/test_torch_assumptions.py``, so a torch release that changes one
fails there, by name, rather than somewhere in a rule. Reach into torch only here.

* ``Optimizer.__init__`` wraps ``type(self).step`` once per class with ``Optimizer.profile_hook_step``
  (which runs the step pre- and post-hooks), marks the wrapper ``hooked = True`` and leaves a step
  already marked alone; the wrapper's ``__wrapped__`` is the function it wraps. A ``step`` calling
  ``super().step()`` would so run the hooks twice: see ``entry_step`` and ``unhooked``. Besides the
  hooks (``_optimizer_step_pre_hooks``/``_post_hooks`` and ``torch.optim.optimizer``'s global ones) it
  only opens a profiler range and calls ``_optimizer_step_code`` for the profiler's Python tracer;
  ``torch._C._autograd._profiler_enabled()`` says whether a profiler runs.
* ``nn.Module`` keeps its forward hooks and pre-hooks in ``_forward_hooks``/``_forward_pre_hooks``
  and runs a snapshot of them, so a hook may remove itself (and a later one) while the module runs.
* Autograd: ``torch._C._current_graph_task_id()`` is -1 outside backward and one id per backward
  pass (a reentrant checkpoint's nested backward is a pass of its own); a callback queued on
  ``Variable._execution_engine`` runs when the current pass is complete, after its hooks.
  ``torch._C._will_engine_execute_node(node)`` says whether the pass runs a parameter's
  ``AccumulateGrad`` node, and raises an error naming ``autograd.grad()`` for one whose gradient
  ``torch.autograd.grad`` returns instead.
* ``torch._C._functorch.peek_interpreter_stack()`` is ``None`` outside ``torch.func`` transforms.
* Non-reentrant ``torch.utils.checkpoint`` installs saved-tensor hooks whose pack hook is a closure
  over its region's frame (``recompute_fn``, ``weak_holders``), and re-runs the forward in backward
  under a pack hook named ``_recomputation_hook``.
* Dynamo keeps compiled code per code object (``_debug_get_cache_entry_list``), dropped by ``reset_code``;
  the ``reason`` given to ``torch.compiler.disable`` is in the error ``fullgraph=True`` raises at its call.
* ``GradScaler`` hands an optimizer with ``_step_supports_amp_scaling = True`` ``grad_scale`` and
  ``found_inf`` as attributes, steps it even on inf/NaN, and deletes them after a step that returned;
  ``torch._amp_foreach_non_finite_check_and_unscale_`` is its kernel, which it runs on a sparse
  gradient's ``_values()`` (uncoalesced, a view that scales the gradient in place).
* The torch function mode stack (``TorchFunctionMode``): ``torch._C._len_torch_function_stack``,
  ``_get_function_stack_at``, ``_pop_torch_function_stack`` and ``_push_on_torch_function_stack``, which
  ``TorchFunctionMode.__enter__``/``__exit__`` use, and a mode's ``__torch_function__`` runs with the mode off it.
* ``torch._foreach_sub``/``_foreach_norm`` (one kernel over a list of tensors), ``torch._fused_adamw_``
  (``AdamW(fused=True)``'s kernel) and ``torch.utils._pytree``'s tree functions.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim import optimizer as _optimizer
from torch.utils._pytree import tree_flatten as tree_flatten
from torch.utils._pytree import tree_map_only as tree_map_only
from torch.utils._pytree import tree_unflatten as tree_unflatten


def unhooked(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` without the hook-running wrapper ``torch.optim`` may have put on it."""
    while getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        step = step.__wrapped__
    return step


def entry_step(
    step: Callable[..., Any], outermost: Callable[..., Any], nested: Callable[..., Any], in_step: Callable[[Any], bool]
) -> Callable[..., Any]:
    """The ``step`` a class exposes: the outermost call runs ``outermost`` in torch's hook wrapper (called
    directly when no step hook is registered and no profiler runs: right after a backward the wrapper
    would cost 20-40 µs for nothing, 5-8% of a LazyAdamW step); a call made while a step runs
    (``in_step``: ``super().step(...)``) goes to ``nested``, without hooks."""
    with_hooks = Optimizer.profile_hook_step(functools.wraps(step)(outermost))

    @functools.wraps(step)
    def entry(self: Any, *args: Any, **kwargs: Any) -> Any:
        if in_step(self):
            return nested(self, *args, **kwargs)
        if not (self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks or _observed()):
            return outermost(self, *args, **kwargs)
        return with_hooks(self, *args, **kwargs)

    entry.hooked = True  # type: ignore[attr-defined]  # so that Optimizer.__init__ does not wrap it again
    entry.inputaware_entry = step  # type: ignore[attr-defined]
    return entry


def _observed() -> bool:
    """Whether a global optimizer step hook is registered or a profiler runs."""
    return bool(_optimizer._global_optimizer_pre_hooks or _optimizer._global_optimizer_post_hooks) or (
        torch._C._autograd._profiler_enabled()
    )


def remove_hooks_of(module: Any, owner: object) -> None:
    """Remove from ``module`` every forward hook and pre-hook that is a bound method of ``owner`` (hooks copied
    with a model have no handle). Their flags stay (ids are never reused): the module may be running its hooks."""
    for hooks in (module._forward_hooks, module._forward_pre_hooks):
        for key in [key for key, hook in hooks.items() if getattr(hook, "__self__", None) is owner]:
            del hooks[key]


_LAZILY_DISABLED: list[Callable[[], None]] = []


def compiler_disabled(fn: Callable[..., Any], reason: str | None = None) -> Callable[..., Any]:
    """``torch.compiler.disable(fn, reason=reason)``, made once ``torch._dynamo`` is loaded (before, nothing
    compiles, so nothing traces ``fn``): importing this library does not import ``torch._dynamo``, which takes as
    long as torch. ``prepare_compiler_disabled()`` makes them all while no code is traced (made while tracing, the
    first trace breaks its graph once more). ``reason`` is in the error ``torch.compile(fullgraph=True)`` raises
    at the call."""
    disabled: list[Callable[..., Any]] = []

    def prepare() -> None:
        if not disabled and "torch._dynamo" in sys.modules:
            disabled.append(torch.compiler.disable(fn, reason=reason))

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not disabled:
            prepare()
            if not disabled:
                return fn(*args, **kwargs)
        return disabled[0](*args, **kwargs)

    _LAZILY_DISABLED.append(prepare)
    return call


def prepare_compiler_disabled() -> None:
    """Make every ``compiler_disabled`` function's disabled form now, if ``torch._dynamo`` is loaded."""
    if "torch._dynamo" in sys.modules:
        for prepare in _LAZILY_DISABLED:
            prepare()


def packs_projections(attention: torch.nn.MultiheadAttention) -> bool:
    """Whether ``nn.MultiheadAttention`` keeps its query, key and value projections in one ``in_proj_weight``
    (its private ``_qkv_same_embed_dim``: the embedding, key and value sizes agree)."""
    return bool(attention._qkv_same_embed_dim)


set_grad_enabled = torch._C._set_grad_enabled  # torch.no_grad() without the context manager's cost
graph_task_id = torch._C._current_graph_task_id
functorch_level = torch._C._functorch.peek_interpreter_stack


def pause_function_mode(mode: Any) -> bool:
    """Take ``mode`` off the top of the torch function mode stack, so that the library's own operations (in its
    hooks) bypass it; False (nothing done) if another mode is above it. ``resume_function_mode`` puts it back."""
    length = torch._C._len_torch_function_stack()
    if length == 0 or torch._C._get_function_stack_at(length - 1) is not mode:
        return False
    torch._C._pop_torch_function_stack()
    return True


resume_function_mode = torch._C._push_on_torch_function_stack


def remove_function_mode(mode: Any) -> bool:
    """Take ``mode`` off the torch function mode stack wherever it is (the modes above it stay, in order)."""
    above = []
    while torch._C._len_torch_function_stack() > 0:
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    else:
        mode = None
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)
    return mode is not None


def queue_end_of_backward(callback: Any) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


ACCUMULATES, RETURNS, SKIPS = "accumulates", "returns", "skips"


def pass_reaches(accumulator: Any) -> str:
    """Whether the running backward pass ``ACCUMULATES`` a parameter's gradient into ``.grad``,
    ``RETURNS`` it (``torch.autograd.grad``) or ``SKIPS`` it (``accumulator``: its AccumulateGrad node)."""
    try:
        return ACCUMULATES if torch._C._will_engine_execute_node(accumulator) else SKIPS
    except RuntimeError as error:
        return RETURNS if "autograd.grad()" in str(error) else ACCUMULATES


def _top_saved_tensors_hooks() -> Any:
    get = torch._C._autograd._top_saved_tensors_default_hooks
    try:
        return get(False)
    except TypeError:  # older releases take no argument
        return get()  # type: ignore[call-arg]


def recomputing_checkpointed_forward() -> bool:
    """True while non-reentrant activation checkpointing re-runs a forward in backward."""
    top = _top_saved_tensors_hooks()
    return top is not None and getattr(top[0], "__qualname__", "").startswith("_recomputation_hook")


def checkpoint_frame() -> Any:
    """The non-reentrant checkpoint region running now (its forward, or its re-run in backward), or ``None``."""
    top = _top_saved_tensors_hooks()
    if top is None:
        return None
    pack = inspect.unwrap(top[0])  # the re-run's pack hook is wrapped by torch._dynamo.disable
    for cell in getattr(pack, "__closure__", None) or ():
        value = cell.cell_contents
        if isinstance(value, weakref.ref):  # the re-run's hook holds its region by weak reference
            value = value()
        if value is not None and hasattr(value, "recompute_fn") and hasattr(value, "weak_holders"):
            return value
    return None


def drop_compiled_code(modules: list[Any]) -> bool:
    """Drop the code Dynamo compiled for these modules' forwards, so their next call recompiles
    with the hooks added since. False if this release offers no way to."""
    try:
        from torch._C._dynamo.eval_frame import reset_code
        from torch._dynamo import external_utils
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:  # pragma: no cover - depends on the torch release
        return False
    codes = set()
    for module in modules:
        inner = getattr(module, "_orig_mod", module)
        codes.add(type(inner).forward.__code__)
        if hasattr(external_utils, "wrap_inline"):
            codes.add(external_utils.wrap_inline(inner).__code__)
    for code in codes:
        if _debug_get_cache_entry_list(code):
            reset_code(code)
    return True


_SCALER_ATTRIBUTES = ("grad_scale", "found_inf")


def unscales_itself(optimizer: Optimizer) -> None:
    """Declare that ``optimizer`` unscales and skips by itself (GradScaler then steps it even on inf/NaN)."""
    optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]


def scaler_handoff(optimizer: Optimizer) -> tuple[Any, Any]:
    """``(grad_scale, found_inf)`` as GradScaler set them for this step (``None`` outside a ``scaler.step``)."""
    return getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None)


def kernel_skips_step(optimizer: Optimizer) -> bool:
    """Whether GradScaler handed this step to the optimizer's own kernel (fused) with an inf/NaN found:
    the kernel skips it, as GradScaler skips the step of any other optimizer (a host sync, when asked)."""
    found_inf = scaler_handoff(optimizer)[1]
    return found_inf is not None and bool(found_inf.item())


def hide_scaler_handoff(optimizer: Optimizer) -> None:
    """Set the handoff to ``None``, so that the stock kernels neither unscale nor skip again."""
    for attribute in _SCALER_ATTRIBUTES:
        setattr(optimizer, attribute, None)


def drop_scaler_handoff(optimizer: Optimizer) -> None:
    """Remove what GradScaler set, after a step that raised (which it leaves), so the next step starts afresh."""
    for attribute in _SCALER_ATTRIBUTES:
        optimizer.__dict__.pop(attribute, None)


def in_place_values(grad: Tensor) -> Tensor:
    """What GradScaler's kernel scales in place: a sparse gradient's (uncoalesced) values, else ``grad``."""
    return grad._values() if grad.is_sparse else grad


def grad_scaler_unscale_(grads: list[Any], found_inf: Any, inv_scale: Any) -> None:
    """``grads *= inv_scale`` in place with GradScaler's own kernel; ``found_inf`` set to 1 on inf/NaN."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


foreach_sub = torch._foreach_sub
foreach_norm = torch._foreach_norm
fused_adamw_ = torch._fused_adamw_
