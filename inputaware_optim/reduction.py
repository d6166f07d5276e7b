"""Reduction: a reader's declaration of the statistics it needs, computed where the data is.

A rule that needs only statistics of the inputs (and output gradients) declares a
``Reduction`` instead of reading raw calls. The capture then runs it in the hooks: at
each forward call (``forward``), when the call's output gradient arrives in backward
(``backward``), and once each backward pass is complete (``finish``). What is kept
between forward and ``step()`` is what these return, summed over the calls whose
gradient is in each parameter's ``.grad`` (``combine``), never the input tensors::

    class InputPower(Reduction):
        def wants(self, module):
            return isinstance(module, nn.Linear)

        def forward(self, call):                      # in the forward hook
            x = call.input
            return x.pow(2).sum(), x.new_tensor(float(x.numel() // x.shape[-1]))

    power = InputPower()
    capture.add_reduction(power)                      # or, in a rule: self.capture.add_reduction(power)
    ...
    totals = inputs.reduced(power)                    # {parameter: (sum of squares, rows)}

The same reduction applied to raw calls (``Inputs`` built from a mapping, or a custom rule
that reads calls) gives the same result: ``Reduction.reduce_calls``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .inputs import Call

__all__ = ["Reduction", "add_statistics"]


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


class Reduction:
    """Statistics computed from each captured call in the hooks, kept per parameter.

    Override what you need; every method has a default:

    * ``wants(module)``: which watched modules this reduction reads (default: all).
    * ``forward(call)``: runs in the forward hook, with ``call.module``, ``call.args`` and
      ``call.kwargs`` (detached; valid only during the call). Returns what to keep until the
      call's backward: small statistics, or a tensor the backward side needs.
    * ``keeps_inputs`` (class attribute): ``forward`` keeps the inputs until the call's backward;
      under activation checkpointing it then gets the inputs recomputed in backward.
    * ``backward(call, kept)``: runs when the call's output gradients have arrived
      (``call.grad_outputs``, with ``grad_outputs = True``). Returns the call's statistics
      (default: ``kept``).
    * ``finish(entries)``: runs once a backward pass is complete, with ``(call, statistics)``
      for every call it reached. Returns ``{parameter: statistics}`` (default: each call's
      statistics under each of ``keys(call.module)``, combined).
    * ``combine(a, b)``: how statistics add up over calls and backward passes (default: a sum).
    * ``keys(module)``: the parameters a call's statistics are kept under (default: the
      module's own parameters).
    * ``produced(module, grad_inputs)`` and ``arrived(param, grad)``, for a reader that audits
      where a parameter's gradient came from: the first runs when a call's output node has
      computed the gradients it sends back (``grad_inputs``), the second when a gradient is about to
      be added to the ``.grad`` of a parameter it keys (``receives(module, param)``). Defining
      ``produced`` turns both on.

    Statistics under a parameter are kept exactly while that parameter's gradient holds the
    calls they came from: a gradient cleared (``zero_grad``, ``p.grad = None``) drops them,
    a call whose output never reached a backward never arrives.
    """

    grad_outputs: ClassVar[bool] = False
    # Whether ``forward`` keeps the call's inputs themselves until its backward (say, per-sample
    # gradients that need inputs and output gradients together). Inside a non-reentrant
    # activation-checkpointed region the capture then calls ``forward`` with the inputs of the
    # re-run in backward instead of the original ones, so checkpointing keeps its savings.
    keeps_inputs: ClassVar[bool] = False

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
            for call in calls:
                if not self.wants(call.module):
                    continue
                if self.grad_outputs and call.grad_outputs is None:
                    raise RuntimeError(
                        f"{type(self).__name__} needs output gradients, but {call!r} has none: capture "
                        "them (grad_outputs=True) for the calls handed to step(inputs=...)"
                    )
                entries.append((call, self.backward(call, self.forward(call))))
            return self.finish(entries)
