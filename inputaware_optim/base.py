"""InputAwareOptimizer: joins a Capture on the model to a stock torch.optim optimizer (CONTRIBUTING.md)."""

from __future__ import annotations

import inspect
import operator
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from ._torch import (
    drop_scaler_handoff,
    entry_step,
    grad_scaler_unscale_,
    hide_scaler_handoff,
    in_place_values,
    kernel_skips_step,
    scaler_handoff,
    unhooked,
    unscales_itself,
)
from .capture import Capture, Storage, parameter_names, unwrap_model
from .coverage import Coverage, CoverageWarning, Treatment
from .distributed import data_parallel_group, sharded
from .hooks import InputsHook, InputsHookHandle, Reads, StepHooks, When
from .inputs import Inputs
from .layers import Layer, bias_of, explained, layer_kind, weight_of, weight_or_none, why_no_kind
from .reduction import Reduction

__all__ = ["InputAwareOptimizer", "evaluate_closure"]


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


def _drop_in_signature(stock: type[Optimizer]) -> inspect.Signature:
    """``(model, params=None, <the stock class's hyperparameters>, *, <the capture's options>, **base_kwargs)``."""
    own = inspect.signature(InputAwareOptimizer.__init__).parameters
    theirs = [p for name, p in inspect.signature(stock.__init__).parameters.items() if name not in ("self", "params")]
    positional = [p for p in theirs if p.kind is p.POSITIONAL_OR_KEYWORD]
    keyword = [p for p in theirs if p.kind is p.KEYWORD_ONLY]
    options = [p for p in own.values() if p.kind is p.KEYWORD_ONLY]
    return inspect.Signature(
        [own["model"], own["params"], *positional, *keyword, *options, own["kwargs"].replace(name="base_kwargs")]
    )


# Keyword arguments renamed since 0.1, with what to write instead (0.x keeps no aliases).
RENAMED = {
    "capture_grad_outputs": "pass grad_outputs= (the name Capture, Monitor and Reduction use)",
    "batch_averaged": "pass loss_reduction='mean' (for True) or 'sum' (for False), DP's name",
}


def _check_arguments(cls: type[InputAwareOptimizer], model: Any, grad_outputs: Any, base: Any, lr: Any) -> None:
    """Refuse, before anything is built, what the constructor of ``cls`` cannot take."""
    name = cls.__name__
    for owner in cls.__mro__:  # an override that cannot take its inputs
        raw = getattr(owner.__dict__.get("step"), "inputaware_entry", None)
        if raw is not None and not any(
            p.name == "inputs" or p.kind is p.VAR_KEYWORD for p in inspect.signature(raw).parameters.values()
        ):
            raise TypeError(
                f"{owner.__qualname__}.step must accept the captured inputs: define it as "
                "`def step(self, closure=None, inputs=None)` and pass inputs=inputs to super().step()"
            )
    if not isinstance(model, nn.Module):
        hint = ""
        if isinstance(model, Iterable) and not isinstance(model, (str, bytes)):
            hint = (
                f"; unlike torch.optim, {name} takes the model itself, then the parameters: "
                f"{name}(model, lr=...) or {name}(model, params=param_groups, lr=...)"
            )
        raise TypeError(f"{name} expects an nn.Module as its first argument, got {type(model).__name__}{hint}")
    if grad_outputs is False and cls.grad_outputs:
        raise ValueError(f"{name} needs the output gradients of its layers; leave grad_outputs unset")
    if base is not None and not (isinstance(base, type) and issubclass(base, Optimizer)):
        raise TypeError(f"Invalid base: {base!r} (must be a torch.optim.Optimizer subclass, say torch.optim.AdamW)")
    if base is not None and issubclass(base, InputAwareOptimizer):
        raise TypeError(f"Invalid base: {base.__name__} is input-aware itself; pass the stock optimizer class")
    if isinstance(lr, Iterable) and not isinstance(lr, (Tensor, str)):
        raise TypeError(
            f"{name} got {type(lr).__name__} for lr: the parameters are a keyword argument here, "
            f"{name}(model, params=param_groups, lr=...)"
        )


