"""Every assumption this library makes about torch's private internals, in one place.

Each is checked by ``tests/test_torch_assumptions.py``, so a torch release that changes one
fails there, by name, rather than somewhere in a rule. Reach into torch only here.

* ``Optimizer.__init__`` wraps ``type(self).step`` once per class with
  ``Optimizer.profile_hook_step`` (which runs the global and per-instance step pre- and
  post-hooks around the call) and marks the wrapper ``hooked = True``; a ``step`` already
  marked is left alone. The wrapper is made with ``functools.wraps``, so ``__wrapped__`` leads
  to the function it wraps. So a subclass whose ``step`` calls ``super().step()`` would run the
  hooks twice once the parent class was wrapped too (any plain instance of it created):
  ``entry_step`` gives each input-aware ``step`` torch's own wrapper for the outermost call and
  lets nested calls through unwrapped; ``unhooked`` reaches a stock ``step`` without its wrapper.
* ``nn.Module`` keeps its forward hooks and pre-hooks in ``_forward_hooks`` and
  ``_forward_pre_hooks`` and iterates over a snapshot of them when called, so a hook may remove
  itself (and a later one) while the module runs. ``remove_hooks_of`` relies on it for hooks that
  arrive in a copied model without their handles.
* Autograd: ``torch._C._current_graph_task_id()`` is -1 outside backward and one id per backward
  pass (a reentrant checkpoint region's nested backward is a pass of its own); a callback queued
  on ``Variable._execution_engine`` runs when the current pass is complete, after its hooks.
* ``torch._C._will_engine_execute_node(node)``, inside a backward pass, says whether the pass runs
  a parameter's ``AccumulateGrad`` node, and raises an error naming ``autograd.grad()`` for a node
  whose gradient ``torch.autograd.grad`` returns instead.
* ``torch._C._functorch.peek_interpreter_stack()`` is ``None`` outside ``torch.func`` transforms.
* ``torch.utils.checkpoint`` (non-reentrant) installs saved-tensor hooks whose pack hook is a
  closure over its region's frame (``recompute_fn``, ``weak_holders``), and whose re-run in
  backward uses a pack hook named ``_recomputation_hook``.
* Dynamo keeps compiled code per code object (``_debug_get_cache_entry_list``) and drops it with
  ``reset_code``.
* ``GradScaler``: an optimizer with ``_step_supports_amp_scaling = True`` (``unscales_itself``) is
  handed ``grad_scale`` and ``found_inf`` as attributes (``scaler_handoff``) and stepped even on
  inf/NaN (it unscales and skips by itself); the scaler deletes them after a step that returned;
  ``torch._amp_foreach_non_finite_check_and_unscale_`` is the scaler's kernel. The library reads
  and writes these attributes only through the functions here.
* ``torch._foreach_sub``/``torch._foreach_norm``: one kernel over a list of tensors;
  ``torch._fused_adamw_`` is the kernel of ``AdamW(fused=True)`` (LazyAdamW updates rows with it).
* ``torch.utils._pytree``'s ``tree_flatten``/``tree_unflatten``/``tree_map_only``.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

__all__ = [
    "checkpoint_frame",
    "drop_compiled_code",
    "drop_scaler_handoff",
    "entry_step",
    "foreach_norm",
    "foreach_sub",
    "functorch_level",
    "fused_adamw_",
    "grad_scaler_unscale_",
    "graph_task_id",
    "hide_scaler_handoff",
    "pass_reaches",
    "queue_end_of_backward",
    "recomputing_checkpointed_forward",
    "remove_hooks_of",
    "scaler_handoff",
    "set_grad_enabled",
    "tree_flatten",
    "tree_map_only",
    "tree_unflatten",
    "unhooked",
    "unscales_itself",
]


def unhooked(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` without the hook-running wrapper ``torch.optim`` may have put on it."""
    while getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        step = step.__wrapped__
    return step


def entry_step(
    step: Callable[..., Any], outermost: Callable[..., Any], nested: Callable[..., Any], in_step: Callable[[Any], bool]
) -> Callable[..., Any]:
    """The ``step`` a class exposes: the outermost call runs torch's own hook wrapper around
    ``outermost`` (hooks exactly once per step); a call made while a step runs (``in_step``),
    that is ``super().step(...)`` from an override, goes to ``nested`` with no hooks. Marked
    ``hooked`` so that ``Optimizer.__init__`` does not wrap it again."""
    with_hooks = Optimizer.profile_hook_step(functools.wraps(step)(outermost))

    @functools.wraps(step)
    def entry(self: Any, *args: Any, **kwargs: Any) -> Any:
        if in_step(self):
            return nested(self, *args, **kwargs)
        return with_hooks(self, *args, **kwargs)

    entry.hooked = True  # type: ignore[attr-defined]
    entry.inputaware_entry = step  # type: ignore[attr-defined]
    return entry


