"""How an input-aware optimizer is put together: its arguments checked, its base optimizer built (the stock
class it derives from, or ``base=``, whose state and param groups it shares), its rules' state saved and loaded
beside the base's, and its copies (``deepcopy``, ``pickle``, ``torch.save``) built anew."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from .capture import unwrap_model
from .rule import Rule

if TYPE_CHECKING:
    from .base import InputAwareOptimizer

__all__ = ["RENAMED", "build_base", "checked_arguments", "drop_in_signature", "rebuilt"]

# Keyword arguments renamed since 0.1, with what to write instead (0.x keeps no aliases).
RENAMED = {
    "capture_grad_outputs": "pass grad_outputs= (the name Capture, Monitor and Reduction use)",
    "batch_averaged": "pass loss_reduction='mean' (for True) or 'sum' (for False), DP's name",
}
RULE_STATE = "rule_state"  # a parameter's entry in state_dict()["state"]: {"<rule position>": the rule's state}
RULES_STATE = "rules"  # in state_dict()["param_groups"][0]: {"<rule position>": rule.state_dict()}


def drop_in_signature(init: Callable[..., None], stock: type[Optimizer]) -> inspect.Signature:
    """``(model, params=None, <the stock class's hyperparameters>, *, rules=(), <the capture's options>,
    **base_kwargs)`` from ``InputAwareOptimizer.__init__`` and the stock class's."""
    own = inspect.signature(init).parameters
    theirs = [p for name, p in inspect.signature(stock.__init__).parameters.items() if name not in ("self", "params")]
    positional = [p for p in theirs if p.kind is p.POSITIONAL_OR_KEYWORD]
    keyword = [p for p in theirs if p.kind is p.KEYWORD_ONLY]
    options = [p for p in own.values() if p.kind is p.KEYWORD_ONLY]
    return inspect.Signature(
        [own["model"], own["params"], *positional, *keyword, *options, own["kwargs"].replace(name="base_kwargs")]
    )


def subclassed(cls: type[InputAwareOptimizer], init: Callable[..., None], entry: Callable[..., Any]) -> None:
    """A subclass of ``InputAwareOptimizer`` as it is defined: its signature (a drop-in's: the stock class's
    arguments, then the capture's), its ``step`` wrapped as the library's entry (``entry``), a 0.2 name refused."""
    if "capture_grad_outputs" in cls.__dict__:  # an attribute of 0.2 that would now do nothing
        raise TypeError(f"{cls.__qualname__}: capture_grad_outputs was renamed: set grad_outputs = True")
    if "__init__" in cls.__dict__:  # its own arguments, not a parent drop-in's
        cls.__signature__ = None  # type: ignore[attr-defined]
    elif "_stock" in cls.__dict__ and cls._stock is not None:  # a drop-in
        cls.__signature__ = drop_in_signature(init, cls._stock)  # type: ignore[attr-defined]
    step = cls.__dict__.get("step")
    if step is not None and not hasattr(step, "inputaware_entry"):
        cls.step = entry(step)  # type: ignore[method-assign]


def checked_arguments(
    cls: type[InputAwareOptimizer], model: Any, params: Any, rules: Any, grad_outputs: Any, base: Any, lr: Any
) -> tuple[Rule, ...]:
    """Refuse, before anything is built, what the constructor of ``cls`` cannot take; the rules as a tuple."""
    name = cls.__name__
    _refuse_overrides_without_inputs(cls)
    if not isinstance(model, nn.Module):
        hint = ""
        if isinstance(model, Iterable) and not isinstance(model, (str, bytes)):
            hint = (
                f"; unlike torch.optim, {name} takes the model itself, then the parameters: "
                f"{name}(model, lr=...) or {name}(model, params=param_groups, lr=...)"
            )
        raise TypeError(f"{name} expects an nn.Module as its first argument, got {type(model).__name__}{hint}")
    if isinstance(params, (int, float, Tensor)) and not isinstance(params, bool):
        raise TypeError(
            f"{name}(model, {params!r}): the second argument is params (the parameters or param groups, default: "
            f"every parameter of the model that requires grad), not the learning rate; pass lr={params!r}"
        )
    if grad_outputs is False and cls.grad_outputs:
        raise ValueError(f"{name} needs the output gradients of its layers; leave grad_outputs unset")
    _refuse_base(cls, base)
    if isinstance(lr, Iterable) and not isinstance(lr, (Tensor, str)):
        raise TypeError(
            f"{name} got {type(lr).__name__} for lr: the parameters are a keyword argument here, "
            f"{name}(model, params=param_groups, lr=...)"
        )
    return _checked_rules(name, rules)


