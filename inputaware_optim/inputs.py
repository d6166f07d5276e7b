"""What a rule reads: the captured forward calls (``Inputs``, of ``Captured`` entries, of each ``Call``)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["Call", "Captured", "Inputs", "UncapturedInputsWarning"]


class UncapturedInputsWarning(UserWarning):
    """A rule asked for the inputs of a parameter that has a gradient but no captured call."""


_LIBRARY = __name__.rsplit(".", 1)[0] + "."
_PASSED = ("torch.optim.", "torch.utils._contextlib", "torch.autograd.grad_mode")


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised here name the first caller outside the library (and
    outside torch's optimizer and no-grad wrappers around it): the line that called ``step()``."""
    frame: Any = sys._getframe(1)
    level = 1
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module.startswith(_LIBRARY) or module.startswith(_PASSED)):
            return level
        frame, level = frame.f_back, level + 1
    return 1


class Call:
    """One forward call of a module, as captured.

    Attributes:
        module: The module that was called.
        args: Every positional argument of the call (tensors detached).
        kwargs: Every keyword argument of the call (tensors detached).
        forward: Which forward of the root model the call was made in (a counter; ``None``
            for calls built by hand). Calls of one forward see the same samples. Compiled code
            counts no forward (a count read in traced code would recompile each time) unless a
            reader needs each forward's batch, as DP does: otherwise its calls keep the last count.
        output: What the call returned (tensors detached), in ``Reduction.forward``, which runs
            as the call returns (in compiled code, at its first gradient, for a reduction with
            ``reads_output``); ``None`` elsewhere (the capture keeps no output).
    """

    __slots__ = ("_grad_slot", "args", "forward", "kwargs", "module", "output")

    def __init__(
        self,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        grad_slot: list[Any] | None = None,
        forward: int | None = None,
        output: Any = None,
    ) -> None:
        self.module, self.args, self.kwargs, self.forward, self.output = module, args, kwargs, forward, output
        self._grad_slot = grad_slot

    @property
    def input(self) -> Any:
        """The first positional argument (what an ``nn.Linear`` calls its input)."""
        if not self.args:
            raise IndexError(f"this call of {type(self.module).__name__} had no positional argument")
        return self.args[0]

    @property
    def has_grad_outputs(self) -> bool:
        """Whether output gradients were captured for this call (``grad_outputs`` may be read)."""
        return self._grad_slot is not None

    @property
    def grad_outputs(self) -> tuple[Tensor | None, ...]:
        """The gradients that reached this call's output tensors in backward, one per tensor (in pytree
        leaf order; ``None`` where none arrived).

        Raises:
            RuntimeError: If output gradients were not captured (nobody asked for them).
        """
        if self._grad_slot is None:
            raise RuntimeError(_NO_GRAD_OUTPUTS.format(call=self))
        return tuple(self._grad_slot)

    @property
    def grad_output(self) -> Tensor | None:
        """The gradient of the first output tensor (``None`` if none arrived).

        Raises:
            RuntimeError: If output gradients were not captured (nobody asked for them).
        """
        if self._grad_slot is None:
            raise RuntimeError(_NO_GRAD_OUTPUTS.format(call=self))
        return self._grad_slot[0] if self._grad_slot else None

    def __repr__(self) -> str:
        def describe(x: Any) -> str:
            return f"Tensor{tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__

        args = ", ".join(describe(a) for a in self.args)
        kwargs = "".join(f", {k}={describe(v)}" for k, v in self.kwargs.items())
        return f"Call({type(self.module).__name__}({args}{kwargs}))"


_NO_GRAD_OUTPUTS = (
    "the output gradients of {call!r} were not captured: ask for them with grad_outputs = True on the Rule (or "
    "the Reduction whose backward reads them, or the optimizer subclass that reads raw calls), or "
    "grad_outputs=True on the optimizer or Capture"
)


