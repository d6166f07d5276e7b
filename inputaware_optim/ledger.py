"""The gradient ledger: which forward calls (and which readers' statistics) each parameter's ``.grad`` holds, the
invariant the capture stands on (docs/capture.md, "What a parameter holds").

A backward pass that accumulates into a gradient adds its calls to it; a gradient replaced (cleared to ``None``,
assigned by hand) holds nothing; one rescaled in place (unscaled, clipped) holds what it held; one zeroed in place
(``zero_grad(set_to_none=False)``) holds nothing, unless every gradient was rescaled together (a zero gradient
unscaled); a gradient ``torch.autograd.grad`` returned holds its pass's calls until it is assigned to ``.grad``.
Entries are compared by identity; a gradient is never compared by value, only by id and version counter."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from . import _torch

__all__ = ["Entry", "GradientLedger"]


@dataclasses.dataclass(slots=True, eq=False)
class Entry:
    """What one parameter's gradient holds: its calls and the readers' statistics (``param`` ``None``: a
    watched module that owns no parameter, whose calls count from their backward until released)."""

    param: Tensor | None
    calls: list[Any] = dataclasses.field(default_factory=list)
    totals: dict[Any, Any] = dataclasses.field(default_factory=dict)  # reduction -> statistics
    grad: weakref.ref[Tensor] | None = None  # the gradient seen at the last commit
    released: weakref.ref[Tensor] | None = None  # the gradient whose calls the last step released
    version: int = 0
    accumulator: Any = None  # the parameter's AccumulateGrad node, once asked for

    def state(self) -> tuple[int, int, Tensor | None]:
        """The gradient's id, version and itself (kept alive, it keeps its id): ``!=`` compares ids, never tensors."""
        grad = self.param.grad if self.param is not None else None
        return (id(grad), -1 if grad is None else grad._version, grad)

    def holds(self) -> bool:
        return bool(self.calls or self.totals)

    def drop(self) -> None:
        self.calls, self.totals, self.grad = [], {}, None

    def status(self) -> str:
        """Since the last commit: ``"same"``, ``"replaced"`` (cleared), ``"scaled"`` (changed in place,
        not all zeros) or ``"zeroed"`` (in place, all zeros: cleared, or a zero gradient rescaled)."""
        grad = self.param.grad if self.param is not None else None
        if grad is None or self.grad is None or self.grad() is not grad:
            return "replaced"
        if grad._version == self.version:
            return "same"
        values = grad.coalesce().values() if grad.is_sparse else grad
        if values.numel() == 0:
            return "same"
        return "scaled" if bool(values.any()) else "zeroed"

    def reach(self) -> str:
        """What the current pass does with this gradient: accumulates it, returns it (``autograd.grad``) or skips it."""
        if self.param is not None and not self.param.requires_grad:
            return _torch.SKIPS
        if self.find_accumulator() is None:
            return _torch.ACCUMULATES  # no parameter, or none to ask (compiled code's backward): as a plain backward
        return _torch.pass_reaches(self.accumulator)

    def find_accumulator(self) -> Any:
        """The parameter's ``AccumulateGrad`` node, looked up once (compiled code's backward cannot), or ``None``."""
        if self.accumulator is None and self.param is not None and self.param.requires_grad:
            with contextlib.suppress(Exception):  # (a tensor subclass or mode without one)
                self.accumulator = torch.autograd.graph.get_gradient_edge(self.param).node
        return self.accumulator

    def commit(self) -> None:
        grad = self.param.grad if self.param is not None else None
        if grad is not None:
            self.grad, self.version = weakref.ref(grad), grad._version