def _refuse_overrides_without_inputs(cls: type[InputAwareOptimizer]) -> None:
    for owner in cls.__mro__:  # an override that cannot take its inputs
        raw = getattr(owner.__dict__.get("step"), "inputaware_entry", None)
        if raw is not None and not any(
            p.name == "inputs" or p.kind is p.VAR_KEYWORD for p in inspect.signature(raw).parameters.values()
        ):
            raise TypeError(
                f"{owner.__qualname__}.step must accept the captured inputs: define it as "
                "`def step(self, closure=None, inputs=None)` and pass inputs=inputs to super().step()"
            )


def _refuse_base(cls: type[InputAwareOptimizer], base: Any) -> None:
    if base is None:
        if cls._stock is None:
            raise TypeError(
                f"Invalid base: {cls.__name__} has no stock optimizer of its own: pass base= (say "
                "base=torch.optim.AdamW)"
            )
        return
    if not (isinstance(base, type) and issubclass(base, Optimizer)):
        raise TypeError(f"Invalid base: {base!r} (must be a torch.optim.Optimizer subclass, say torch.optim.AdamW)")
    if getattr(base, "_stock", None) is not None:
        raise TypeError(f"Invalid base: {base.__name__} is input-aware itself; pass the stock optimizer class")


def _checked_rules(name: str, rules: Any) -> tuple[Rule, ...]:
    if isinstance(rules, Rule) or not isinstance(rules, Iterable):
        rules = [rules]
    rules = tuple(rules)
    for rule in rules:
        if isinstance(rule, type) and issubclass(rule, Rule):
            raise TypeError(f"{name}(rules=...): got the class {rule.__name__}; pass an instance, {rule.__name__}()")
        if not isinstance(rule, Rule):
            raise TypeError(f"{name}(rules=...) takes inputaware_optim.Rule instances, got {type(rule).__name__}")
    if len({id(r) for r in rules}) < len(rules):
        raise ValueError(f"{name}(rules=...): one rule is listed twice; each rule keeps its own state, construct two")
    _refuse_broken_guarantees(name, rules)
    return rules


def _refuse_broken_guarantees(name: str, rules: tuple[Rule, ...]) -> None:
    """A private rule (DP) sees the gradient backward made, and nothing after it reads the batch."""
    for position, rule in enumerate(rules):
        private = next((r for r in rules[:position] if r.private), None)
        if private is not None and (rule.reads_calls or rule.read_reductions() or rule.layers is not None):
            raise ValueError(
                f"{name}(rules=...): {type(rule).__name__} reads the step's inputs after {type(private).__name__} "
                "privatized the gradients: what it does with them is covered by no privacy guarantee and would "
                f"leak the batch. Put it before {type(private).__name__} (if it changes no gradient), or leave it out"
            )
        if rule.private and any(r.changes_gradients for r in rules[:position]):
            before = ", ".join(type(r).__name__ for r in rules[:position] if r.changes_gradients)
            raise ValueError(
                f"{name}(rules=...): {type(rule).__name__} clips each sample's gradient as backward made it, but "
                f"{before} changes the gradients before it; put {type(rule).__name__} first"
            )


def build_base(
    optimizer: InputAwareOptimizer, base: type[Optimizer] | None, construct_stock: Callable[[], None], *arguments: Any
) -> None:
    """The stock optimizer's (or ``base``'s) construction, which validates its hyperparameters. With a ``base``
    other than the class's own stock optimizer, an instance of it holds the param groups and the state, which
    this optimizer shares (one list, one dict): its ``step`` applies the update. ``arguments``: ``(params,
    args, kwargs)`` of the base."""
    params, args, kwargs = arguments
    try:
        if base is None or base is type(optimizer)._stock:
            construct_stock()
            return
        if _changes_gradients(optimizer) and _closure_driven(base):
            raise ValueError(
                f"{type(optimizer).__name__} changes the gradients before the update, but {base.__name__} is driven "
                "by its closure: it re-evaluates the closure and reads the gradients that produces, so the rule's "
                f"would never reach it. Use {base.__name__} on its own, or a base whose step takes the gradients"
            )
        inner = base(params, *args, **kwargs)
    except TypeError as error:
        _explain_keyword(optimizer, base, error)
        raise
    except ValueError as error:
        _explain_parameters(optimizer, base, error)
        raise
    Optimizer.__init__(optimizer, inner.param_groups, inner.defaults)
    optimizer.param_groups = inner.param_groups  # one list of the same group dicts
    optimizer.__dict__["state"] = inner.state  # one state: optimizer.state[p] is the base's, as stock
    optimizer.__dict__["_base"] = inner