class Captured:
    """The captured calls (``calls``, in capture order) of one module, or of the modules that share one parameter."""

    __slots__ = ("calls",)

    def __init__(self, calls: Sequence[Call]) -> None:
        self.calls: list[Call] = list(calls)

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        """The distinct modules these calls were made on, in order of first call."""
        return tuple({id(c.module): c.module for c in self.calls}.values())

    def __len__(self) -> int:
        return len(self.calls)

    def __iter__(self) -> Iterator[Call]:
        return iter(self.calls)

    def __getitem__(self, index: int) -> Call:
        return self.calls[index]

    def inputs(self, position: int = 0) -> list[Tensor]:
        """The positional argument at ``position`` of every call, in capture order."""
        return [_positional(c, position) for c in self.calls]

    def cat(self, position: int = 0, dim: int = 0) -> Tensor:
        """The positional argument at ``position`` of every call, concatenated along ``dim`` (with ``dim=0``:
        every micro-batch and repeated call as one batch)."""
        return torch.cat(self.inputs(position), dim=dim)

    def rows(self, position: int = 0) -> Tensor:
        """Every call's argument at ``position`` reshaped to ``(-1, last_dim)`` and concatenated: one row per
        sample and position, as ``nn.Linear`` sees them (one call's: a view, not a copy). The rows a layer's
        ``LayerKind.input_rows`` are built from."""
        rows = [x.reshape(-1, x.shape[-1]) for x in self.inputs(position)]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def grad_outputs(self, position: int = 0) -> list[Tensor]:
        """The gradient that reached output ``position`` of every call, in capture order.

        Raises:
            RuntimeError: If output gradients were not captured, or a call's output got none.
        """
        grads: list[Tensor] = []
        for call in self.calls:
            got = call.grad_outputs  # (raises, naming the flag, if they were not captured)
            grad = got[position] if position < len(got) else None
            if grad is None:
                raise RuntimeError(
                    f"no gradient reached output {position} of {call!r}: run backward() through "
                    "this call's output before step(), or skip calls whose output is unused"
                )
            grads.append(grad)
        return grads

    def grad_output_rows(self, position: int = 0) -> Tensor:
        """Every call's output gradient at ``position``, reshaped to ``(-1, last_dim)`` and concatenated."""
        return torch.cat([g.reshape(-1, g.shape[-1]) for g in self.grad_outputs(position)])

    def __repr__(self) -> str:
        return f"Captured({len(self.calls)} calls of {', '.join(type(m).__name__ for m in self.modules)})"


def _check_owned(
    param: Tensor, entry: Captured, parameter_names: Mapping[Tensor, str], module_name: Callable[[nn.Module], str]
) -> None:
    """Refuse calls given for ``param`` of a module that does not own it (its gradient holds no such call)."""
    other = next((m for m in entry.modules if not any(p is param for p in m._parameters.values())), None)
    if other is not None:
        name = parameter_names.get(param) or f"a parameter of shape {tuple(param.shape)}"
        raise TypeError(
            f"step(inputs=...) gives {name} the calls of {module_name(other)} ({type(other).__name__}), which does "
            "not own it: a parameter's inputs are the calls of the module that owns it (those its gradient holds). "
            "Give it its own module's calls, or key the calls by their module. No parameter was changed"
        )


def _positional(call: Call, position: int) -> Any:
    if position >= len(call.args):
        raise IndexError(f"{call!r} has {len(call.args)} positional argument(s); position {position} does not exist")
    return call.args[position]