def evaluate_closure(closure: Callable[[], Any] | None) -> Any:
    """Run a step's closure with grad enabled (rules run under ``torch.no_grad()``) and return its loss."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class InputAwareOptimizer(Optimizer):
    r"""Base of the optimizers that see the inputs each module received in the forward pass.

    A subclass pairs this class with a stock optimizer (``_stock``), e.g.
    ``class InputAwareSGD(InputAwareOptimizer, torch.optim.SGD)``. A rule overrides
    ``step(self, closure=None, inputs=None)`` and reads ``inputs.get(p)``.

    What is captured is what is read: with no rule, nothing (no hook; the stock optimizer). A rule
    that overrides ``step`` keeps raw calls until the step that reads them, unless it sets
    ``reads_calls = False`` to read only the ``Reduction``\ s it adds to its capture.

    Args:
        model: The model (``torch.compile``\ d and ``DistributedDataParallel`` wrappers too).
        params: Parameters or param groups of ``model``; default: those requiring grad.
        storage: How captured tensors are kept: ``"reference"`` (zero-copy), ``"clone"``, ``"cpu"``.
        grad_outputs: Also capture each call's output gradients (default: the rule's choice).
        grad_scaler: The ``torch.amp.GradScaler`` the loss is scaled by, for rules that read output
            gradients (they are unscaled where they are read); such rules refuse a scaled step without it.
        strict: Refuse, at the first step, any parameter a rule would leave to the stock update.
        process_group: The group rules combine input statistics over; ``"infer"`` (default) reads it
            from the model's DDP wrapper or FSDP2 mesh, ``None`` keeps them per rank.
        base: Another stock ``torch.optim`` class whose ``step`` applies the update (bitwise that class
            fed the rule's gradient); every other keyword argument then goes to it.

    Class attributes a rule may set:
        captured_module_types: Capture only modules of these types (default: every module
            that directly owns a parameter of the optimizer).
        grad_outputs: Also capture the gradient reaching each call's outputs (``call.grad_outputs``).
        reads_calls: Whether ``step`` reads raw calls (default: whether ``step`` is overridden).
        reads_capability: Capture only modules whose registered ``LayerKind`` provides this
            capability (a method of ``LayerKind``, say ``"input_rows"``): coverage then follows the
            registry, and registering a kind for a new layer makes the rule use it.
    """

    _stock: ClassVar[type[Optimizer]]
    captured_module_types: ClassVar[tuple[type[nn.Module], ...] | None] = None
    grad_outputs: ClassVar[bool] = False
    reads_calls: ClassVar[bool | None] = None
    reads_capability: ClassVar[str | None] = None

    def __init__(
        self,
        model: nn.Module,
        params: Any = None,
        *args: Any,
        storage: Storage = "reference",
        grad_outputs: bool | None = None,
        grad_scaler: Any = None,
        strict: bool = False,
        process_group: Any = "infer",
        base: type[Optimizer] | None = None,
        **kwargs: Any,
    ) -> None:
        _check_arguments(type(self), model, grad_outputs, base, kwargs.get("lr", args[0] if args else None))
        self._capture: Capture | None = None
        self._strict = bool(strict)
        self._process_group = process_group
        self._coverage_checked = False
        self._unscaled_by: Tensor | None = None
        self._step_depth = 0
        self._step_inputs: Inputs | None = None
        self._model = model
        self._model_params: dict[Tensor, None] = dict.fromkeys(unwrap_model(model).parameters())
        if params is None:
            params = [p for p in self._model_params if p.requires_grad]
        self._construct_stock(base, params, args, kwargs)
        self._check_param_groups()  # before any hook is attached, so failing leaves none
        self._capture = Capture(
            model,
            self._modules_to_capture(self._params()),
            storage=storage,
            grad_outputs=type(self).grad_outputs if grad_outputs is None else grad_outputs,
            keep_calls=self._has_rule() if type(self).reads_calls is None else bool(type(self).reads_calls),
        )
        self._capture.grad_scaler = grad_scaler
        weakref.finalize(self, self._capture.remove)  # the capture dies with its optimizer, even if still held
        self._install_reductions()
        unscales_itself(self)  # GradScaler calls step() even on inf/NaN and leaves unscaling to us

    def _construct_stock(
        self, base: type[Optimizer] | None, params: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """The stock optimizer's (or ``base``'s) construction, which validates its hyperparameters."""
        name = type(self).__name__
        try:
            if base is None:
                super().__init__(params, *args, **kwargs)
            else:
                self._compose(base, params, args, kwargs)
        except TypeError as error:
            if "unexpected keyword argument" not in str(error):
                raise
            keyword = str(error).rsplit(" ", 1)[-1]
            renamed = RENAMED.get(keyword.strip("'"))
            if renamed is not None:
                raise TypeError(f"{name}: {keyword} was renamed: {renamed}") from error
            stock = base or self._stock
            accepted = [
                n
                for function in (type(self).__init__, stock.__init__)
                for n, p in inspect.signature(function).parameters.items()
                if n not in ("self", "model", "params") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            ]
            raise TypeError(
                f"{name}() got an unexpected keyword argument {keyword} (neither its own nor {stock.__name__}'s); "
                f"it takes: {', '.join(dict.fromkeys(accepted))}"
            ) from error
        except ValueError as error:
            if "empty parameter list" in str(error) and not any(p.requires_grad for p in self._model_params):
                raise ValueError(
                    f"{name}: the model has no parameter that requires grad, so there is nothing to train"
                ) from error
            if base is not None and "parameter" in str(error):
                muon = issubclass(base, getattr(torch.optim, "Muon", ()))
                recipe = " (Muon: the 2-D weight matrices of the hidden layers; AdamW for the rest)" if muon else ""
                raise ValueError(
                    f"{name}(base={base.__name__}): {base.__name__} refused the parameters given: {error}. Pass "
                    f"params= only those it takes{recipe}, and train the others with another optimizer"
                ) from error
            raise

    def __new__(cls, *args: Any, **kwargs: Any) -> InputAwareOptimizer:
        self = super().__new__(cls)
        self.__dict__["_arguments"] = (args, kwargs)  # what a copy is rebuilt from (see __reduce_ex__)
        return self

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        """Copies (``copy.deepcopy``, ``pickle``, ``torch.save``) are constructed anew on the copied
        model with the same arguments and param groups (an iterator of them is spent by then), then
        loaded with this one's ``state_dict()``."""
        args, kwargs = self.__dict__.get("_arguments", ((), {}))
        bound = inspect.signature(type(self).__init__).bind(self, *args, **kwargs)
        names = bound.signature.parameters
        groups = [{"params": list(group["params"])} for group in self.param_groups]
        if "params" in names:
            bound.arguments["params"] = groups
        else:  # a rule that forwards params through **kwargs
            var_keyword = next(n for n, p in names.items() if p.kind is p.VAR_KEYWORD)
            bound.arguments[var_keyword] = {**bound.arguments.get(var_keyword, {}), "params": groups}
        return (_rebuilt, (type(self), bound.args[1:], bound.kwargs, self.state_dict()))

    def _compose(self, base: type[Optimizer], params: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """``base=``: a ``base`` instance shares the param groups and its ``step`` applies the update; it keeps
        its own per-parameter state, ``state_dict()`` holds both (the rule's under ``"rule_state"``)."""
        if self._has_rule() and inspect.signature(base.step).parameters["closure"].default is inspect.Parameter.empty:
            raise ValueError(
                f"{type(self).__name__} changes the gradients before the update, but {base.__name__} is driven by "
                f"its closure: it re-evaluates the closure and reads the gradients that produces, so the rule's "
                f"would never reach it. Use {base.__name__} on its own, or a base whose step takes the gradients"
            )
        inner = base(params, *args, **kwargs)
        Optimizer.__init__(self, inner.param_groups, inner.defaults)
        self.param_groups = inner.param_groups  # one list of the same group dicts
        self.__dict__["_stock"] = base
        self._base_optimizer = inner
        self.register_state_dict_post_hook(_with_base_state, prepend=True)
        self.register_load_state_dict_post_hook(_split_base_state, prepend=True)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # load_state_dict ends here. With base=, the base's __setstate__ fills in its group defaults
        # (not this class's stock's: an SGD key has no place in AdamW's groups).
        inner = self.__dict__.get("_base_optimizer")
        if inner is None:
            super().__setstate__(state)
            return
        Optimizer.__setstate__(self, state)
        inner.__setstate__({"state": inner.state, "param_groups": self.param_groups})

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
        if self._capture is None:  # in __init__: the capture is built once all groups are
            return
        try:
            self._check_param_groups()  # the rule's own validation of the new group
        except Exception:
            self.param_groups.pop()
            raise
        self._capture.add_modules(self._modules_to_capture([t for t in tensors if isinstance(t, Tensor)]))
        self._install_reductions()  # the new group's layers join the rule's reductions
        if (hooks := self.__dict__.get("_inputs_hooks")) is not None:
            hooks.rescope()  # and the layers a hook reads

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict, as torch does; groups saved by another optimizer (say, a stock
        ``torch.optim.SGD``) get this rule's hyperparameters from its defaults."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            if "batch_averaged" in group:  # a 0.2 checkpoint of K-FAC or Eva: the key is loss_reduction now
                group["loss_reduction"] = "mean" if group.pop("batch_averaged") else "sum"
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        self._check_param_groups()

    def _build_reductions(self) -> dict[str, Reduction]:
        """The reductions a rule reads, by the attribute it keeps each under (default: none)."""
        return {}

    def _install_reductions(self) -> None:
        for attribute, reduction in self._build_reductions().items():
            old = self.__dict__.get(attribute)
            if old is not None:
                self.capture.remove_reduction(old)
            setattr(self, attribute, reduction)
            self.capture.add_reduction(reduction)

    def _params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _modules_to_capture(self, params: Iterable[Tensor]) -> list[nn.Module]:
        wanted = {id(p) for p in params}
        types, capability = self.captured_module_types, self.reads_capability
        return [
            module
            for module in unwrap_model(self._model).modules()
            if (types is None or isinstance(module, types))
            and (capability is None or ((kind := layer_kind(module)) is not None and kind.provides(capability)))
            and any(id(p) in wanted for p in module._parameters.values() if p is not None)
        ]

    @property
    def capture(self) -> Capture:
        """The ``Capture`` that records the model's forward calls for this optimizer."""
        if self._capture is None:
            raise RuntimeError(
                f"{type(self).__name__}.capture is built at the end of InputAwareOptimizer.__init__; "
                "read it after that (not in _check_param_groups)"
            )
        return self._capture

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

    def _layers(self, capability: str, *, with_excluded: bool = False) -> list[Layer]:
        """The captured layers whose weight this optimizer trains and whose kind provides ``capability``
        (without those the rule excludes, unless ``with_excluded``); kept while the watched modules and the
        param groups (each group dict and the parameters in it) stay the same: read every step, found by
        walking the model."""
        key = (capability, with_excluded)
        cache = self.__dict__.setdefault("_layers_cache", {})
        kept = cache.get(key)
        watched = self.capture.modules
        # The group dicts and parameters themselves (kept, so an object compared later is never a reused id),
        # and what each watched module registers by name (pruning or a parametrization moves its weight).
        now = [x for group in self.param_groups for x in (group, *group["params"])]
        now += [x for module in watched for item in module._parameters.items() for x in item]
        if kept is None or kept[0] != watched or len(kept[1]) != len(now) or not all(map(operator.is_, kept[1], now)):
            if kept is not None:  # the layers changed: the fallbacks are reported again at the next step
                self._coverage_checked = False
            kept = cache[key] = (watched, now, self._find_layers(capability, with_excluded))
        return list(kept[2])

    def _find_layers(self, capability: str, with_excluded: bool) -> list[Layer]:
        groups = {p: group for group in self.param_groups for p in group["params"]}
        owners: dict[Tensor, list[nn.Module]] = {}
        for module in self.capture.modules:
            kind = layer_kind(module)
            weight = weight_or_none(module)
            if kind is not None and kind.provides(capability) and isinstance(weight, Tensor) and weight in groups:
                owners.setdefault(weight, []).append(module)
        layers = []
        for weight, modules in owners.items():  # one layer per weight, however many modules share it
            # Not one shared with a module whose calls give no statistics (see _uncovered), or by several kinds.
            if len(self._owners_in_model(weight)) != len(modules) or len({type(layer_kind(m)) for m in modules}) > 1:
                continue
            kind = layer_kind(modules[0])
            assert kind is not None
            bias = bias_of(modules[0])
            homogeneous = isinstance(bias, Tensor) and bias in groups and len({id(bias_of(m)) for m in modules}) == 1
            layer = Layer(modules[0], kind, homogeneous, groups[weight], tuple(modules))
            if with_excluded or self._excluded(layer) is None:
                layers.append(layer)
        return layers

    def _owners_in_model(self, param: Tensor) -> list[nn.Module]:
        """Every module of the model that owns ``param`` directly (tied weights: several)."""
        return [m for m in unwrap_model(self._model).modules() if any(p is param for p in m._parameters.values())]

    def _excluded(self, layer: Layer) -> str | None:
        """Why a rule leaves this layer to the stock update (say, over a size limit), or ``None``."""
        return None

    def coverage(self) -> Coverage:
        """How each trainable parameter is updated, with the reason wherever it is the stock update.

        ``print(opt.coverage())`` shows it as a table; ``.fallbacks()`` lists the weight matrices
        the rule could be expected to cover but leaves to the stock update.
        """
        owners = parameter_names(self._model)
        rows = Coverage()
        for param in self._params():
            if param.requires_grad:
                name, module = owners.get(param, (f"<unnamed {tuple(param.shape)}>", None))
                kind = type(module).__name__ if module is not None else ""
                rows.append(Treatment(name, tuple(param.shape), kind, *self._treatment(param, module)))
        return rows

    def _treatment(self, param: Tensor, module: nn.Module | None) -> tuple[str, str | None, bool]:
        """``(what is done, why stock or None, whether that is a fallback)`` for one parameter."""
        if self._has_rule() and module is not None and module in self.capture.modules:
            return f"{type(self).__name__} (reads the calls of {type(module).__name__})", None, False
        return f"stock {self._stock.__name__}", None, False

    def _layer_treatment(self, param: Tensor, module: nn.Module | None, what: str) -> tuple[str, str | None, bool]:
        """The treatment by a rule that acts on its ``reads_capability`` layers (``what`` names the action)."""
        capability = self.reads_capability
        assert capability is not None
        for layer in self._layers(capability):
            if weight_of(layer.module) is param:
                return f"{what} ({type(layer.module).__name__})", None, False
            if layer.homogeneous and bias_of(layer.module) is param:
                return f"{what} (bias column of {type(layer.module).__name__})", None, False
        reason, fallback = self._uncovered(param, module, capability)
        return f"stock {self._stock.__name__}", explained(module, reason), fallback

    def _uncovered(self, param: Tensor, module: nn.Module | None, capability: str) -> tuple[str, bool]:
        """Why a rule acting on layers with ``capability`` leaves ``param`` to the stock update, and
        whether that is a fallback (a weight matrix the rule could be expected to cover)."""
        matrix = param.dim() >= 2  # a weight matrix is what such a rule is for; a scale or bias alone is not
        if module is None:
            return "not a parameter of any module (used functionally)", matrix
        if param is not weight_or_none(module):
            return _not_the_weight(param, module), matrix and param is not bias_of(module)
        kind = layer_kind(module)
        if kind is None:
            return why_no_kind(module), matrix
        if not kind.provides(capability):
            return f"{type(module).__name__} has no {capability.replace('_', ' ')} (its LayerKind)", matrix
        if not any(p is param for p in self._params() if p.requires_grad):
            return "not trained by this optimizer", False
        others = [m for m in self._owners_in_model(param) if (k := layer_kind(m)) is None or not k.provides(capability)]
        if others:
            names = ", ".join(f"{self.capture.name(m)} ({type(m).__name__})" for m in others)
            return f"the weight is shared with {names}, whose calls give no {capability.replace('_', ' ')}", True
        layer = next((c for c in self._layers(capability, with_excluded=True) if weight_of(c.module) is param), None)
        if layer is not None and (reason := self._excluded(layer)) is not None:
            return reason, True
        return "its module is not captured (a weight shared with a module of another kind?)", matrix

    def _check_coverage(self) -> None:
        """At the first step: warn once about every fallback, or refuse them under ``strict=True``."""
        self._coverage_checked = True
        fallbacks = self.coverage()
        if not fallbacks.fallbacks():
            return
        message = (
            f"{type(self).__name__} updates {len(fallbacks.fallbacks())} weight matrices with the stock update instead "
            f"of its rule: {fallbacks.describe_fallbacks()}. print(optimizer.coverage()) shows every parameter"
        )
        if self._strict:
            self._coverage_checked = False
            raise RuntimeError(f"{message}. strict=True refuses this; no parameter was changed")
        warnings.warn(message, CoverageWarning, stacklevel=6)  # the caller of step()

    def _warn_if_no_layers(self, capability: str, wanted: str) -> None:
        if self._layers(capability):
            return
        plain = ", ".join(self.capture.name(m) for m in unwrap_model(self._model).modules() if m._parameters) or "none"
        warnings.warn(
            f"{type(self).__name__} found no {wanted} among the modules that own its parameters; it "
            f"will update every parameter with the plain stock rule (modules: {plain})",
            stacklevel=3,
        )

    def _refuse_sharded_parameters(self, why: str) -> None:
        """Raise at construction if any parameter is sharded (FSDP2 / DTensor): the rule needs whole tensors."""
        if any(sharded(p) for p in self._params()):
            raise NotImplementedError(
                f"{type(self).__name__} does not support sharded (FSDP2 / DTensor) parameters yet: {why}. "
                "Use DistributedDataParallel, or InputAwareAdamW / InputAwareSGD / LazyAdamW under FSDP2"
            )

    def _check_param_groups(self) -> None:
        """A rule's place to add its hyperparameters to the groups and validate them (before any hook is attached)."""

    def _check_group(self, group: dict[str, Any]) -> None:
        """A rule's check of one group's hyperparameters (``ValueError``), also run before every step:
        a value set in ``param_groups`` since (a schedule, a typo) is refused before any change."""

    def _set_group_defaults(self, **hyperparameters: Any) -> None:
        """Add a rule's hyperparameters to ``defaults`` and to every group that lacks them."""
        self.defaults.update(hyperparameters)
        for group in self.param_groups:
            for key, value in hyperparameters.items():
                group.setdefault(key, value)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "capture_grad_outputs" in cls.__dict__:  # an attribute of 0.2 that would now do nothing
            raise TypeError(f"{cls.__qualname__}: capture_grad_outputs was renamed: set grad_outputs = True")
        if "__init__" in cls.__dict__:  # its own arguments, not a parent drop-in's
            cls.__signature__ = None  # type: ignore[attr-defined]
        elif "_stock" in cls.__dict__:  # a drop-in: the stock class's arguments, then the capture's
            cls.__signature__ = _drop_in_signature(cls._stock)  # type: ignore[attr-defined]
        step = cls.__dict__.get("step")
        if step is not None and not hasattr(step, "inputaware_entry"):
            cls.step = _entry(step)  # type: ignore[method-assign]

    def _run_step(self, step: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The outermost step, once torch's wrapper ran the step pre-hooks (``args`` are theirs)."""
        try:
            self._check_before_step()
            if self._amp_skips_step():
                return None
            closure, inputs = _step_arguments(args, kwargs)
            hooks: StepHooks | None = self.__dict__.get("_inputs_hooks")
            due = hooks if hooks is not None and hooks.due() else None
            if due is not None and kernel_skips_step(self):  # (fused AdamW under GradScaler, inf found)
                hooks = due = None  # as on any step GradScaler skips: its hooks neither run nor count it
            # (the stock update with nothing reading the capture takes no view of it)
            view = self._resolve_inputs(inputs) if inputs is not None or due is not None or self._has_rule() else None
            if due is not None and view is not None:
                closure = due.evaluate_closure(closure)  # pre-step hooks see the closure's calls
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
            if hooks is not None:
                hooks.advance()
            return out
        except BaseException:
            self._undo_unscaling()  # nothing is lost: the gradients are as GradScaler left them
            raise
        finally:
            self._unscaled_by = None

    def _check_before_step(self) -> None:
        """The groups' values as they are now, and (once, and after the layers changed) the coverage report."""
        for index, group in enumerate(self.param_groups):
            try:
                self._check_group(group)
            except ValueError as error:
                raise ValueError(f"param group {index}: {error}. No parameter was changed") from None
        if self.reads_capability is not None:
            self._layers(self.reads_capability)  # (a layout changed since re-arms the coverage report)
        if not self._coverage_checked:
            self._check_coverage()

    def _resolve_inputs(self, inputs: Any) -> Inputs:
        if inputs is None:
            return self.capture._live_inputs()
        if isinstance(inputs, Inputs):
            if inputs._expired:
                raise RuntimeError(inputs._expired)
            return inputs
        if isinstance(inputs, Mapping):
            return Inputs.from_mapping(inputs, self.capture._owners, self.capture._watched)
        raise TypeError(
            "step(inputs=...) expects an inputaware_optim.Inputs (for example Capture.inputs()) or a "
            f"mapping from modules or parameters to Captured calls, got {type(inputs).__name__}"
        )

    def step(self, closure: Callable[[], Any] | None = None, inputs: Inputs | None = None) -> Any:  # type: ignore[override]
        """Perform one optimization step.

        Override this to write an input-aware rule: ``inputs.get(p)`` gives the calls of
        the module(s) that own parameter ``p`` whose gradient is in ``p.grad`` (including the
        closure's, once the closure has run). End with ``super().step(inputs=inputs)`` to
        apply the stock update.

        Args:
            closure: A closure that reevaluates the model and returns the loss.
            inputs: The inputs to hand to the rule; by default, those captured for this step.
        """
        inner = self.__dict__.get("_base_optimizer")
        if inner is not None:  # base=: the stock base optimizer's own step, on the shared state
            out = unhooked(type(inner).step)(inner, closure)
            for param in inner.state:  # ``optimizer.state`` is not empty while the base's is not (checkpointers
                self.state.setdefault(param, {})  # ask it whether to initialize; empty entries are not saved)
            return out
        return unhooked(self._stock.step)(self, closure)

    def register_inputs_hook(
        self, hook: InputsHook, *, when: When = "pre", every: int = 1, reads: Reads = "calls"
    ) -> InputsHookHandle:
        """Run ``hook`` once per step (every ``every`` steps) with the step's ``Inputs``, from the next step.

        ``when="pre"``: ``hook(optimizer, inputs)`` before the update (after the closure ran);
        ``when="post"``: ``hook(optimizer, inputs, updates)`` after it, ``updates`` being each parameter's
        change if ``reads`` includes ``"updates"`` (else ``None``). ``reads`` is what the hook reads, the
        capture keeping only that, at its steps: ``"calls"``, ``Reduction`` instances (``inputs.reduced``),
        ``"updates"``, a list of these, or ``None`` (raw calls are read from the step after a backward).

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

    def _has_rule(self) -> bool:
        return type(self).step is not InputAwareOptimizer.step

    def _amp_skips_step(self) -> bool:
        """Unscale for a GradScaler-driven step; True if the step must be skipped (inf/NaN)."""
        grad_scale, found_inf = scaler_handoff(self)
        if found_inf is None:
            return False
        capture = self.capture
        capture.refresh()  # before the unscaling below changes the gradients in place
        if not self._has_rule() and any(group.get("fused") for group in self.param_groups):
            return False  # the stock fused kernel unscales and skips by itself
        if found_inf.item():
            capture.clear()  # GradScaler skips the step: so do the captures
            return True
        if capture.grad_scaler is None and (
            (capture.keep_calls and capture.grad_outputs) or any(r.grad_outputs for r in capture.reductions)
        ):
            raise RuntimeError(
                f"{type(self).__name__} reads the output gradients of its layers, and under a GradScaler they "
                "carry the loss scale. Construct it with grad_scaler=scaler (the GradScaler you step with) so "
                "that they are unscaled where they are read. No parameter was changed"
            )
        if grad_scale is not None:
            self._unscale_grads(grad_scale)
            self._unscaled_by = grad_scale
            capture._gradients_rescaled()
        hide_scaler_handoff(self)  # from the stock kernels (GradScaler deletes it after the step)
        return False

    def _grads(self) -> list[Tensor]:
        return [in_place_values(p.grad) for p in self._params() if p.grad is not None]

    @torch.no_grad()
    def _undo_unscaling(self) -> None:
        """After a step that raised: scale the gradients back and clear what GradScaler set."""
        scale = self.__dict__.get("_unscaled_by")
        if scale is not None:
            for grad in self._grads():
                grad.mul_(scale.to(grad.device, grad.dtype))
            self.capture._gradients_rescaled()
        drop_scaler_handoff(self)

    @torch.no_grad()
    def _unscale_grads(self, grad_scale: Tensor) -> None:
        # GradScaler.unscale_'s kernel and grouping, so the result is bitwise the stock path's.
        inv_scale = grad_scale.double().reciprocal().float()
        grouped: defaultdict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
        for grad in self._grads():
            if grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            grouped[(grad.device, grad.dtype)].append(grad)
        for (device, _), grads in grouped.items():
            grad_scaler_unscale_(grads, torch.zeros(1, device=device), inv_scale.to(device))


def _rebuilt(
    cls: type[InputAwareOptimizer], args: tuple[Any, ...], kwargs: dict[str, Any], state: dict[str, Any]
) -> Any:
    optimizer = cls(*args, **kwargs)
    optimizer.load_state_dict(state)
    return optimizer


def _not_the_weight(param: Tensor, module: nn.Module) -> str:
    """Why ``param``, a parameter of ``module`` other than its weight matrix, is left to the stock update."""
    kind = layer_kind(module)
    if param is bias_of(module) and kind is not None:
        return "its layer is not covered, or the bias is trained apart from the weight"
    name = next((n for n, p in module._parameters.items() if p is param), "?")
    if kind is not None and module._parameters.get(kind.weight_name) is None:  # computed from ``param``
        return f"its {kind.weight_name} is computed from {name} (pruning, weight_norm or a parametrization)"
    return f"{type(module).__name__}.{name} is not a weight matrix"


def _with_base_state(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """State-dict post-hook of ``base=``: the base optimizer's state, the rule's under ``"rule_state"``."""
    combined = optimizer.__dict__["_base_optimizer"].state_dict()
    for index, rule_state in state_dict["state"].items():
        if rule_state:
            combined["state"].setdefault(index, {})["rule_state"] = rule_state
    return combined


def _split_base_state(optimizer: Optimizer) -> None:
    """Load-state-dict post-hook of ``base=``: torch loaded the whole state here; the base's part goes
    to it, and the groups are one list again."""
    inner = optimizer.__dict__["_base_optimizer"]
    inner.param_groups = optimizer.param_groups
    inner.state = defaultdict(dict)
    for param, entry in list(optimizer.state.items()):
        rule_state = entry.pop("rule_state", None)
        if entry:
            inner.state[param] = entry
        if rule_state:
            optimizer.state[param] = rule_state
        else:
            del optimizer.state[param]


InputAwareOptimizer.step = _entry(InputAwareOptimizer.step)  # type: ignore[method-assign]