def _explain_keyword(optimizer: InputAwareOptimizer, base: type[Optimizer] | None, error: TypeError) -> None:
    """Raise, from a base's unexpected keyword, an error naming the class called and what it takes."""
    if "unexpected keyword argument" not in str(error):
        return
    name, stock = type(optimizer).__name__, base or type(optimizer)._stock
    assert stock is not None
    keyword = str(error).rsplit(" ", 1)[-1]
    renamed = RENAMED.get(keyword.strip("'"))
    if renamed is not None:
        raise TypeError(f"{name}: {keyword} was renamed: {renamed}") from error
    accepted = [
        n
        for function in (type(optimizer).__init__, stock.__init__)
        for n, p in inspect.signature(function).parameters.items()
        if n not in ("self", "model", "params") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    raise TypeError(
        f"{name}() got an unexpected keyword argument {keyword} (neither its own nor {stock.__name__}'s); "
        f"it takes: {', '.join(dict.fromkeys(accepted))}"
    ) from error


def _explain_parameters(optimizer: InputAwareOptimizer, base: type[Optimizer] | None, error: ValueError) -> None:
    """Raise, from a base's refusal of the parameters, an error that says what to pass instead."""
    name = type(optimizer).__name__
    if "empty parameter list" in str(error) and not any(p.requires_grad for p in optimizer._model_params):
        raise ValueError(
            f"{name}: the model has no parameter that requires grad, so there is nothing to train"
        ) from error
    if base is not None and "parameter" in str(error) and "closure" not in str(error):
        muon = issubclass(base, getattr(torch.optim, "Muon", ()))
        recipe = " (Muon: the 2-D weight matrices of the hidden layers; AdamW for the rest)" if muon else ""
        raise ValueError(
            f"{name}(base={base.__name__}): {base.__name__} refused the parameters given: {error}. Pass "
            f"params= only those it takes{recipe}, and train the others with another optimizer"
        ) from error


def _changes_gradients(optimizer: InputAwareOptimizer) -> bool:
    return optimizer._overrides_step() or any(rule.changes_gradients for rule in optimizer.rules)


def _closure_driven(base: type[Optimizer]) -> bool:
    return inspect.signature(base.step).parameters["closure"].default is inspect.Parameter.empty


def check_rule_defaults(optimizer: InputAwareOptimizer) -> None:
    """Refuse two rules (or a rule and the base) that keep a hyperparameter under one name in the groups."""
    owners: dict[str, str] = dict.fromkeys(optimizer.defaults, optimizer.base.__name__)
    for rule in optimizer.rules:
        for key in rule.defaults:
            if key in owners and owners[key] != type(rule).__name__:
                raise ValueError(
                    f"{type(optimizer).__name__}: {type(rule).__name__} and {owners[key]} both keep {key!r} in the "
                    "param groups, where each would read the other's; compose rules whose hyperparameters differ"
                )
            owners[key] = type(rule).__name__


def model_parameters_of(optimizer: InputAwareOptimizer, param_group: dict[str, Any]) -> list[Tensor]:
    """The tensors of a group ``add_param_group`` is given (its ``params`` made a list in place, as torch does),
    each checked to be a parameter of the model (one of a module added since is found).

    Raises:
        ValueError: If a parameter does not belong to the model.
    """
    params = param_group["params"]
    if isinstance(params, Tensor):
        params = [params]
    elif not isinstance(params, set):  # torch explains why sets are refused
        params = list(params)
    param_group["params"] = params  # the caller's dict is the group, as in torch
    tensors = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]  # (name, tensor) pairs
    if any(isinstance(t, Tensor) and t not in optimizer._model_params for t in tensors):
        optimizer._model_params = dict.fromkeys(unwrap_model(optimizer.model).parameters())  # modules added since
    for index, param in enumerate(tensors):
        if isinstance(param, Tensor) and param not in optimizer._model_params:
            raise ValueError(
                f"parameter {index} of param group {len(optimizer.param_groups)} (shape {tuple(param.shape)}) is not "
                f"a parameter of the model given to {type(optimizer).__name__}. Every parameter must belong to the "
                "model so that the inputs of its module can be captured; give other tensors to a separate optimizer"
            )
    return [t for t in tensors if isinstance(t, Tensor)]


@contextlib.contextmanager
def restored_on_failure(optimizer: InputAwareOptimizer) -> Iterator[None]:
    """Put back what a ``load_state_dict`` replaces (torch builds a new state and new groups; the rules' state is
    filled in place) if anything in the block raises."""
    state, groups = optimizer.state, optimizer.param_groups
    rules = [(dict(r.state), r.state_dict()) for r in optimizer.rules]
    try:
        yield
    except BaseException:
        for owner in (optimizer, optimizer.__dict__.get("_base")):
            if owner is not None:
                owner.__dict__["state"], owner.param_groups = state, groups
        for rule, (entries, whole) in zip(optimizer.rules, rules, strict=True):
            rule.state.clear()
            rule.state.update(entries)
            if whole:  # (what the rule saved of itself: nothing to check again)
                rule.load_state_dict(whole)
        optimizer._set_up_rules()
        raise