class Inputs(Mapping[nn.Module, Captured]):
    """The forward calls captured for one step, looked up by module or by parameter.

    ``inputs[m]`` gives the ``Captured`` calls of module ``m``, ``inputs[p]`` those of the module(s) that directly
    own parameter ``p`` (tied weights: merged in capture order). ``get`` returns ``None`` where nothing was
    captured; ``[]`` raises a ``KeyError`` that says why. Iteration yields the modules with at least one call,
    in order of first call."""

    def __init__(
        self,
        calls: Callable[[], Any] | Sequence[Call],
        owners: Mapping[Tensor, tuple[nn.Module, ...]] | None = None,
        names: Mapping[nn.Module, str] | None = None,
        direct: Mapping[Tensor, Captured | Sequence[Call]] | None = None,
        on_missing: Callable[[Tensor], None] | None = None,
        reduced: Any = None,
        calls_kept: Callable[[], bool] | None = None,
    ) -> None:
        # ``calls``: the calls, or a function returning them or ``(calls, calls by parameter)``, read at each access.
        fixed = None if callable(calls) else list(calls)
        self._source: Callable[[], Any] = calls if callable(calls) else (lambda: fixed)
        self._owners: Mapping[Tensor, tuple[nn.Module, ...]] = owners or {}
        self._names: Mapping[nn.Module, str] = names or {}
        self._direct: dict[Tensor, Captured] = {
            p: c if isinstance(c, Captured) else Captured(c) for p, c in (direct or {}).items()
        }
        self._by_param: Mapping[Tensor, Sequence[Call]] | None = None
        self._seen: Any = None
        self._calls: Sequence[Call] = []
        self._by_module: dict[nn.Module, list[Call]] = {}
        self._expired: str | None = None
        self._on_missing = on_missing
        self._reduced = reduced  # a Capture (live), a dict of reduction -> totals, or None
        self._calls_kept = calls_kept  # (live: whether the capture keeps raw calls now)

    @classmethod
    def from_mapping(
        cls,
        mapping: Mapping[Any, Any],
        owners: Mapping[Tensor, tuple[nn.Module, ...]] | None = None,
        names: Mapping[nn.Module, str] | None = None,
        *,
        parameter_names: Mapping[Tensor, str] | None = None,
        module_name: Callable[[nn.Module], str] | None = None,
    ) -> Inputs:
        """Build ``Inputs`` from a mapping of modules or parameters to ``Captured`` (or lists of ``Call``); other
        keys or values raise ``TypeError``, and so do calls of a module that is not the key, or does not own it
        (``parameter_names`` and ``module_name`` name them in the error)."""
        calls: list[Call] = []
        direct: dict[Tensor, Captured] = {}
        for key, value in mapping.items():
            listed = isinstance(value, Iterable) and not isinstance(value, (Captured, Tensor, str, bytes))
            entry = value if isinstance(value, Captured) else Captured(list(value)) if listed else None
            if entry is None or not all(isinstance(c, Call) for c in entry.calls):
                raise TypeError(
                    f"inputs= mapping values must be Captured entries or lists of Call, got {value!r:.60} for key "
                    f"{key!r:.60}"
                )
            if isinstance(key, nn.Module):
                if any(c.module is not key for c in entry.calls):
                    raise TypeError(f"inputs= holds calls of another module under the key {key!r:.60}")
                calls.extend(entry.calls)
            elif isinstance(key, Tensor):
                _check_owned(key, entry, parameter_names or {}, module_name or (lambda m: type(m).__name__))
                direct[key] = entry
            else:
                raise TypeError(f"inputs= mapping keys must be modules or parameters, got {type(key).__name__}")
        return cls(calls, owners, names, direct)

    @property
    def calls(self) -> list[Call]:
        """Every captured call, of every module, in capture order."""
        return list(self._current())

    def __getitem__(self, key: nn.Module | Tensor) -> Captured:  # type: ignore[override]
        entry = self.get(key)
        if entry is None:
            raise KeyError(self._why_missing(key))
        return entry

    def get(self, key: nn.Module | Tensor, default: Any = None) -> Any:  # type: ignore[override]
        """The ``Captured`` calls for a module or parameter, or ``default`` if none were captured."""
        self._current()
        if isinstance(key, nn.Module):
            calls = self._by_module.get(key)
            return Captured(calls) if calls else default
        if isinstance(key, Tensor):
            if key in self._direct:
                return self._direct[key]
            modules = self._owners.get(key, ())
            if self._by_param is not None:  # from a capture: exactly the calls in this gradient
                found = self._by_param.get(key)
            elif len(modules) == 1:
                found = self._by_module.get(modules[0])
            else:
                found = [c for c in self._calls if any(c.module is m for m in modules)]
            if found:
                return Captured(found)
            if modules and key.grad is not None and self._on_missing is not None:
                self._on_missing(key)
        return default

    def __contains__(self, key: object) -> bool:
        return isinstance(key, (nn.Module, Tensor)) and self.get(key) is not None

    def __iter__(self) -> Iterator[nn.Module]:
        self._current()
        return iter(list(self._by_module))

    def __len__(self) -> int:
        self._current()
        return len(self._by_module)

    def __repr__(self) -> str:
        if self._expired:
            return "Inputs(<expired>)"
        self._current()
        parts = ", ".join(f"{self._name(m)}: {len(c)}" for m, c in self._by_module.items())
        return f"Inputs({{{parts}}})"

    def reduced(self, reduction: Any) -> dict[Tensor, Any]:
        """What ``reduction`` (a ``Reduction``) gives for this step, per parameter: from the capture's hooks, or
        computed from the calls held here (``Reduction.reduce_calls``), with the same result.

        Raises:
            RuntimeError: If the capture neither computes ``reduction`` nor keeps raw calls to compute it from
                (a rule that reads it must declare it: ``reads = [reduction]``).
        """
        source = self._reduced  # (None once expired: self.calls raises then)
        if isinstance(source, dict) and reduction in source:
            return source[reduction]
        if source is not None and not isinstance(source, dict) and reduction in source.reductions:
            return source.reduced(reduction)
        if self._calls_kept is not None and not self._calls_kept():
            raise RuntimeError(
                f"{type(reduction).__name__} is not computed by this optimizer's capture, and no raw call is kept "
                "to compute it from: declare it where it is read, reads = [reduction] on the Rule (or reads= of "
                "register_inputs_hook), or add it with optimizer.capture.add_reduction(reduction) before the forward"
            )
        return reduction.reduce_calls(self.calls)

    def uncaptured(self, param: Tensor) -> None:
        """Say (an ``UncapturedInputsWarning``, once per module and step, naming the likely cause) that a rule
        treats ``param`` as uncaptured: it has a gradient but no captured call explains it. For a rule that
        reads reductions and found none for ``param``; reading raw calls says it by itself."""
        if self._on_missing is not None and self._owners.get(param) and param.grad is not None:
            self._on_missing(param)

    def _current(self) -> Sequence[Call]:
        if self._expired is not None:
            raise RuntimeError(self._expired)
        if self._calls_kept is not None and not self._calls_kept():
            raise RuntimeError(
                "raw calls are not kept by this optimizer's capture: no rule or hook declared that it reads them. "
                "A Rule that reads inputs.get(p) or inputs[module] declares reads = 'calls' (or includes 'calls' in "
                "its reads list); an optimizer subclass that overrides step sets reads_calls = True (not False); a "
                "hook passes reads='calls'. A rule that needs only statistics reads inputs.reduced(reduction)"
            )
        got = self._source()
        if got is not self._seen:
            calls, by_param = got if isinstance(got, tuple) else (got, None)
            self._by_module = {}
            for call in calls:
                self._by_module.setdefault(call.module, []).append(call)
            self._seen, self._calls, self._by_param = got, calls, by_param
        return self._calls

    def _expire(self, message: str) -> None:
        self._expired, self._source, self._on_missing = message, lambda: [], None  # it keeps no capture alive
        self._calls_kept = None
        self._seen, self._calls, self._by_param, self._by_module, self._reduced = None, [], None, {}, None

    def _name(self, module: nn.Module) -> str:
        return self._names.get(module) or type(module).__name__

    def _why_missing(self, key: object) -> str:
        since = "in the gradient this step reads"
        if isinstance(key, nn.Module):
            if self._names and key not in self._names:
                return (
                    f"{type(key).__name__} is not captured: it owns no parameter of this optimizer "
                    "(or its type is not among the rule's captured module types)"
                )
            return (
                f"no forward call of {self._name(key)} was captured {since}. Calls made under "
                "torch.no_grad() or inference_mode() are not captured, a call counts once a backward "
                "carried its gradient into the parameters, and clearing the gradient (zero_grad) drops it"
            )
        if isinstance(key, Tensor):
            modules = self._owners.get(key)
            if not modules:
                return (
                    f"no captured module owns this tensor (shape {tuple(key.shape)}): it is not a "
                    "parameter of this optimizer, or the module that owns it is not captured"
                )
            names = ", ".join(self._name(m) for m in modules)
            return (
                f"no forward call of {names} (which owns this parameter) was captured {since}. "
                "Calls under torch.no_grad() are not captured; a weight used without calling its "
                "module (as nn.MultiheadAttention does with out_proj) is never captured"
            )
        return f"Inputs are looked up by module or parameter, not {type(key).__name__}"
