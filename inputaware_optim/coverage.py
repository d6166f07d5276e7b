"""Coverage: how an optimizer treats each of its parameters (``opt.coverage()``), so that no fallback is silent."""

from __future__ import annotations

from typing import NamedTuple

from . import layers

__all__ = ["Coverage", "CoverageWarning", "Treatment", "supported_layers_table"]


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
    ("`nn.LayerNorm`", ("stock", "stock", "stock", "stock", "exact (closed form)")),
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
    foof = "exact" if kind.provides("input_rows") else _FALLBACK
    kfac = "exact" if kind.provides("input_rows") and kind.provides("output_grad_rows") else _FALLBACK
    lazy = "exact" if kind.provides("touched_rows") else "stock"
    dp = "exact (closed form)" if kind.provides("per_sample") else "exact (torch.func)"
    return foof, kfac, foof, lazy, "refused" if kind.per_sample_refusal is not None else dp
