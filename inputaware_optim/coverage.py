"""Coverage: how an optimizer treats each of its parameters (``opt.coverage()``), so that no fallback is silent."""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from torch import Tensor, nn

from . import layers
from .capture import parameter_names, unwrap_model
from .layers import Layer, bias_of, explained, layer_kind, weight_of, weight_or_none, why_no_kind

if TYPE_CHECKING:
    from .base import InputAwareOptimizer

__all__ = ["Coverage", "CoverageWarning", "Treatment", "layer_treatment", "supported_layers_table"]

Excluded = Callable[[Layer], "str | None"]  # why a rule leaves a layer to the stock update (say, over a size limit)


class CoverageWarning(UserWarning):
    """A rule updates some weight matrices with the stock update instead (the warning lists them)."""


class Treatment(NamedTuple):
    """How one parameter is updated.

    Attributes:
        name: The parameter's qualified name in the model.
        shape: Its shape.
        module: The type of the module that owns it (``""`` if none does directly).
        treatment: What the rule does with it ("FOOF (Kronecker, Linear)", "stock SGD", ...).
        reason: Why it gets the stock update, where it does (``None`` otherwise).
        fallback: Whether that is a fallback the rule would otherwise cover (warned, refused
            under ``strict=True``), rather than by design (a norm's scale, a bias on its own).
    """

    name: str
    shape: tuple[int, ...]
    module: str
    treatment: str
    reason: str | None = None
    fallback: bool = False


class Coverage(list[Treatment]):
    """Every trainable parameter's ``Treatment``; ``print(opt.coverage())`` shows a table."""

    def fallbacks(self) -> list[Treatment]:
        """The parameters that fall back to the stock update though the rule could cover them."""
        return [row for row in self if row.fallback]

    def __str__(self) -> str:
        header = ("parameter", "shape", "module", "treatment", "why stock")
        rows = [header] + [
            (r.name, "x".join(map(str, r.shape)) or "scalar", r.module, r.treatment, r.reason or "") for r in self
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * width for width in widths))
        return "\n".join(lines)

    def describe_fallbacks(self) -> str:
        """The fallbacks in one sentence each (for the warning and the strict error)."""
        return "; ".join(f"{r.name} ({r.module}): {r.reason}" for r in self.fallbacks())


_RULES = ("FOOF", "K-FAC / Eva", "NLMS", "LazyAdamW", "DPSGD / DPAdamW")
_FALLBACK = "stock, reported"  # every built-in kind has a weight matrix
_MATRICES = f"{_FALLBACK} (matrices)"

# Layers no registered kind describes, as every rule treats them (what the registry cannot say).
_UNREGISTERED = (
    ("any other module with parameters (norms, custom layers)", (_MATRICES,) * 3 + ("stock", "exact (torch.func)")),
    (
        "a registered type's subclass with its own `forward` (timm's `StdConv2d`)",
        (_FALLBACK,) * 3 + ("stock", "exact (torch.func)"),
    ),
    ("`nn.LSTM`, `nn.GRU`, `nn.RNN` and their cells", (_FALLBACK,) * 3 + ("stock", "refused")),
    ("`nn.BatchNorm*d` in training mode", ("stock", "stock", "stock", "stock", "refused")),
    (
        "weights under `weight_norm`, `spectral_norm` or `prune` (before or during training)",
        (_FALLBACK,) * 3 + ("stock", "refused"),
    ),
    ("any layer with complex weights", (_FALLBACK,) * 3 + ("stock", "refused")),
)


def supported_layers_table() -> str:
    """The README's "Supported layers" table (Markdown), read from the layer registry.

    Cells: "exact" (the rule's own update), "stock" (the stock update by design: not a weight matrix, or not a table),
    "stock, reported" (a fallback, listed in ``coverage()``, warned once, refused under ``strict=True``; "(matrices)":
    for the weight matrices, the rest by design), "refused" (raises, naming the module).
    """
    kinds: dict[layers.LayerKind, list[str]] = {}
    for key, kind in layers._REGISTRY.items():
        if type(kind).__module__ == layers.__name__:  # the built-in kinds, not a user's
            kinds.setdefault(kind, []).append(_type_name(key))
    rows = [(", ".join(names), _cells(kind)) for kind, names in kinds.items()] + list(_UNREGISTERED)
    lines = ["| layer | " + " | ".join(_RULES) + " |", "|---" * (len(_RULES) + 1) + "|"]
    return "\n".join(lines + [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows])