# -- the rules' state beside the base's ------------------------------------------------------------------


def with_rule_state(optimizer: InputAwareOptimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """State-dict post-hook: each parameter's entry with the rules' state under ``"rule_state"`` (new dicts: the
    base's own stay as they are), and the rules' other state in the first param group."""
    index = {id(p): i for i, p in enumerate(optimizer._params())}
    saved: dict[int, dict[str, Any]] = {}
    for position, rule in enumerate(optimizer.rules):
        for param, entry in rule.state.items():
            if entry and id(param) in index:
                saved.setdefault(index[id(param)], {})[str(position)] = dict(entry)
    for i, rules in saved.items():
        state_dict["state"][i] = {**state_dict["state"].get(i, {}), RULE_STATE: rules}
    whole = {str(position): own for position, rule in enumerate(optimizer.rules) if (own := rule.state_dict())}
    if whole:
        state_dict["param_groups"][0][RULES_STATE] = whole
    return state_dict


def take_rule_state(optimizer: InputAwareOptimizer, state: dict[str, Any]) -> Any:
    """From what ``load_state_dict`` hands ``__setstate__``, take out the rules' state (the base then loads its
    own, as stock), and return it for ``give_rule_state``."""
    per_param: dict[Tensor, dict[str, Any]] = {}
    for param, entry in list(state["state"].items()):
        found = entry.pop(RULE_STATE, None) if isinstance(entry, dict) else None
        if found is None:
            found = _legacy_entry(optimizer, entry)
        elif found and not all(isinstance(v, dict) and k.isdigit() for k, v in found.items()):
            found = {"0": found}  # 0.3's base= layout: the one rule's keys
        if found:
            per_param[param] = found
        if isinstance(entry, dict) and not entry:
            del state["state"][param]  # (a parameter only a rule keeps state for: none in the base)
    groups = state["param_groups"]
    whole = groups[0].pop(RULES_STATE, {}) if groups else {}
    for group in groups[1:]:
        group.pop(RULES_STATE, None)
    return per_param, whole


def _legacy_entry(optimizer: InputAwareOptimizer, entry: Any) -> dict[str, Any]:
    """0.3's checkpoints of a rule on its own kept its keys beside the base's: each rule claims its own."""
    if not isinstance(entry, dict):
        return {}
    found: dict[str, Any] = {}
    for position, rule in enumerate(optimizer.rules):
        claimed = {k: entry.pop(k) for k in [k for k in entry if rule._legacy_key(k)]}
        if claimed:
            found[str(position)] = claimed
    return found


def give_rule_state(optimizer: InputAwareOptimizer, taken: Any) -> None:
    per_param, whole = taken
    for position, rule in enumerate(optimizer.rules):
        rule.state.clear()
        for param, entries in per_param.items():
            entry = entries.get(str(position))
            if entry:
                rule.state[param] = dict(entry)
        rule.load_state_dict(whole.get(str(position), {}))


# -- copies -----------------------------------------------------------------------------------------------


def reduced(optimizer: InputAwareOptimizer) -> tuple[Any, ...]:
    """Copies (``copy.deepcopy``, ``pickle``, ``torch.save``) are constructed anew on the copied model with the
    same arguments and param groups (an iterator of them is spent by then), then loaded with this one's
    ``state_dict()``."""
    args, kwargs = optimizer.__dict__.get("_arguments", ((), {}))
    bound = inspect.signature(type(optimizer).__init__).bind(optimizer, *args, **kwargs)
    names = bound.signature.parameters
    groups = [{"params": list(group["params"])} for group in optimizer.param_groups]
    if "params" in names:
        bound.arguments["params"] = groups
    else:  # a rule that forwards params through **kwargs
        var_keyword = next(n for n, p in names.items() if p.kind is p.VAR_KEYWORD)
        bound.arguments[var_keyword] = {**bound.arguments.get(var_keyword, {}), "params": groups}
    return (rebuilt, (type(optimizer), bound.args[1:], bound.kwargs, optimizer.state_dict()))


def rebuilt(cls: type[InputAwareOptimizer], args: Sequence[Any], kwargs: dict[str, Any], state: dict[str, Any]) -> Any:
    optimizer = cls(*args, **kwargs)
    optimizer.load_state_dict(state)
    return optimizer
