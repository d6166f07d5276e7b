"""InputAwareOptimizer: a Capture on the model, rules that transform the gradients given what it captured, and
the stock update of a torch.optim optimizer; the library runs the step (CONTRIBUTING.md)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from . import compose, coverage, reads
from ._torch import entry_step, kernel_skips_step, unhooked, unscales_itself
from .amp import ScalerHandoff
from .capture import Capture, Storage, unwrap_model
from .coverage import Coverage
from .distributed import inferred_group
from .hooks import InputsHook, InputsHookHandle, Reads, StepHooks, When
from .inputs import Inputs
from .layers import Layer
from .reduction import Reduction
from .rule import Rule

__all__ = ["InputAwareOptimizer"]


def _entry(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` with torch's hook wrapper around the outermost call; ``super().step(...)`` gets the same inputs."""

    def outermost(self: InputAwareOptimizer, *args: Any, **kwargs: Any) -> Any:
        return self._run_step(step, args, kwargs)

    def nested(self: InputAwareOptimizer, *args: Any, **kwargs: Any) -> Any:
        if len(args) < 2 and kwargs.get("inputs") is None:
            kwargs["inputs"] = self._step_inputs
        return step(self, *args, **kwargs)

    return entry_step(step, outermost, nested, lambda self: self.__dict__.get("_step_depth", 0) > 0)