def _type_name(key: type | str) -> str:
    if isinstance(key, str):
        return f"`{key}` (by name)"
    return f"`nn.{key.__name__}`" if key.__module__.startswith("torch.nn") else f"`{key.__qualname__}`"


def _cells(kind: layers.LayerKind) -> tuple[str, ...]:
    left = _FALLBACK if kind.matrix else "stock"  # (a scale or shift per feature is no rule's to cover)
    foof = "exact" if kind.provides("input_rows") else left
    kfac = "exact" if kind.provides("input_rows") and kind.provides("output_grad_rows") else left
    lazy = "exact" if kind.provides("touched_rows") else "stock"
    dp = "exact (closed form)" if kind.provides("per_sample") else "exact (torch.func)"
    return foof, kfac, foof, lazy, "refused" if kind.per_sample_refusal is not None else dp


# -- which layers an optimizer trains, and how each parameter is treated ------------------------------------


def trained_layers(optimizer: InputAwareOptimizer, capability: str) -> list[Layer]:
    """The captured layers whose weight ``optimizer`` trains and whose kind provides ``capability``; kept while
    the watched modules and the param groups (each group dict and the parameters in it) stay the same: read
    every step, found by walking the model."""
    cache = optimizer.__dict__.setdefault("_layers_cache", {})
    kept = cache.get(capability)
    watched = optimizer.capture.modules
    # The group dicts and parameters themselves (kept, so an object compared later is never a reused id),
    # and what each watched module registers by name (pruning or a parametrization moves its weight).
    now = [x for group in optimizer.param_groups for x in (group, *group["params"])]
    now += [x for module in watched for item in module._parameters.items() for x in item]
    if kept is None or kept[0] != watched or len(kept[1]) != len(now) or not all(map(operator.is_, kept[1], now)):
        if kept is not None:  # the layers changed: the fallbacks are reported again at the next step
            optimizer._coverage_checked = False
        kept = cache[capability] = (watched, now, _find_layers(optimizer, capability))
    return list(kept[2])


def _find_layers(optimizer: InputAwareOptimizer, capability: str) -> list[Layer]:
    groups = {p: group for group in optimizer.param_groups for p in group["params"]}
    owners: dict[Tensor, list[nn.Module]] = {}
    for module in optimizer.capture.modules:
        kind = layer_kind(module)
        weight = weight_or_none(module)
        if kind is not None and kind.provides(capability) and isinstance(weight, Tensor) and weight in groups:
            owners.setdefault(weight, []).append(module)
    found = []
    for weight, modules in owners.items():  # one layer per weight, however many modules share it
        # Not one shared with a module whose calls give no statistics (see uncovered), or by several kinds.
        if len(owners_in_model(optimizer, weight)) != len(modules) or len({type(layer_kind(m)) for m in modules}) > 1:
            continue
        kind = layer_kind(modules[0])
        assert kind is not None
        bias = bias_of(modules[0])
        homogeneous = isinstance(bias, Tensor) and bias in groups and len({id(bias_of(m)) for m in modules}) == 1
        found.append(Layer(modules[0], kind, homogeneous, groups[weight], tuple(modules)))
    return found


def owners_in_model(optimizer: InputAwareOptimizer, param: Tensor) -> list[nn.Module]:
    """Every module of the model that owns ``param`` directly (tied weights: several)."""
    return [m for m in unwrap_model(optimizer.model).modules() if any(p is param for p in m._parameters.values())]


def coverage_of(optimizer: InputAwareOptimizer) -> Coverage:
    """Each trainable parameter's treatment: what the rules do with it, else the stock update and why."""
    owners = parameter_names(optimizer.model)
    rows = Coverage()
    for param in optimizer._params():
        if param.requires_grad:
            name, module = owners.get(param, (f"<unnamed {tuple(param.shape)}>", None))
            kind = type(module).__name__ if module is not None else ""
            rows.append(Treatment(name, tuple(param.shape), kind, *_treatment(optimizer, param, module)))
    return rows