def remove_hooks_of(module: Any, owner: object) -> None:
    """Remove from ``module`` every forward hook and pre-hook that is a bound method of ``owner``
    (hooks copied with a model have no handle to remove them by).

    Their ``*_with_kwargs``/``always_called`` flags stay: the module may be running its hooks
    now (from a snapshot of them), and reads those flags for each; hook ids are never reused."""
    for hooks in (module._forward_hooks, module._forward_pre_hooks):
        for key in [key for key, hook in hooks.items() if getattr(hook, "__self__", None) is owner]:
            del hooks[key]


# -- autograd ----------------------------------------------------------------------------------
set_grad_enabled = torch._C._set_grad_enabled  # torch.no_grad() without the context manager's cost
graph_task_id = torch._C._current_graph_task_id
functorch_level = torch._C._functorch.peek_interpreter_stack


def queue_end_of_backward(callback: Any) -> None:
    """Run ``callback`` when the current backward pass is complete."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


ACCUMULATES, RETURNS, SKIPS = "accumulates", "returns", "skips"


def pass_reaches(accumulator: Any) -> str:
    """What the running backward pass does with the gradient of the parameter whose
    ``AccumulateGrad`` node is ``accumulator``: ``ACCUMULATES`` into ``.grad``, ``RETURNS`` it
    (``torch.autograd.grad``), or ``SKIPS`` it."""
    try:
        return ACCUMULATES if torch._C._will_engine_execute_node(accumulator) else SKIPS
    except RuntimeError as error:
        return RETURNS if "autograd.grad()" in str(error) else ACCUMULATES


# -- activation checkpointing ----------------------------------------------------------------------
def _top_saved_tensors_hooks() -> Any:
    get = torch._C._autograd._top_saved_tensors_default_hooks
    try:
        return get(False)
    except TypeError:  # older releases take no argument
        return get()  # type: ignore[call-arg]


def recomputing_checkpointed_forward() -> bool:
    """True while non-reentrant activation checkpointing re-runs a forward in backward."""
    top = _top_saved_tensors_hooks()
    if top is None:
        return False
    return getattr(top[0], "__qualname__", "").startswith("_recomputation_hook")


def checkpoint_frame() -> Any:
    """The non-reentrant checkpoint region running now (its original forward, or its re-run in
    backward), or ``None``: read from the saved-tensor hooks torch.utils.checkpoint installs."""
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


# -- torch.compile ---------------------------------------------------------------------------------
def drop_compiled_code(modules: list[Any]) -> bool:
    """Drop the code Dynamo compiled for these modules' forwards, so their next call recompiles
    (with the hooks added since). False if this release offers no way to."""
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


# -- GradScaler --------------------------------------------------------------------------------------
_SCALER_ATTRIBUTES = ("grad_scale", "found_inf")


def unscales_itself(optimizer: Optimizer) -> None:
    """Declare that ``optimizer`` unscales and skips by itself: GradScaler then hands it the scale
    and the inf flag (``scaler_handoff``) and calls ``step`` even on inf/NaN."""
    optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]


def scaler_handoff(optimizer: Optimizer) -> tuple[Any, Any]:
    """``(grad_scale, found_inf)`` as GradScaler set them on ``optimizer`` for this step (``None``
    outside a ``scaler.step``)."""
    return getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None)


def hide_scaler_handoff(optimizer: Optimizer) -> None:
    """Set the handoff to ``None`` (the stock kernels then neither unscale nor skip again);
    GradScaler deletes the attributes after a step that returned."""
    for attribute in _SCALER_ATTRIBUTES:
        setattr(optimizer, attribute, None)


def drop_scaler_handoff(optimizer: Optimizer) -> None:
    """Remove what GradScaler set, after a step that raised (GradScaler deletes it only after a
    step that returned), so the next ``scaler.step`` starts afresh."""
    for attribute in _SCALER_ATTRIBUTES:
        optimizer.__dict__.pop(attribute, None)


def grad_scaler_unscale_(grads: list[Any], found_inf: Any, inv_scale: Any) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place with GradScaler's own kernel (so the result is
    bitwise the scaler's), setting ``found_inf`` to 1 if any value is not finite."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


# -- foreach kernels -----------------------------------------------------------------------------------
foreach_sub = torch._foreach_sub
foreach_norm = torch._foreach_norm
fused_adamw_ = torch._fused_adamw_