def _step_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``(closure, inputs)`` of a ``step(...)`` call, taken out of ``kwargs``."""
    if len(args) > 2:
        raise TypeError(f"step() takes at most 2 positional arguments (closure, inputs), got {len(args)}")
    closure = args[0] if args else kwargs.pop("closure", None)
    inputs = args[1] if len(args) > 1 else kwargs.pop("inputs", None)
    if closure is not None and not callable(closure):
        raise TypeError(f"step(closure) expects a callable that returns the loss, got {type(closure).__name__}")
    return closure, inputs


class _Evaluated:
    """A step's closure, run once before anything reads the inputs: the stock update gets this, whose first call
    returns that loss and whose later calls run the closure again (a base driven by its closure, as LBFGS)."""

    __slots__ = ("closure", "loss", "pending")

    def __init__(self, closure: Callable[[], Any]) -> None:
        with torch.enable_grad():
            self.loss = closure()
        self.closure, self.pending = closure, True

    def __call__(self) -> Any:
        if self.pending:
            self.pending = False
            return self.loss
        with torch.enable_grad():
            return self.closure()


class InputAwareOptimizer(Optimizer):
    r"""Base of the optimizers that see the inputs each module received in the forward pass.

    At every step the library runs, in order: the closure if one is given (once; its forward and backward
    are captured), each of ``rules`` (``Rule.update``: a transform of the gradients given the inputs that
    produced them), then the stock update of the base optimizer on the gradients they leave. What is
    captured is what the rules and hooks read: with none, nothing (no hook; the stock optimizer, bitwise).

    ``InputAwareSGD`` and ``InputAwareAdamW`` are the drop-ins (their stock class is the base);
    ``InputAwareOptimizer(model, rules=[...], base=torch.optim.RMSprop, lr=...)`` puts any stock optimizer
    behind rules. A subclass may also override ``step(self, closure=None, inputs=None)``, read
    ``inputs.get(p)`` and end in ``super().step(closure, inputs=inputs)`` (the class attributes below
    declare what such an override reads).

    Args:
        model: The model (``torch.compile``\ d and ``DistributedDataParallel`` wrappers too).
        params: Parameters or param groups of ``model``; default: those requiring grad.
        rules: ``Rule`` instances, applied in order before the stock update.
        storage: How captured tensors are kept: ``"reference"`` (zero-copy), ``"clone"``, ``"cpu"``.
        grad_outputs: Also capture each call's output gradients (default: what the rules declare).
        grad_scaler: The ``torch.amp.GradScaler`` the loss is scaled by, for rules that read output
            gradients (they are unscaled where they are read); such rules refuse a scaled step without it.
        strict: Refuse, at the first step, any parameter a rule would leave to the stock update.
        process_group: The group rules combine input statistics over; ``"infer"`` (default) reads it
            from the model's DDP wrapper or FSDP2 mesh, ``None`` keeps them per rank.
        base: A stock ``torch.optim`` class whose ``step`` applies the update (bitwise that class fed the
            rules' gradient), instead of the drop-in's own; every other keyword argument then goes to it.
            ``optimizer.state[p]`` is its state, as stock.

    Class attributes of a subclass that overrides ``step``:
        captured_module_types: Capture only modules of these types (default: every module
            that directly owns a parameter of the optimizer).
        grad_outputs: Also capture the gradient reaching each call's outputs (``call.grad_outputs``).
        reads_calls: Whether ``step`` reads raw calls (default: whether ``step`` is overridden).
        reads_capability: Capture only modules whose registered ``LayerKind`` provides this
            capability (a method of ``LayerKind``, say ``"input_rows"``).
    """

    _stock: ClassVar[type[Optimizer] | None] = None  # a drop-in's stock class (its base unless base= is given)
    captured_module_types: ClassVar[tuple[type[nn.Module], ...] | None] = None
    grad_outputs: ClassVar[bool] = False
    reads_calls: ClassVar[bool | None] = None
    reads_capability: ClassVar[str | None] = None

    def __init__(
        self,
        model: nn.Module,
        params: Any = None,
        *args: Any,
        rules: Rule | Iterable[Rule] = (),
        storage: Storage = "reference",
        grad_outputs: bool | None = None,
        grad_scaler: Any = None,
        strict: bool = False,
        process_group: Any = "infer",
        base: type[Optimizer] | None = None,
        **kwargs: Any,
    ) -> None:
        lr = kwargs.get("lr", args[0] if args else None)
        self._rules = compose.checked_arguments(type(self), model, params, rules, grad_outputs, base, lr)
        self._capture: Capture | None = None
        self._strict = bool(strict)
        self._process_group = process_group
        self._coverage_checked = False
        self._scaler = ScalerHandoff()
        self._step_depth = 0
        self._step_inputs: Inputs | None = None
        self._reductions: dict[Reduction, None] = {}  # what the rules' reads put in the capture (reads.py)
        self._model = model
        self._model_params: dict[Tensor, None] = dict.fromkeys(unwrap_model(model).parameters())
        if params is None:
            params = [p for p in self._model_params if p.requires_grad]
        construct = lambda: super(InputAwareOptimizer, self).__init__(params, *args, **kwargs)  # noqa: E731
        compose.build_base(self, base, construct, params, args, kwargs)
        compose.check_rule_defaults(self)
        self._check_param_groups()  # before any hook is attached, so failing leaves none
        reads_calls = type(self).reads_calls
        self._capture = Capture(
            model,
            self._modules_to_capture(self._params()),
            storage=storage,
            grad_outputs=reads.grad_outputs(self) if grad_outputs is None else grad_outputs,
            keep_calls=any(r.reads_calls for r in self._rules)
            or (self._overrides_step() if reads_calls is None else bool(reads_calls)),
        )
        self._capture.grad_scaler = grad_scaler
        weakref.finalize(self, self._capture.remove)  # the capture dies with its optimizer, even if still held
        try:
            for rule in self._rules:
                rule._bind(self)
            self._set_up_rules()
        except BaseException:
            self._capture.remove()
            raise
        unscales_itself(self)  # GradScaler calls step() even on inf/NaN and leaves unscaling to us
        self.register_state_dict_post_hook(compose.with_rule_state, prepend=True)  # type: ignore[arg-type]

    def __new__(cls, *args: Any, **kwargs: Any) -> InputAwareOptimizer:
        self = super().__new__(cls)
        self.__dict__["_arguments"] = (args, kwargs)  # what a copy is rebuilt from (see __reduce_ex__)
        return self

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        """Copies (``copy.deepcopy``, ``pickle``, ``torch.save``) are constructed anew on the copied
        model with the same arguments and param groups, then loaded with this one's ``state_dict()``."""
        return compose.reduced(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # load_state_dict ends here: the rules' state goes to them, the rest to the base, whose __setstate__
        # fills in its group defaults and converts older formats (a number step), as stock.
        taken = compose.take_rule_state(self, state)
        inner = self.__dict__.get("_base")
        if inner is None:
            super().__setstate__(state)
        else:
            inner.__setstate__(state)
            self.__dict__["state"], self.param_groups = inner.state, inner.param_groups
        compose.give_rule_state(self, taken)

    # -- what the optimizer is made of ------------------------------------------------------------------

    @property
    def rules(self) -> tuple[Rule, ...]:
        """The rules applied, in order, before the stock update."""
        return self._rules

    @property
    def base(self) -> type[Optimizer]:
        """The stock optimizer class whose update is applied (the drop-in's own, or ``base=``)."""
        inner = self.__dict__.get("_base")
        stock = type(inner) if inner is not None else self._stock
        assert stock is not None
        return stock

    @property
    def capture(self) -> Capture:
        """The ``Capture`` that records the model's forward calls for this optimizer."""
        capture = self.__dict__.get("_capture")
        if capture is None:
            raise RuntimeError(
                f"{type(self).__name__}.capture is built in InputAwareOptimizer.__init__: read it (and add a "
                "Reduction to it) after super().__init__(...) returns, or declare the Reduction in a Rule's reads"
            )
        return capture

    @property
    def model(self) -> nn.Module:
        """The model given at construction."""
        return self._model

    @property
    def data_parallel_group(self) -> Any:
        """The process group that rules average input statistics over (``None`` in one process).

        The ``process_group`` given at construction, or inferred from the model when read: a
        ``DistributedDataParallel`` wrapper's group, or the mesh an FSDP2-sharded model is sharded over.

        Raises:
            RuntimeError: Under several ranks with nothing to infer it from (per-rank statistics
                would make the replicas drift apart).
        """
        if not (isinstance(self._process_group, str) and self._process_group == "infer"):
            return self._process_group
        return inferred_group(self._model, type(self).__name__)

    def layers(self, capability: str) -> list[Layer]:
        """The layers this optimizer trains whose registered ``LayerKind`` provides ``capability`` (a weight shared
        with a module of another kind is not one), each with its kind, param group and every module owning it."""
        return coverage.trained_layers(self, capability)

    def coverage(self) -> Coverage:
        """How each trainable parameter is updated, with the reason wherever it is the stock update.

        ``print(opt.coverage())`` shows it as a table; ``.fallbacks()`` lists the weight matrices
        the rules could be expected to cover but leave to the stock update.
        """
        return coverage.coverage_of(self)

    # -- the step ---------------------------------------------------------------------------------------

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        compose.subclassed(cls, InputAwareOptimizer.__init__, _entry)

    def _run_step(self, step: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The outermost step, once torch's wrapper ran the step pre-hooks (``args`` are theirs)."""
        try:
            self._check_before_step()
            if self._scaler.begin(self):
                return None  # GradScaler found inf/NaN: the step is skipped, and so are its captures
            closure, inputs = _step_arguments(args, kwargs)
            hooks: StepHooks | None = self.__dict__.get("_inputs_hooks")
            due = hooks if hooks is not None and hooks.due() else None
            if due is not None and kernel_skips_step(self):  # (fused AdamW under GradScaler, inf found)
                hooks = due = None  # as on any step GradScaler skips: its hooks neither run nor count it
            if closure is not None:  # once, before anything reads the inputs: its calls are this step's
                closure = _Evaluated(closure)
            # (the stock update with nothing reading the capture takes no view of it)
            view = (
                self.capture.step_inputs(inputs)
                if inputs is not None or due is not None or self._reads_inputs()
                else None
            )
            if due is not None and view is not None:
                due.before_step(self, view)
            self._step_depth += 1
            self._step_inputs = view
            try:
                out = step(self, closure, inputs=view, **kwargs)
                if due is not None and view is not None:
                    due.after_step(self, view)
            finally:
                self._step_depth -= 1
                self._step_inputs = None
                if inputs is None and view is not None:
                    view._expire(
                        "these Inputs were handed to a step() that has returned; the captured tensors are released "
                        "at the end of each step. Read what the rule needs inside step() (copy it to keep it)"
                    )
            # Released only once the step succeeded: a step that raised (and changed nothing)
            # keeps its captures, so a retry (say, with more damping) reads the same ones.
            self.capture.clear()
            reads.sync_reads(self)  # what the rules read at the coming step
            if hooks is not None:
                hooks.advance()
            return out
        except BaseException:
            self._scaler.undo(self)  # nothing is lost: the gradients are as GradScaler left them
            raise
        finally:
            self._scaler.end()

    def step(self, closure: Callable[[], Any] | None = None, inputs: Inputs | None = None) -> Any:  # type: ignore[override]
        """Perform one optimization step: each rule's ``update``, then the stock update, then each rule's
        ``advance``.

        A subclass may override this to write a rule that reads ``inputs.get(p)`` (the calls of the
        module(s) that own ``p`` whose gradient is in ``p.grad``; under ``step(closure)``, the
        closure's, which has run already), ending with ``super().step(closure, inputs=inputs)``.

        Args:
            closure: A closure that reevaluates the model and returns the loss (run by the library
                before anything reads the inputs; here, one that returns that loss).
            inputs: The inputs to hand to the rules; by default, those captured for this step.
        """
        if self._rules:
            self._apply_rules(inputs)
        inner = self.__dict__.get("_base")
        if inner is not None:  # base=: the base optimizer's own step, on the shared groups and state
            out = unhooked(type(inner).step)(inner, closure)
        else:
            out = unhooked(self._stock.step)(self, closure)  # type: ignore[union-attr]
        for rule in self._rules:
            rule.advance(self)
        return out

    @torch.no_grad()
    def _apply_rules(self, inputs: Inputs | None) -> None:
        """Each rule's ``update`` in order. If one raises after another changed the gradients, they are put back
        as backward left them (a chain copies them first), so the step changes nothing."""
        assert inputs is not None, "the rules run inside a step(), which hands them its inputs"
        changing = [rule for rule in self._rules if rule.changes_gradients]
        kept = None
        if len(changing) > 1:
            kept = {p: p.grad.clone() for p in self._params() if p.grad is not None}
        try:
            for rule in self._rules:
                rule.update(self, inputs)
        except BaseException:
            if kept is not None:
                for param, grad in kept.items():
                    if param.grad is None or param.grad.shape != grad.shape or param.grad.is_sparse != grad.is_sparse:
                        param.grad = grad
                    else:
                        param.grad.copy_(grad)
            raise

    def _check_before_step(self) -> None:
        """The groups' values as they are now, and (once, and after the layers changed) the coverage report."""
        for index, group in enumerate(self.param_groups):
            try:
                self._check_group(group)
            except ValueError as error:
                raise ValueError(f"param group {index}: {error}. No parameter was changed") from None
        for capability in reads.capabilities(self):
            coverage.trained_layers(self, capability)  # (a layout changed since re-arms the coverage report)
        if not self._coverage_checked:
            coverage.check_coverage(self, stacklevel=6)  # (the caller of step())

    def register_inputs_hook(
        self, hook: InputsHook, *, when: When = "pre", every: int = 1, reads: Reads = "calls"
    ) -> InputsHookHandle:
        """Run ``hook`` once per step (every ``every`` steps) with the step's ``Inputs``, from the next step.

        ``when="pre"``: ``hook(optimizer, inputs)`` before the rules and the update (after the closure ran);
        ``when="post"``: ``hook(optimizer, inputs, updates)`` after them, ``updates`` being each parameter's
        change if ``reads`` includes ``"updates"`` (else ``None``). ``reads`` is what the hook reads, the
        capture keeping only that, at its steps: ``"calls"``, ``Reduction`` instances (``inputs.reduced``),
        ``"updates"``, a list of these, or ``None`` (nothing of the inputs).

        Returns:
            A handle whose ``remove()`` takes the hook off, whose ``step`` counts its steps and whose
            ``coming_step``, set between steps, resumes a run's numbering.
        """
        hooks = self.__dict__.get("_inputs_hooks")
        if hooks is None:
            scope = lambda: self._modules_to_capture(self._params())  # noqa: E731
            hooks = self._inputs_hooks = StepHooks(self.capture, self._params, scope)
        return hooks.register(hook, when=when, every=every, reads=reads)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, as the stock optimizer does, and drop the captured calls."""
        super().zero_grad(set_to_none)
        self.capture.clear()

    # -- param groups and their hyperparameters -----------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, as ``torch.optim.Optimizer.add_param_group`` does.

        Raises:
            ValueError: If a parameter does not belong to the model.
        """
        if not isinstance(param_group, dict) or "params" not in param_group:
            super().add_param_group(param_group)  # torch's own TypeError / KeyError
            return
        tensors = compose.model_parameters_of(self, param_group)
        super().add_param_group(param_group)
        if self._capture is not None:  # (in __init__: the capture is built once all groups are)
            self._join_new_group(tensors)

    def _join_new_group(self, params: list[Tensor]) -> None:
        """The rules' check of the group just added, its layers joined to the capture and the rules' reads; if a
        rule refuses it (by name), the optimizer is left as it was: the group out, its modules unwatched."""
        capture = self.capture
        try:
            self._check_param_groups()
        except Exception:
            self.param_groups.pop()
            raise
        watched = set(capture.modules)
        added = [m for m in self._modules_to_capture(params) if m not in watched]
        capture.add_modules(added)
        try:
            self._set_up_rules()
        except Exception:
            self.param_groups.pop()
            capture.remove_modules(added)
            self._set_up_rules()
            raise
        if (hooks := self.__dict__.get("_inputs_hooks")) is not None:
            hooks.rescope()  # and the layers a hook reads

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict, as torch does; groups saved by another optimizer (say, a stock
        ``torch.optim.SGD``) get the rules' hyperparameters from their defaults."""
        with compose.restored_on_failure(self):  # nothing is half loaded
            super().load_state_dict(state_dict)
            for group in self.param_groups:
                if "batch_averaged" in group:  # a 0.2 checkpoint of K-FAC or Eva: the key is loss_reduction now
                    group["loss_reduction"] = "mean" if group.pop("batch_averaged") else "sum"
            self._check_param_groups()  # (the rules' hyperparameters where the groups lack them)
            self._set_up_rules()

    def _check_param_groups(self) -> None:
        """The rules' hyperparameters added to ``defaults`` and every group that lacks them, then checked."""
        for rule in self._rules:
            self.defaults.update({k: v for k, v in rule.defaults.items() if k not in self.defaults})
            for group in self.param_groups:
                for key, value in rule.defaults.items():
                    group.setdefault(key, value)
        for group in (self.defaults, *self.param_groups):  # (the defaults: a constructor value no group takes)
            self._check_group(group)

    def _check_group(self, group: dict[str, Any]) -> None:
        """Each rule's check of one group's hyperparameters (``ValueError``), also run before every step."""
        for rule in self._rules:
            rule.check_group(group)

    def _set_up_rules(self) -> None:
        """Each rule's ``setup`` (after the groups changed), then what they read put in the capture."""
        for rule in self._rules:
            rule.setup(self)
        reads.sync_reads(self)

    # -- what is captured -------------------------------------------------------------------------------

    def _params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _overrides_step(self) -> bool:
        """Whether a subclass overrides ``step`` (the rule API of 0.3, kept: it reads what its class declares)."""
        return type(self).step is not InputAwareOptimizer.step

    def _reads_inputs(self) -> bool:
        return bool(self._rules) or self._overrides_step()

    def _override_reads(self) -> bool:
        return reads.override_reads(self)

    def _modules_to_capture(self, params: Iterable[Tensor]) -> list[nn.Module]:
        """The modules whose calls the readers read, among the owners of ``params``."""
        return reads.modules_to_capture(self, params)


def __getattr__(name: str) -> Any:
    if name == "evaluate_closure":  # removed in 0.4
        raise AttributeError(
            "inputaware_optim.base.evaluate_closure was removed in 0.4: the library runs a step's closure once, "
            "before any rule reads the inputs, and hands the stock update a closure that returns that loss; a rule "
            "(Rule.update, or a step override) no longer runs it"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


InputAwareOptimizer.step = _entry(InputAwareOptimizer.step)  # type: ignore[method-assign]
