"""Reduction: a reader's declaration of the statistics it needs, computed in the capture's hooks
(docs/writing-a-rule.md shows one; ``Reduction.reduce_calls`` computes the same from raw calls)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .inputs import Call

__all__ = ["Reduction", "add_statistics", "concatenate_statistics"]


def add_statistics(a: Any, b: Any) -> Any:
    """``a + b`` elementwise over tensors, numbers and (nested) tuples, lists and dicts."""
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, dict):
        return {k: add_statistics(a.get(k), b.get(k)) for k in {**a, **b}}
    if isinstance(a, (tuple, list)):
        return type(a)(add_statistics(x, y) for x, y in zip(a, b, strict=True))
    return a + b


def concatenate_statistics(a: Any, b: Any) -> Any:
    """``a`` and ``b`` concatenated along the first dimension (tensors), elementwise over (nested) tuples,
    lists and dicts: per-sample statistics of several calls, micro-batches or passes, one row per sample."""
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, dict):
        return {k: concatenate_statistics(a.get(k), b.get(k)) for k in {**a, **b}}
    if isinstance(a, (tuple, list)):
        return type(a)(concatenate_statistics(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Tensor):
        return torch.cat([a.reshape(1) if a.dim() == 0 else a, b.reshape(1) if b.dim() == 0 else b])
    raise TypeError(f"concatenate_statistics joins tensors (and containers of them), got {type(a).__name__}")


class Reduction:
    """Statistics computed from each captured call in the hooks, kept per parameter while its gradient holds the
    calls they came from. Override what you need; every method has a default:

    * ``wants(module)``: which watched modules it reads (default: all).
    * ``forward(call)``: in the forward hook (``call.args``, ``call.kwargs`` detached, valid only then); returns
      what to keep until the call's backward.
    * ``keeps_inputs`` (class attribute): ``forward`` keeps the inputs until backward; under non-reentrant
      checkpointing it then gets the inputs of the re-run in backward.
    * ``reads_output`` (class attribute): ``forward`` reads ``call.output``; compiled code's calls, whose
      readers run at the first gradient, then keep their output until then.
    * ``backward(call, kept)``: once the call's output gradients arrived (``call.grad_outputs``, with
      ``grad_outputs = True``); returns its statistics (default: ``kept``).
    * ``finish(entries)``: once a backward pass is complete, over ``(call, statistics)`` of each call it reached;
      returns ``{parameter: statistics}`` (default: each under ``keys(call.module)``).
    * ``combine(a, b)``: how statistics add up over calls and passes (default: a sum). Per-sample statistics
      (one row per sample) concatenate instead: ``combine = Reduction.concatenate``.
    * ``keys(module)``: the parameters a call's statistics are kept under (default: the module's own).
    * ``produced(module, grad_inputs)``, when a call's output node computed the gradients it sends back, and
      ``arrived(param, grad)``, when a gradient is about to be added to a parameter it keys
      (``receives(module, param)``): for auditing a gradient's sources. Defining ``produced`` turns both on.
    """

    grad_outputs: ClassVar[bool] = False
    keeps_inputs: ClassVar[bool] = False
    reads_output: ClassVar[bool] = False

    def wants(self, module: nn.Module) -> bool:
        return True

    def forward(self, call: Call) -> Any:
        return None

    def backward(self, call: Call, kept: Any) -> Any:
        return kept

    def finish(self, entries: Sequence[tuple[Call, Any]]) -> dict[Tensor, Any]:
        totals: dict[Tensor, Any] = {}
        for call, statistics in entries:
            if statistics is None:
                continue
            for key in self.keys(call.module):
                totals[key] = self.combine(totals.get(key), statistics)
        return totals

    def combine(self, a: Any, b: Any) -> Any:
        return add_statistics(a, b)

    def concatenate(self, a: Any, b: Any) -> Any:
        """A ``combine`` for per-sample statistics: concatenated along the first dimension (``combine =
        Reduction.concatenate`` in a subclass), so 2 micro-batches of 3 samples give 6 rows, not 3 sums."""
        return concatenate_statistics(a, b)

    def keys(self, module: nn.Module) -> tuple[Tensor, ...]:
        return tuple(p for p in module._parameters.values() if p is not None)

    def produced(self, module: nn.Module, grad_inputs: Sequence[Tensor | None]) -> None:
        return None

    def receives(self, module: nn.Module, param: Tensor) -> bool:
        return any(p is param for p in self.keys(module))

    def arrived(self, param: Tensor, grad: Tensor) -> None:
        return None

    def reduce_calls(self, calls: Iterable[Call]) -> dict[Tensor, Any]:
        """This reduction over raw calls, as the hooks would have computed it (one backward pass)."""
        entries = []
        with torch.no_grad():
            for call in (c for c in calls if self.wants(c.module)):
                if self.grad_outputs and not call.has_grad_outputs:
                    raise RuntimeError(
                        f"{type(self).__name__} needs output gradients, but {call!r} has none: capture "
                        "them (grad_outputs=True) for the calls handed to step(inputs=...)"
                    )
                entries.append((call, self.backward(call, self.forward(call))))
            return self.finish(entries)
