"""InputAwareOptimizer: a Capture on the model, rules that transform the gradients given what it captured, and
the stock update of a torch.optim optimizer; the library runs the step (CONTRIBUTING.md)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from . import compose, coverage
from ._torch import entry_step, kernel_skips_step, unhooked, unscales_itself
from .amp import ScalerHandoff
from .capture import Capture, Storage, parameter_names, unwrap_model
from .coverage import Coverage
from .distributed import data_parallel_group, sharded
from .hooks import InputsHook, InputsHookHandle, Reads, StepHooks, When
from .inputs import Inputs
from .layers import Layer, layer_kind
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
        self._reductions: dict[Reduction, None] = {}  # what the rules' reads put in the capture
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
            grad_outputs=self._grad_outputs() if grad_outputs is None else grad_outputs,
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
        group = data_parallel_group(self._model)
        if group is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            ranks = torch.distributed.get_world_size()
            if ranks > 1:
                raise RuntimeError(
                    f"{type(self).__name__} combines input statistics over the data-parallel ranks, but its model "
                    f"is not wrapped in DistributedDataParallel or sharded with fully_shard while torch.distributed "
                    f"runs {ranks} ranks, so each replica would apply a different update. Build the optimizer on "
                    "the wrapped model (DistributedDataParallel(model)), or pass process_group= (the group "
                    "gradients are averaged over, or None if each rank trains its own model)"
                )
        return group

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
        if "capture_grad_outputs" in cls.__dict__:  # an attribute of 0.2 that would now do nothing
            raise TypeError(f"{cls.__qualname__}: capture_grad_outputs was renamed: set grad_outputs = True")
        if "__init__" in cls.__dict__:  # its own arguments, not a parent drop-in's
            cls.__signature__ = None  # type: ignore[attr-defined]
        elif "_stock" in cls.__dict__:  # a drop-in: the stock class's arguments, then the capture's
            cls.__signature__ = compose.drop_in_signature(InputAwareOptimizer.__init__, cls._stock)  # type: ignore[arg-type,attr-defined]
        step = cls.__dict__.get("step")
        if step is not None and not hasattr(step, "inputaware_entry"):
            cls.step = _entry(step)  # type: ignore[method-assign]

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
                self._resolve_inputs(inputs) if inputs is not None or due is not None or self._reads_inputs() else None
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
            self._sync_reads()  # what the rules read at the coming step
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
        for capability in self._capabilities():
            coverage.trained_layers(self, capability)  # (a layout changed since re-arms the coverage report)
        if not self._coverage_checked:
            coverage.check_coverage(self, stacklevel=6)  # (the caller of step())

    def _resolve_inputs(self, inputs: Any) -> Inputs:
        if inputs is None:
            return self.capture._live_inputs()
        if isinstance(inputs, Inputs):
            if inputs._expired:
                raise RuntimeError(inputs._expired)
            return inputs
        if isinstance(inputs, Mapping):
            capture = self.capture
            named = {param: name for param, (name, _) in parameter_names(capture.root).items()}
            return Inputs.from_mapping(
                inputs, capture._owners, capture._watched, parameter_names=named, module_name=capture.name
            )
        raise TypeError(
            "step(inputs=...) expects an inputaware_optim.Inputs (for example Capture.inputs()) or a "
            f"mapping from modules or parameters to Captured calls, got {type(inputs).__name__}"
        )

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
        params = param_group["params"]
        if isinstance(params, Tensor):
            params = [params]
        elif not isinstance(params, set):  # torch explains why sets are refused
            params = list(params)
        param_group["params"] = params  # the caller's dict is the group, as in torch
        tensors = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]  # (name, tensor) pairs
        if any(isinstance(t, Tensor) and t not in self._model_params for t in tensors):
            self._model_params = dict.fromkeys(unwrap_model(self._model).parameters())  # modules added since
        for index, param in enumerate(tensors):
            if isinstance(param, Tensor) and param not in self._model_params:
                raise ValueError(
                    f"parameter {index} of param group {len(self.param_groups)} (shape {tuple(param.shape)}) is not a "
                    f"parameter of the model given to {type(self).__name__}. Every parameter must belong to the model "
                    "so that the inputs of its module can be captured; give other tensors to a separate optimizer"
                )
        super().add_param_group(param_group)
        if self._capture is not None:  # (in __init__: the capture is built once all groups are)
            self._join_new_group([t for t in tensors if isinstance(t, Tensor)])

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
        # What a load replaces (torch builds a new state and new groups; the rules' state is filled in place),
        # put back if anything refuses it: nothing is half loaded.
        kept = (self.state, self.param_groups, [(dict(r.state), r.state_dict()) for r in self._rules])
        try:
            super().load_state_dict(state_dict)
            for group in self.param_groups:
                if "batch_averaged" in group:  # a 0.2 checkpoint of K-FAC or Eva: the key is loss_reduction now
                    group["loss_reduction"] = "mean" if group.pop("batch_averaged") else "sum"
            self._check_param_groups()  # (the rules' hyperparameters where the groups lack them)
            self._set_up_rules()
        except BaseException:
            state, groups, rules = kept
            for owner in (self, self.__dict__.get("_base")):
                if owner is not None:
                    owner.__dict__["state"], owner.param_groups = state, groups
            for rule, (entries, whole) in zip(self._rules, rules, strict=True):
                rule.state.clear()
                rule.state.update(entries)
                if whole:  # (what the rule saved of itself: nothing to check again)
                    rule.load_state_dict(whole)
            self._set_up_rules()
            raise

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
        self._sync_reads()

    def _sync_reads(self) -> None:
        """Put in the capture the reductions the rules read at the coming step, and take out those they stopped
        reading (its hooks kept: a rule that pauses between statistics steps does not retrace a compiled model)."""
        if not self._rules:
            return
        wanted = dict.fromkeys(r for rule in self._rules for r in rule.read_reductions())
        if wanted.keys() == self._reductions.keys():
            return
        capture = self.capture
        for reduction in [r for r in self._reductions if r not in wanted]:
            capture.remove_reduction(reduction, keep_hooks=True)
        new = [r for r in wanted if r not in self._reductions]
        if new:  # the modules they read that the capture does not watch yet (a router keying its gate's weight)
            trained, watched = {id(p) for p in self._params()}, set(capture.modules)
            below = [
                m
                for m in capture.root.modules()
                if m not in watched and any(r.wants(m) and any(id(p) in trained for p in r.keys(m)) for r in new)
            ]
            if below:
                capture.add_modules(below)
        for reduction in wanted:
            capture.add_reduction(reduction)
        self._reductions = wanted

    # -- what is captured -------------------------------------------------------------------------------

    def _params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _overrides_step(self) -> bool:
        """Whether a subclass overrides ``step`` (the rule API of 0.3, kept: it reads what its class declares)."""
        return type(self).step is not InputAwareOptimizer.step

    def _override_reads(self) -> bool:
        """Whether a subclass's ``step`` override reads the capture (what its class attributes declare)."""
        declared = self.reads_calls
        return self._overrides_step() if declared is None else bool(declared) or self.reads_capability is not None

    def _reads_inputs(self) -> bool:
        return bool(self._rules) or self._overrides_step()

    def _grad_outputs(self) -> bool:
        return type(self).grad_outputs or any(rule.grad_outputs for rule in self._rules)

    def _capabilities(self) -> list[str]:
        found = [rule.layers for rule in self._rules if rule.layers is not None]
        if self.reads_capability is not None:
            found.append(self.reads_capability)
        return list(dict.fromkeys(found))

    def _scopes(self) -> list[tuple[tuple[type[nn.Module], ...] | None, str | None]]:
        """``(module types, capability)`` of each reader: the subclass's declarations if it reads, each rule's."""
        scopes = []
        if self._override_reads():
            scopes.append((self.captured_module_types, self.reads_capability))
        for rule in self._rules:  # (reads declared as a property: what it reads is built in setup, from these)
            if rule.reads_calls or rule.read_reductions() or rule.layers is not None or type(rule).reads is not None:
                scopes.append((None, rule.layers))
        return scopes or [(None, None)]  # (nothing reads: every owner, hooked once a hook reads them)

    def _modules_to_capture(self, params: Iterable[Tensor]) -> list[nn.Module]:
        wanted = {id(p) for p in params}
        scopes = self._scopes()
        return [
            module
            for module in unwrap_model(self._model).modules()
            if any(id(p) in wanted for p in module._parameters.values() if p is not None)
            and any(
                (types is None or isinstance(module, types))
                and (capability is None or ((kind := layer_kind(module)) is not None and kind.provides(capability)))
                for types, capability in scopes
            )
        ]

    def _refuse_sharded_parameters(self, why: str, rule: Any) -> None:
        """Raise at construction if any parameter is sharded (FSDP2 / DTensor): the rule needs whole tensors."""
        if any(sharded(p) for p in self._params()):
            raise NotImplementedError(
                f"{type(rule).__name__} does not support sharded (FSDP2 / DTensor) parameters yet: {why}. "
                "Use DistributedDataParallel, or InputAwareAdamW / InputAwareSGD / LazyAdamW under FSDP2"
            )


def __getattr__(name: str) -> Any:
    if name == "evaluate_closure":  # removed in 0.4
        raise AttributeError(
            "inputaware_optim.base.evaluate_closure was removed in 0.4: the library runs a step's closure once, "
            "before any rule reads the inputs, and hands the stock update a closure that returns that loss; a rule "
            "(Rule.update, or a step override) no longer runs it"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


InputAwareOptimizer.step = _entry(InputAwareOptimizer.step)  # type: ignore[method-assign]
