"""``NonFiniteFinder``: where a step's first non-finite value arose (a module's forward, its input, its backward, or
the loss), read through the capture's own hooks (docs/monitoring.md)."""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ._torch import kernel_skips_step, tree_flatten
from .base import InputAwareOptimizer
from .capture import Capture
from .monitor import (
    _after_closure,
    _as_float64,
    _dense_values,
    _loaded_step,
    _not_copied,
    _params,
    _per_tensor_norms,
    _warn_if_private,
    unwrap_optimizer,
)

__all__ = ["NonFiniteError", "NonFiniteFinder", "NonFiniteOrigin", "NonFiniteWarning"]

# Calls a NonFiniteFinder keeps between two checks at most (bounds forwards that never reach a backward).
_MAX_CALLS = 100_000

# What torch.compile(fullgraph=True) says of the finder's callbacks (their reason to run eagerly).
_EAGER = (
    "NonFiniteFinder watches every call of the model eagerly, a graph break at each watched call, which "
    "torch.compile(fullgraph=True) refuses: compile without fullgraph=True, or remove() the NonFiniteFinder "
    "(attach it to find a non-finite step, and leave it off where a compiled model's speed matters)"
)


class NonFiniteWarning(UserWarning):
    """A step's gradient was not finite; the message names where the first non-finite value arose."""


class NonFiniteError(FloatingPointError):
    """Raised instead of ``NonFiniteWarning`` by a ``NonFiniteFinder(action="raise")``; the step is not taken."""

    def __init__(self, message: str, origin: NonFiniteOrigin | None) -> None:
        super().__init__(message)
        self.origin = origin


@dataclass(frozen=True)
class NonFiniteOrigin:
    """Where a step's first non-finite value arose.

    Attributes:
        module: The qualified name of the module (``""`` for the loss).
        call: Which call of that module in the step (0 for its first).
        step: The step (counted from 0 when the finder was attached).
        phase: ``"forward"`` (inputs finite, output not); ``"input"`` (the first call with a non-finite input, which
            came from the data or code outside modules); ``"backward"`` (output gradient finite, the gradient it
            produced not); ``"loss"`` (every output finite, the gradient reaching the model's output not).
    """

    module: str
    call: int
    step: int
    phase: Literal["forward", "input", "backward", "loss"]

    def describe(self) -> str:
        if self.phase == "forward":
            what = "in the forward: its inputs were finite, its output was not"
        elif self.phase == "input":
            what = "got a non-finite input from the data or from code outside modules (no module made one)"
        elif self.phase == "backward":
            what = "in the backward: the gradient reaching its output was finite, the gradient it produced was not"
        else:
            return f"step {self.step}: every module's output was finite; the gradient of the loss was not"
        return f"step {self.step}: {self.module} (call {self.call}) {what}"


@dataclass(slots=True, eq=False)
class _Tensor:
    """A tensor a hooked call saw: its sum and its gradient's (0-d, non-finite wherever a value is)."""

    ref: weakref.ref[Tensor]
    version: int
    forward: int
    total: Tensor
    grad: Tensor | None = None
    arrival: int | None = None  # when its gradient arrived, in backward order
    finite: bool = True  # (these two set when a step is looked into)
    grad_finite: bool = True


@dataclass(slots=True, eq=False)  # (compared by identity: calls.index)
class _Seen:
    """One call of a hooked module: the tensors it took and returned."""

    module: nn.Module
    inputs: list[_Tensor]
    outputs: list[_Tensor]


def _total(t: Tensor) -> Tensor:
    """The sum of ``t`` in its own dtype (float32 for float16, whose range a sum leaves quickly)."""
    t = t.detach()
    return t.sum(dtype=torch.float32) if t.dtype == torch.float16 else t.sum()


def _computes(module: nn.Module) -> bool:
    """What the finder watches: leaf modules and containers that own a parameter themselves."""
    return not module._modules or any(p is not None for p in module._parameters.values())