class GradientLedger:
    """One entry per parameter the capture follows, and the gradients ``autograd.grad`` returned (by the id of
    the tensor, until it is assigned to ``.grad`` or dies). ``generation`` changes whenever what the entries
    hold does (readers cache by it)."""

    def __init__(self) -> None:
        self.entries: dict[Tensor, Entry] = {}
        self.returned: dict[int, Entry] = {}
        self.generation = 0
        self.filled = False  # some entry was given calls, statistics or a gradient since the last release
        self.released_some = False  # the last release released what some entry held
        self.rescaled = False  # some gradient was rescaled in place since the last commit

    def entry(self, param: Tensor) -> Entry:
        """``param``'s entry (made empty the first time)."""
        found = self.entries.get(param)
        if found is None:
            found = self.entries[param] = Entry(param)
        return found

    def forget(self, live: set[Entry]) -> None:
        """Drop the entries not in ``live`` (their modules are no longer watched)."""
        for param in [p for p, entry in self.entries.items() if entry not in live]:
            del self.entries[param]
        self.generation += 1

    def refresh(self) -> None:
        """Drop what cleared gradients held; a returned gradient assigned to ``.grad`` gets its calls."""
        changed = bool(self.returned) and any([self._adopt(entry) for entry in self.entries.values()])
        statuses = {entry: entry.status() for entry in self.entries.values() if entry.holds()}
        self.rescaled = self.rescaled or "scaled" in statuses.values()
        if not self.rescaled and "zeroed" in statuses.values():
            # A clear zeroes every gradient it reaches; a rescaling of a zero gradient leaves the others
            # nonzero: a rescaling if another gradient committed since was rescaled too.
            others = (e for e in self.entries.values() if e.grad is not None and statuses.get(e) != "zeroed")
            self.rescaled = any(e.status() == "scaled" for e in others)
        for entry, status in statuses.items():
            if status == "replaced" or (status == "zeroed" and not self.rescaled):
                entry.drop()
                changed = True
            elif status != "same":  # rescaled in place: it holds the same calls
                entry.version = entry.param.grad._version  # type: ignore[union-attr]
        if changed:
            self.generation += 1

    def _adopt(self, entry: Entry) -> bool:
        """If ``entry``'s gradient is a tensor ``autograd.grad`` returned, give it that pass's calls."""
        grad = entry.param.grad if entry.param is not None else None
        if grad is None or (entry.grad is not None and entry.grad() is grad):
            return False
        returned = self.returned.get(id(grad))
        if (
            returned is None
            or returned.param is not entry.param
            or returned.grad is None
            or returned.grad() is not grad
        ):
            return False
        del self.returned[id(grad)]
        self.filled = True
        entry.calls, entry.totals, entry.grad, entry.version = (
            returned.calls,
            returned.totals,
            returned.grad,
            returned.version,
        )
        return True

    def commit(
        self,
        changed: set[Entry],
        calls: dict[Entry, list[Any]] | None,
        returned: dict[Entry, tuple[Tensor, list[Any]]],
        finished: list[tuple[Any, dict[Tensor, Any]]],
    ) -> None:
        """After a backward pass: the gradients it ``changed`` now hold its ``calls`` (by entry, each list in call
        order; ``None``: raw calls are not kept) and the statistics ``finished`` (``(reduction, {param:
        statistics})``, combined with what they held by ``reduction.combine``); a gradient ``autograd.grad``
        returned holds its own calls and statistics (``returned``: by entry, the tensor and its calls)."""
        for entry, (grad, own) in returned.items():
            if entry in changed or entry.param is None:
                continue
            totals = {r: t[entry.param] for r, t in finished if entry.param in t}
            self.returned[id(grad)] = Entry(entry.param, own, totals, weakref.ref(grad), version=grad._version)
            weakref.finalize(grad, self.returned.pop, id(grad), None)  # (once dead, its id may be reused)
        self.filled = self.filled or bool(changed)
        for entry in changed:
            entry.commit()
            if calls is not None:
                entry.calls = sorted([*entry.calls, *calls.get(entry, ())], key=lambda r: r.index)
            for reduction, by_param in finished:
                if entry.param is not None and entry.param in by_param:
                    entry.totals[reduction] = reduction.combine(entry.totals.get(reduction), by_param[entry.param])
        if changed:
            self.generation += 1
            self.rescaled = False

    def release(self, entries: Iterable[Entry]) -> None:
        """A step consumed what ``entries`` hold: each remembers the gradient it released (a later read of that
        gradient was stepped with already), and holds nothing."""
        if self.filled or self.released_some:  # (else no entry holds or released anything: nothing read)
            for entry in entries:
                entry.released = entry.grad if entry.holds() else None
                entry.drop()
            self.released_some, self.filled = self.filled, False
        self.rescaled = False
        self.generation += 1

    def rescaled_in_place(self) -> None:
        """The gradients were rescaled in place by their owner (unscaling): they still hold the same calls."""
        for param, entry in self.entries.items():
            if entry.holds() and param.grad is not None and entry.grad is not None and entry.grad() is param.grad:
                entry.version = param.grad._version

    def released(self, param: Tensor) -> bool:
        """Whether ``param``'s gradient is one the last step released (stepped with already)."""
        entry, grad = self.entries.get(param), param.grad
        return grad is not None and entry is not None and entry.released is not None and entry.released() is grad

    def totals(self, reduction: Any) -> dict[Tensor, Any]:
        """What ``reduction`` holds now, per parameter."""
        return {p: entry.totals[reduction] for p, entry in self.entries.items() if reduction in entry.totals}