def _treatment(optimizer: InputAwareOptimizer, param: Tensor, module: nn.Module | None) -> tuple[str, str | None, bool]:
    """``(what is done, why stock or None, whether that is a fallback)``: the rules' treatments joined."""
    done: list[str] = []
    reason, fallback = None, False
    if optimizer._override_reads() and module is not None and module in optimizer.capture.modules:
        done.append(f"{type(optimizer).__name__} (reads the calls of {type(module).__name__})")
    for rule in optimizer.rules:
        found = rule.treatment(optimizer, param, module)
        if found is None:
            continue
        what, why, is_fallback = found
        if why is None:
            done.append(what)
        elif reason is None:
            reason, fallback = why, is_fallback
    if not done:
        return f"stock {optimizer.base.__name__}", reason, fallback
    return " → ".join(done), reason, fallback


def layer_treatment(
    optimizer: InputAwareOptimizer,
    param: Tensor,
    module: nn.Module | None,
    capability: str,
    what: str,
    excluded: Excluded | None = None,
) -> tuple[str, str | None, bool]:
    """The treatment by a rule acting on the ``capability`` layers it does not exclude (``what``: the action)."""
    for layer in trained_layers(optimizer, capability):
        if excluded is not None and excluded(layer) is not None:
            continue
        if weight_of(layer.module) is param:
            return f"{what} ({type(layer.module).__name__})", None, False
        if layer.homogeneous and bias_of(layer.module) is param:
            return f"{what} (bias column of {type(layer.module).__name__})", None, False
    reason, fallback = _uncovered(optimizer, param, module, capability, excluded)
    return f"stock {optimizer.base.__name__}", explained(module, reason), fallback


def _uncovered(
    optimizer: InputAwareOptimizer, param: Tensor, module: nn.Module | None, capability: str, excluded: Excluded | None
) -> tuple[str, bool]:
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
    if not any(p is param for p in optimizer._params() if p.requires_grad):
        return "not trained by this optimizer", False
    others = [
        m for m in owners_in_model(optimizer, param) if (k := layer_kind(m)) is None or not k.provides(capability)
    ]
    if others:
        names = ", ".join(f"{optimizer.capture.name(m)} ({type(m).__name__})" for m in others)
        return f"the weight is shared with {names}, whose calls give no {capability.replace('_', ' ')}", True
    layer = next((c for c in trained_layers(optimizer, capability) if weight_of(c.module) is param), None)
    if layer is not None and excluded is not None and (reason := excluded(layer)) is not None:
        return reason, True
    return "its module is not captured (a weight shared with a module of another kind?)", matrix


def _not_the_weight(param: Tensor, module: nn.Module) -> str:
    """Why ``param``, a parameter of ``module`` other than its weight matrix, is left to the stock update."""
    kind = layer_kind(module)
    if param is bias_of(module) and kind is not None:
        return "its layer is not covered, or the bias is trained apart from the weight"
    name = next((n for n, p in module._parameters.items() if p is param), "?")
    if kind is not None and module._parameters.get(kind.weight_name) is None:  # computed from ``param``
        return f"its {kind.weight_name} is computed from {name} (pruning, weight_norm or a parametrization)"
    return f"{type(module).__name__}.{name} is not a weight matrix"


def check_coverage(optimizer: InputAwareOptimizer, stacklevel: int) -> None:
    """At the first step: warn once about every fallback, or refuse them under ``strict=True``."""
    optimizer._coverage_checked = True
    fallbacks = coverage_of(optimizer)
    if not fallbacks.fallbacks():
        return
    message = (
        f"{type(optimizer).__name__} updates {len(fallbacks.fallbacks())} weight matrices with the stock update "
        f"instead of its rule: {fallbacks.describe_fallbacks()}. print(optimizer.coverage()) shows every parameter"
    )
    if optimizer._strict:
        optimizer._coverage_checked = False
        raise RuntimeError(f"{message}. strict=True refuses this; no parameter was changed")
    warnings.warn(message, CoverageWarning, stacklevel=stacklevel)


def warn_if_no_layers(optimizer: InputAwareOptimizer, capability: str, wanted: str) -> None:
    """Warn at construction when no trained layer provides what a rule acts on."""
    if trained_layers(optimizer, capability):
        return
    root = unwrap_model(optimizer.model)
    plain = ", ".join(optimizer.capture.name(m) for m in root.modules() if m._parameters) or "none"
    warnings.warn(
        f"{type(optimizer).__name__} found no {wanted} among the modules that own its parameters; it "
        f"will update every parameter with the plain stock rule (modules: {plain})",
        stacklevel=5,
    )
