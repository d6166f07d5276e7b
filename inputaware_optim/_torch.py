"""The assumptions this library makes about ``torch.optim``'s step machinery, in one place.

Each is checked by ``tests/test_torch_assumptions.py``, so a torch release that changes one
fails there, by name, rather than somewhere in a rule.

* ``Optimizer.__init__`` wraps ``type(self).step`` once per class with
  ``Optimizer.profile_hook_step`` (which runs the global and per-instance step pre- and
  post-hooks around the call) and marks the wrapper ``hooked = True``; a ``step`` already
  marked is left alone. The wrapper is made with ``functools.wraps``, so ``__wrapped__`` leads
  to the function it wraps.
* ``nn.Module`` keeps its forward hooks and pre-hooks in ``_forward_hooks`` and
  ``_forward_pre_hooks`` (with the ``*_with_kwargs`` and ``_forward_hooks_always_called`` flags
  by the same key), and iterates over a copy of them when called, so a hook may remove itself.
  ``remove_hooks_of`` relies on it for hooks that arrive in a copied model without their handles.
* So a subclass whose ``step`` calls ``super().step()`` would run the hooks twice once the
  parent class was wrapped too (any plain instance of it created). ``entry_step`` below gives
  each input-aware ``step`` torch's own wrapper for the outermost call and lets nested calls
  through unwrapped; ``unhooked`` reaches a stock ``step`` without its wrapper.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer

__all__ = ["entry_step", "remove_hooks_of", "unhooked"]


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


_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
)


def remove_hooks_of(module: Any, owner: object) -> None:
    """Remove from ``module`` every forward hook and pre-hook that is a bound method of ``owner``
    (hooks copied with a model have no handle to remove them by)."""
    keys = [
        key
        for hooks in (module._forward_hooks, module._forward_pre_hooks)
        for key, hook in hooks.items()
        if getattr(hook, "__self__", None) is owner
    ]
    for name in _HOOK_DICTS:
        hooks = getattr(module, name)
        for key in keys:
            hooks.pop(key, None)
