"""Rule: a transform of each step's gradients given the inputs that produced them; rules chain in front of
any stock optimizer (docs/writing-a-rule.md)."""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor, nn

from .reduction import Reduction

if TYPE_CHECKING:
    from .inputs import Inputs

__all__ = ["Rule"]


class Rule:
    r"""A transform of the gradients that reads the data that produced them.

    An input-aware optimizer built with ``rules=[a, b]`` runs at every step, in this order: the step's
    closure (once; its forward and backward are captured), ``a.update``, ``b.update``, then the stock update
    of its base optimizer on the gradients they leave, then ``a.advance`` and ``b.advance``. A rule declares
    what it reads, and the capture keeps exactly that:

    Attributes:
        reads: What ``update`` reads of ``inputs``: ``"calls"`` (raw calls: ``inputs.get(p)``), ``Reduction``
            instances (``inputs.reduced(r)``: statistics computed in the hooks), a list of these, or ``None``.
            A class attribute, or an instance attribute set in ``__init__`` or ``setup``.
        grad_outputs: Raw calls also hold the gradient that reached their outputs (``call.grad_outputs``).
        layers: A capability of the layer registry (``"input_rows"``, ``"output_grad_rows"``,
            ``"touched_rows"``, ``"per_sample"``): read only the layers whose ``LayerKind`` provides it; the
            coverage report names every weight matrix left out. ``None``: every module that owns a
            parameter of the optimizer.
        defaults: The rule's hyperparameters, added to every param group that lacks them (read them at the
            step from ``group[...]``, so a schedule may change them; ``check_group`` checks them).
        changes_gradients: ``update`` changes gradients (then a base driven by its closure, which
            recomputes them, is refused).
        private: The gradients it leaves are differentially private: a rule after it may not read inputs.
        state: Per parameter, the rule's own state (saved in the optimizer's ``state_dict()``).

    A rule belongs to one optimizer. Copies of the optimizer (``deepcopy``, ``pickle``) rebuild each rule
    from the arguments it was constructed with, then load the state.
    """

    reads: Any = None
    state: defaultdict[Tensor, dict[str, Any]]
    _owner: weakref.ref[Any] | None
    grad_outputs: ClassVar[bool] = False
    layers: ClassVar[str | None] = None
    defaults: dict[str, Any] = {}  # noqa: RUF012  (a subclass's, or set per instance)
    changes_gradients: ClassVar[bool] = True
    private: ClassVar[bool] = False

    def __new__(cls, *args: Any, **kwargs: Any) -> Rule:
        self = super().__new__(cls)
        self.__dict__["_arguments"] = (args, kwargs)  # what a copy is constructed from (see __reduce_ex__)
        self.__dict__["state"] = defaultdict(dict)
        self.__dict__["_owner"] = None
        return self

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        args, kwargs = self.__dict__.get("_arguments", ((), {}))
        return (_constructed, (type(self), args, kwargs))

    def setup(self, optimizer: Any) -> None:
        """Called by the optimizer at construction and whenever its param groups change (``add_param_group``,
        ``load_state_dict``), after ``check_group`` passed on every group: build what depends on the
        layers trained (say, a ``Reduction`` over them), refuse what the rule cannot do, by name."""

    def check_group(self, group: dict[str, Any]) -> None:
        """Check one param group's values of the rule's hyperparameters (raise ``ValueError`` naming the
        argument). Runs at construction, ``add_param_group``, ``load_state_dict`` and before every step: a
        value set in ``param_groups`` since is refused before any change."""

    def update(self, optimizer: Any, inputs: Inputs) -> None:
        """Transform the gradients (each ``p.grad``, in place or replaced) given the step's ``inputs``.

        Runs under ``torch.no_grad()``, after the closure and the rules before this one. Raise before
        changing anything if the step cannot be taken: no parameter then moves."""

    def advance(self, optimizer: Any) -> None:
        """Called once the stock update was applied (count steps, schedule the next statistics)."""

    def treatment(self, optimizer: Any, param: Tensor, module: nn.Module | None) -> tuple[str, str | None, bool] | None:
        """How ``update`` treats ``param`` (owned by ``module``), for ``optimizer.coverage()``: ``(what it does,
        why it leaves it to the stock update or None, whether that is a fallback)``, or ``None`` if the rule
        does not act on it. Default: ``reads`` calls or reductions of ``module``, if the capture watches it."""
        if module is not None and module in optimizer.capture.modules and (self.reads_calls or self.read_reductions()):
            return f"{type(self).__name__} (reads the calls of {type(module).__name__})", None, False
        return None

    def state_dict(self) -> dict[str, Any]:
        """The rule's state that belongs to no parameter (saved in the optimizer's ``state_dict()``)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``state_dict()`` returned."""

    @property
    def optimizer(self) -> Any:
        """The optimizer this rule belongs to (from its construction on)."""
        owner = self._owner() if self._owner is not None else None
        if owner is None:
            raise RuntimeError(f"this {type(self).__name__} belongs to no optimizer (yet): pass it in rules=[...]")
        return owner

    # -- what the optimizer reads of the declarations ----------------------------------------------------

    @property
    def reads_calls(self) -> bool:
        """Whether ``reads`` includes raw calls."""
        return "calls" in _items(self.reads)

    def read_reductions(self) -> list[Reduction]:
        """The ``Reduction`` instances ``reads`` names."""
        return [r for r in _items(self.reads) if isinstance(r, Reduction)]

    def _legacy_key(self, key: str) -> bool:
        """Whether ``key``, in a parameter's entry of a 0.3 checkpoint, is this rule's (kept then beside the base's)."""
        return False

    def _bind(self, optimizer: Any) -> None:
        owner = self._owner() if self._owner is not None else None
        if owner is not None and owner is not optimizer:
            raise ValueError(
                f"this {type(self).__name__} belongs to another optimizer already (its state is that optimizer's "
                f"parameters'); construct a new {type(self).__name__} for each optimizer"
            )
        for item in _items(self.reads):
            if not isinstance(item, Reduction) and item != "calls":
                raise TypeError(
                    f"{type(self).__name__}.reads takes 'calls', Reduction instances or a list of them, got {item!r}"
                )
        if owner is None:
            self.state.clear()  # (an optimizer that held it before is gone: so are the parameters it keyed)
        self.__dict__["_owner"] = weakref.ref(optimizer)

    def __repr__(self) -> str:
        args, kwargs = self.__dict__.get("_arguments", ((), {}))
        shown = [*(repr(a) for a in args), *(f"{k}={v!r}" for k, v in kwargs.items())]
        return f"{type(self).__name__}({', '.join(shown)})"


def _items(reads: Any) -> list[Any]:
    if reads is None:
        return []
    if isinstance(reads, (str, Reduction)):
        return [reads]
    if isinstance(reads, Iterable):
        return list(reads)
    return [reads]


def _constructed(cls: type[Rule], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Rule:
    return cls(*args, **kwargs)