class _Watch:
    """What the finder's hooks saw since the last check. The hooks hold this, never the finder or
    its optimizer, so dropping those (or the finder's ``remove()``) takes everything off the model."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.forward = 0  # the model's forwards, counted by the root's pre-hook
        self.calls: dict[int, list[_Seen]] = {}  # by forward, in forward order
        self.size = 0
        self.tensors: dict[int, _Tensor] = {}  # by id, each tensor summed (and hooked) once per version
        self.reached: set[int] = set()  # the forwards a gradient came back to
        self.arrivals = 0

    def open_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if not torch.is_grad_enabled():
            return
        self.forward += 1
        # A forward whose outputs were dropped without a backward (an evaluation with grad enabled)
        # can never reach one: forget it.
        dropped = [
            f
            for f, calls in self.calls.items()
            if f not in self.reached and all(o.ref() is None for c in calls for o in c.outputs)
        ]
        if dropped:
            for f in dropped:
                self.size -= len(self.calls.pop(f))
            self.tensors = {k: v for k, v in self.tensors.items() if v.ref() is not None}

    def record(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or self.size >= _MAX_CALLS:
            return
        given = args if not kwargs else (*args, *kwargs.values())
        returned = [output] if type(output) is Tensor else tree_flatten(output)[0]
        inputs = [self._track(t) for t in given if isinstance(t, Tensor) and t.is_floating_point() and t.numel()]
        outputs = [self._track(t) for t in returned if isinstance(t, Tensor) and t.is_floating_point() and t.numel()]
        self.calls.setdefault(self.forward, []).append(_Seen(module, inputs, outputs))
        self.size += 1

    def _track(self, t: Tensor) -> _Tensor:
        """Each tensor summed, and its gradient hooked, once (one module's output is the next one's input)."""
        version = -1 if t.is_inference() else t._version
        entry = self.tensors.get(id(t))
        if entry is not None and entry.ref() is t and entry.version == version:
            return entry
        entry = self.tensors[id(t)] = _Tensor(weakref.ref(t), version, self.forward, _total(t))
        if t.requires_grad:
            t.register_hook(functools.partial(self._gradient, entry))
        return entry

    def _gradient(self, entry: _Tensor, grad: Tensor) -> None:
        total = _total(grad)
        entry.grad = total if entry.grad is None else entry.grad + total
        if entry.arrival is None:
            entry.arrival = self.arrivals
            self.arrivals += 1
        self.reached.add(entry.forward)

    def origin(self, step: int, name: Callable[[nn.Module], str]) -> NonFiniteOrigin | None:
        """Where a non-finite step began, over the calls of the forwards that reached a backward."""
        calls = [c for f, group in self.calls.items() if f in self.reached for c in group]
        _mark_finite(list({id(e): e for c in calls for e in (*c.inputs, *c.outputs)}.values()))
        found = _forward_origin(calls) or _backward_origin(calls)
        if found is None:
            return None
        call, phase = found
        if call is None:
            return NonFiniteOrigin("", 0, step, "loss")
        number = sum(c.module is call.module for c in calls[: calls.index(call)])
        return NonFiniteOrigin(name(call.module), number, step, phase)


_Found = tuple[_Seen | None, Literal["forward", "input", "backward", "loss"]]


def _forward_origin(calls: list[_Seen]) -> _Found | None:
    for c in calls:
        if all(e.finite for e in c.inputs) and not all(e.finite for e in c.outputs):
            return c, "forward"
    return next(((c, "input") for c in calls if not all(e.finite for e in c.inputs)), None)


def _arrival(c: _Seen) -> int:
    """When the first gradient reached one of the call's outputs (-1: none did)."""
    return min((e.arrival for e in c.outputs if e.arrival is not None), default=-1)


