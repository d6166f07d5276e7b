"""Coverage: how an optimizer treats each of its parameters, so that no fallback is silent.

``opt.coverage()`` lists, per trainable parameter, its qualified name, the module that owns
it, what the rule does with it, and why when that is the stock update. At the first step
every fallback (a weight matrix the rule could be expected to cover but does not) is warned
once, in one warning; ``strict=True`` turns them into an error instead.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Coverage", "CoverageWarning", "Treatment"]


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
