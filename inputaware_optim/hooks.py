"""Input-aware step hooks (``InputAwareOptimizer.register_inputs_hook``): ``hook(optimizer, inputs)`` once per step;
the capture keeps what the hooks due at a step read (``reads``), only for that step."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ._torch import foreach_sub
from .capture import Capture
from .inputs import Inputs
from .reduction import Reduction

__all__ = ["InputsHook", "InputsHookHandle", "Reads", "When"]

When = Literal["pre", "post"]
Reads = str | Reduction | Iterable[str | Reduction] | None
InputsHook = Callable[..., None]


class InputsHookHandle(contextlib.AbstractContextManager["InputsHookHandle"]):
    """What ``register_inputs_hook`` returns: ``remove()`` takes the hook off.

    Attributes:
        step: The index of the step the hook runs at now (0 is the first step after it was registered), or
            of the last one it ran at.
    """

    def __init__(self, registry: StepHooks, entry: _Entry) -> None:
        self._registry, self._entry = registry, entry

    @property
    def step(self) -> int:
        return self._entry.last

    @property
    def coming_step(self) -> int:
        """The hook's index of the coming step. Set it between steps to resume a run's numbering (a run
        restored from a checkpoint): ``every`` then counts from 0 as if the hook had run from the start."""
        return self._registry.step - self._entry.start

    @coming_step.setter
    def coming_step(self, step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"Invalid coming_step: {step!r}; it must be an integer >= 0")
        self._registry.renumber(self._entry, step)

    def remove(self) -> None:
        """Take the hook off; what only it read stops being kept."""
        self._registry.remove(self._entry)

    def __exit__(self, *exc: object) -> None:
        self.remove()


class _Entry:
    __slots__ = ("calls", "every", "hook", "last", "reductions", "start", "updates", "when")

    def __init__(
        self, hook: InputsHook, when: When, every: int, calls: bool, updates: bool, reductions: tuple[Reduction, ...]
    ) -> None:
        self.hook, self.when, self.every = hook, when, every
        self.calls, self.updates, self.reductions = calls, updates, reductions
        self.start = 0  # the registry step of its first run
        self.last = -1

    def due(self, step: int) -> bool:
        return step >= self.start and (step - self.start) % self.every == 0

    def reads(self, module: nn.Module, trained: set[int]) -> bool:
        """Whether this hook reads ``module`` (``trained``: the ids of the optimizer's parameters)."""
        if self.calls and any(id(p) in trained for p in module._parameters.values() if p is not None):
            return True
        return any(r.wants(module) and any(id(p) in trained for p in r.keys(module)) for r in self.reductions)


class StepHooks:
    """The input-aware step hooks of one optimizer and their step counter. The owner calls ``before_step``
    once the inputs are known, ``after_step`` after the update, ``advance`` once the captures are released."""

    def __init__(
        self, capture: Capture, params: Callable[[], list[Tensor]], scope: Callable[[], Iterable[nn.Module]]
    ) -> None:
        self.capture = capture
        self.step = 0  # index of the coming step
        self._params = params
        self._scope = scope  # the modules the rule itself watches
        self._entries: list[_Entry] = []
        self._added: set[Reduction] = set()  # what we turned on in the capture
        self._widened: dict[nn.Module, None] = {}  # modules watched for the hooks alone
        self._calls_on = False
        self._before: dict[Tensor, Tensor] | None = None

    def register(
        self, hook: InputsHook, when: When = "pre", every: int = 1, reads: Reads = "calls"
    ) -> InputsHookHandle:
        """Add ``hook``; see ``InputAwareOptimizer.register_inputs_hook``."""
        if not callable(hook):
            raise TypeError(
                f"register_inputs_hook expects a callable hook(optimizer, inputs), got {type(hook).__name__}"
            )
        if when not in ("pre", "post"):
            raise ValueError(f"Invalid when: {when!r}; choose 'pre' (before the update) or 'post' (after it)")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"Invalid every: {every!r}; it must be a positive integer")
        items: list[Any] = [] if reads is None else [reads] if isinstance(reads, (str, Reduction)) else list(reads)
        for item in items:
            if not isinstance(item, Reduction) and item not in ("calls", "updates"):
                raise TypeError(f"reads= takes 'calls', 'updates', Reduction instances or a list of them, got {item!r}")
        calls, updates = "calls" in items, "updates" in items
        reductions = tuple(dict.fromkeys(r for r in items if isinstance(r, Reduction)))
        if updates and when == "pre":
            raise ValueError("reads='updates' is for a hook with when='post': before the update nothing changed yet")
        entry = _Entry(hook, when, every, calls, updates, reductions)
        # Turning raw calls on would drop the statistics the capture holds: such a hook starts next step.
        entry.start = self.step + (1 if calls and not self.capture.keep_calls and self.capture.holds() else 0)
        self._entries.append(entry)
        self.rescope()
        self._arm(releasing=False)
        return InputsHookHandle(self, entry)

    def renumber(self, entry: _Entry, step: int) -> None:
        """Make the coming step ``entry``'s ``step``-th, and arm the capture for what that makes due."""
        if self.capture.holds():
            raise RuntimeError(
                "a hook's steps are renumbered between steps: this one's backward has run already. Set it after "
                "optimizer.step() (or zero_grad()), before the next forward"
            )
        entry.start = self.step - step
        self._arm(releasing=False)

    def remove(self, entry: _Entry) -> None:
        if entry in self._entries:
            self._entries.remove(entry)
            self._arm(releasing=False)
            self.rescope()

    def rescope(self) -> None:
        """Watch every module the hooks read, whatever the rule's own scope: each module owning a trained
        parameter for a hook reading raw calls, each a reduction wants and keys a trained parameter under
        for one reading reductions; stop watching those no hook reads any more, unless the rule does."""
        trained = {id(p) for p in self._params()} if self._entries else set()
        wanted = dict.fromkeys(
            m for m in self.capture.root.modules() if any(e.reads(m, trained) for e in self._entries)
        )
        watched = set(self.capture.modules)
        added = [m for m in wanted if m not in watched]
        self.capture.add_modules(added)
        self._widened.update(dict.fromkeys(added))
        stale = [m for m in self._widened if m not in wanted]
        if stale:
            scope = set(self._scope())
            self.capture.remove_modules([m for m in stale if m not in scope])
            for module in stale:
                del self._widened[module]

    def _arm(self, releasing: bool) -> None:
        """Make the capture read what the hooks due at the coming step read. Raw calls are toggled (which drops
        what the capture holds) only between steps (``releasing``) or while it holds nothing."""
        due = [e for e in self._entries if e.due(self.step)]
        wanted = {r for e in due for r in e.reductions}
        capture = self.capture
        for reduction in [r for r in self._added if r not in wanted]:
            capture.remove_reduction(reduction)
            self._added.discard(reduction)
        for reduction in wanted:
            if reduction not in capture.reductions:
                capture.add_reduction(reduction)
                self._added.add(reduction)
        calls = any(e.calls for e in due)
        if calls and not capture.keep_calls and (releasing or not self.capture.holds()):
            capture.keep_calls = self._calls_on = True
        elif not calls and self._calls_on and releasing:
            capture.keep_calls = self._calls_on = False

    def due(self) -> bool:
        """Whether any hook runs at the coming step."""
        return any(e.due(self.step) for e in self._entries)

    def before_step(self, optimizer: Any, inputs: Inputs) -> None:
        """Run the pre-step hooks due now; keep the parameters if a post-step hook reads updates."""
        due = [e for e in self._entries if e.due(self.step)]
        for entry in due:
            entry.last = self.step - entry.start
            if entry.when == "pre":
                entry.hook(optimizer, inputs)
        if any(e.updates for e in due if e.when == "post"):
            with torch.no_grad():
                self._before = {p: p.detach().clone() for p in self._params() if p.grad is not None}

    def after_step(self, optimizer: Any, inputs: Inputs) -> None:
        """Run the post-step hooks due now, with each parameter's change where they read updates."""
        due = [e for e in self._entries if e.due(self.step) and e.when == "post"]
        if not due:
            return
        updates: dict[Tensor, Tensor] | None = None
        before, self._before = self._before, None
        if before:
            with torch.no_grad():
                changes = foreach_sub([p.detach() for p in before], list(before.values()))  # one pass; the copies go
                updates = dict(zip(before, changes, strict=True))
                del before
        for entry in due:
            entry.hook(optimizer, inputs, updates if entry.updates else None)

    def advance(self) -> None:
        """The step is done and its captures released: count it and arm the capture for the next."""
        self._before = None
        self.step += 1
        self._arm(releasing=True)