def _backward_origin(calls: list[_Seen]) -> _Found | None:
    """The backward phase of ``NonFiniteFinder``'s rule (innermost module first), else the loss."""
    arrived = sorted((c for c in calls if _arrival(c) >= 0), key=_arrival)
    # A parameter's gradient sums over the module's calls: it names the module only where the
    # gradient reaching every one of its calls was finite.
    clean = {c.module for c in calls} - {c.module for c in calls if not _grads_finite(c.outputs)}
    candidates = [
        c
        for c in arrived
        if _grads_finite(c.outputs)
        and (not _grads_finite(c.inputs) or (c.module in clean and not _parameter_gradients_finite(c.module)))
    ]
    # A module whose gradient went bad inside a hooked submodule is a candidate too: name the innermost.
    inside = {c.module: {id(m) for m in c.module.modules()} for c in candidates}
    inner = [
        c
        for c in candidates
        if not any(o.module is not c.module and id(o.module) in inside[c.module] for o in candidates)
    ]
    if inner:
        return inner[0], "backward"
    if arrived and not _grads_finite(arrived[0].outputs):
        return None, "loss"
    return None


def _grads_finite(tensors: list[_Tensor]) -> bool:
    return all(e.grad_finite for e in tensors)


def _mark_finite(tensors: list[_Tensor]) -> None:
    """Set ``finite`` and ``grad_finite`` on each tensor, with one host synchronization."""
    grads = {e: e.grad for e in tensors if e.grad is not None}
    flags = torch.isfinite(_as_float64([*(e.total for e in tensors), *grads.values()])).tolist()
    for e, flag in zip(tensors, flags, strict=False):
        e.finite = flag
    for e, flag in zip(grads, flags[len(tensors) :], strict=True):
        e.grad_finite = flag


def _parameter_gradients_finite(module: nn.Module) -> bool:
    grads = [_dense_values(p.grad) for p in module._parameters.values() if p is not None and p.grad is not None]
    return all(bool(torch.isfinite(g).all()) for g in grads)


def _all_finite(tensors: list[Tensor]) -> bool:
    """Whether every value is finite, with one host sync: a total per tensor (a sum on CPU, a norm elsewhere),
    its values checked where that overflowed."""
    totals = [t.sum() for t in tensors] if tensors[0].device.type == "cpu" else _per_tensor_norms(tensors)
    flags = torch.isfinite(_as_float64(totals))
    if bool(flags.all()):
        return True
    return all(flag or bool(torch.isfinite(t).all()) for t, flag in zip(tensors, flags.tolist(), strict=True))


class NonFiniteFinder(contextlib.AbstractContextManager["NonFiniteFinder"]):
    """Names where a step's first non-finite value arose, when its gradient is not finite.

    It names the first module call in forward order whose inputs were finite and whose output was not; else the first
    whose input was not; else the first in backward order whose output gradient was finite and whose input gradient (or
    own parameter's) was not. It lives as long as its optimizer; ``remove()`` takes it off.

    Args:
        optimizer: An input-aware optimizer, or any ``torch.optim.Optimizer`` (then give ``model``), or
            a trainer's wrapper of one (Accelerate's ``AcceleratedOptimizer``: the one inside is watched).
        model: The model (or a ``Capture`` of it, say a ``Monitor``'s, to share its hooks) for a
            plain ``torch.optim`` optimizer (default: the optimizer's).
        action: ``"warn"`` (a ``NonFiniteWarning``) or ``"raise"`` (a ``NonFiniteError`` before the
            update, so the step is not taken).

    Attributes:
        found: The latest ``NonFiniteOrigin`` found (``None`` until a step is not finite).
        step: The number its reports give the coming step: 0 when attached, counting the steps taken (one
            it refuses is not, as for the optimizer and a ``Monitor``); a resumed run loads the
            ``state_dict()`` it saved (``{"step": n}``) to report the numbers of the run without the break.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | Capture | None = None,
        *,
        action: Literal["warn", "raise"] = "warn",
    ) -> None:
        if action not in ("warn", "raise"):
            raise ValueError(f"Invalid action: {action!r}; choose 'warn' or 'raise'")
        optimizer = unwrap_optimizer(optimizer)
        _warn_if_private(
            optimizer,
            "NonFiniteFinder",
            "its reports name where the batch's own gradient, before clipping and noise, was not finite (and "
            'action="raise" skips a step by it)',
        )
        if model is None:
            if not isinstance(optimizer, InputAwareOptimizer):
                raise TypeError(
                    f"NonFiniteFinder needs the model to watch a plain {type(optimizer).__name__}: "
                    "NonFiniteFinder(optimizer, model)"
                )
            model = optimizer.model
        self.optimizer = optimizer
        self.action = action
        self.found: NonFiniteOrigin | None = None
        self.step = 0
        self._own_capture: Capture | None = None
        if isinstance(model, Capture):
            self.capture = model
        elif isinstance(optimizer, InputAwareOptimizer) and model is optimizer.model:
            self.capture = optimizer.capture
        else:  # a plain optimizer: a capture of its own, with nothing but this watch
            self.capture = self._own_capture = Capture(model, [], keep_calls=False)
        self._watch = _Watch()
        # The capture's own hooks call the watch: the model carries no hook of the finder's.
        self._watching = self.capture.watch(_computes, self._watch.record, self._watch.open_forward, reason=_EAGER)
        self._finalizer = weakref.finalize(self, self._watching.remove)
        self._skipped = False
        # A step counts once taken (after the update): one it refuses, or anything else does, is not a step,
        # so its numbers stay the optimizer's and a Monitor's.
        if isinstance(optimizer, InputAwareOptimizer):  # its pre-step hooks run once the closure has
            self._step_handles: list[Any] = [
                optimizer.register_inputs_hook(
                    lambda optimizer, inputs: self._before_step(optimizer, (), {}), reads=None
                ),
                optimizer.register_inputs_hook(lambda *_: self._after_step(), when="post", reads=None),
            ]
        else:
            self._step_handles = [
                optimizer.register_step_pre_hook(self._before_step),
                optimizer.register_step_post_hook(lambda *_: self._after_step()),
            ]

    def _before_step(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._skipped = kernel_skips_step(optimizer)  # (fused, under GradScaler: a loss-scale overflow, skipped)
        if self._skipped:
            self._watch.reset()
            return None
        step = self.step
        wrapped = _after_closure(args, kwargs, lambda: self._check(step))
        if wrapped is None:
            self._check(step)
        return wrapped

    def _after_step(self) -> None:
        skipped, self._skipped = self._skipped, False
        self.step += 0 if skipped else 1

    def _check(self, step: int) -> None:
        try:
            grads = [_dense_values(p.grad) for p in _params(self.optimizer) if p.grad is not None]
            if not grads or _all_finite(grads):
                return
            origin = self.found = self._watch.origin(step, self.capture.name)
            message = "the gradient is not finite; " + (
                origin.describe()
                if origin
                else f"step {step}: no module call of this process explains it (under data parallelism, "
                "another rank's report names it)"
            )
            if self.action == "raise":
                raise NonFiniteError(message, origin)
            warnings.warn(message, NonFiniteWarning, stacklevel=3)
        finally:
            self._watch.reset()

    def state_dict(self) -> dict[str, int]:
        """``{"step": n}``: the number its reports give the coming step (for a checkpoint)."""
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Number the coming step ``state_dict["step"]`` in reports, as a resumed run continues.

        Raises:
            ValueError: If the step is not an integer >= 0.
        """
        self.step = _loaded_step(state_dict, "NonFiniteFinder")

    def remove(self) -> None:
        """Take the hooks off the model and the optimizer."""
        for handle in self._step_handles:
            handle.remove()
        self._finalizer()
        if self._own_capture is not None:
            self._own_capture.remove()
        self._watch.reset()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise _not_copied(
            "NonFiniteFinder", "NonFiniteFinder(copied_optimizer, ...).load_state_dict(finder.state_dict())"
        )
