"""What a section is given (``Config``, ``Progress``) and what it returns (``Result``).

A ``Result`` holds everything a run records about one section: display tables, the targets
with their measured values, plot data (rendered to PNG by ``plots``) and the raw figures
(``data``). All of it is plain data, so a run's JSON is enough to rebuild the report.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TextIO

from tqdm import tqdm

__all__ = [
    "NOT_MEASURED_AT_QUICK_SIZE",
    "SIZES",
    "Config",
    "Panel",
    "Plot",
    "Progress",
    "Result",
    "RunProgress",
    "Section",
    "Series",
    "Size",
    "Table",
    "Target",
    "finite_or_none",
    "format_ratio",
    "format_seconds",
]

Size = Literal["quick", "default", "large"]
SIZES: tuple[Size, ...] = ("quick", "default", "large")
NOT_MEASURED_AT_QUICK_SIZE = "not measured at quick size"


@dataclass(frozen=True)
class Config:
    """How big and how carefully to measure.

    Attributes:
        size: ``"quick"`` (a smoke run of every section), ``"default"`` or ``"large"``.
        pairs: Timed rounds after warm-up; each round times every variant once, in turn.
        sample_seconds: Each timed sample repeats the measured call until it lasts this long.
        warmup_seconds: Untimed calls of each variant before calibration.
        threads: ``torch.set_num_threads`` for the whole run.
        seed: Seed of every model and data generator.
    """

    size: Size = "default"
    pairs: int = 15
    sample_seconds: float = 0.05
    warmup_seconds: float = 0.1
    threads: int = 1
    seed: int = 0

    def pick(self, quick: Any, default: Any, large: Any | None = None) -> Any:
        """The value for this run's size (``large`` falls back to ``default``)."""
        if self.size == "quick":
            return quick
        if self.size == "large" and large is not None:
            return large
        return default


class _EstimatedBar(tqdm):
    """A bar counted in estimated seconds: before any progress, the time left is the estimate itself."""

    @property
    def format_dict(self) -> dict[str, Any]:
        values = dict(super().format_dict)
        if not values.get("n"):
            values["rate"] = 1.0  # estimated seconds per second: remaining = the whole estimate
        return values


class RunProgress:
    """One progress bar for a whole run, across its sections, with the time left.

    The bar counts estimated seconds: each section's share is its ``Section.estimate`` for the
    run's size, split evenly over the units of work the section reports. The time left scales
    the estimate still ahead by how long the estimate behind took, so a slower or faster machine
    corrects it as the run goes.
    """

    def __init__(self, sections: list[Section], size: Size, enabled: bool = True, file: TextIO | None = None) -> None:
        self._shares = {section.name: section.expected_seconds(size) for section in sections}
        self._finished = 0
        self._done = 0.0  # estimated seconds of the sections finished
        self._current = 0.0  # the share of the section running
        self._bar = _EstimatedBar(
            total=sum(self._shares.values()),
            disable=not enabled,
            file=file,
            smoothing=0,  # the average over the run so far: units of work vary too much for a moving rate
            dynamic_ncols=True,
            bar_format="{desc} {percentage:3.0f}%|{bar}| {elapsed} elapsed, about {remaining} left (estimate){postfix}",
        )

    def section(self, name: str) -> Progress:
        """The progress handle of section ``name``, which runs now."""
        self._current = self._shares[name]
        self._bar.set_description_str(f"{self._finished + 1}/{len(self._shares)} {name}", refresh=False)
        self._bar.set_postfix_str("", refresh=True)
        return Progress(self._bar, self._done, self._current)

    def end_section(self) -> None:
        """Mark the running section done, however much of its work it reported."""
        self._finished += 1
        self._done += self._current
        self._bar.update(self._done - self._bar.n)

    def write(self, text: str, file: TextIO | None = None) -> None:
        """Print ``text`` above the bar (plainly when the bar is hidden); to ``sys.stdout`` as it is now by default."""
        file = file or sys.stdout  # not bound at import: a redirected stdout receives the sections too
        self._bar.write(text, file=file)
        file.flush()

    @property
    def position(self) -> float:
        """Estimated seconds of work done so far."""
        return float(self._bar.n)

    def close(self) -> None:
        self._bar.close()


class Progress:
    """A section's part of the run's progress bar: ``start(total)``, then ``advance()`` per unit of work.

    Built without a bar (``Progress()``), it shows nothing: for running a section on its own.
    """

    def __init__(self, bar: tqdm | None = None, offset: float = 0.0, share: float = 1.0) -> None:
        self._bar, self._offset, self._share = bar, offset, share
        self._total, self._units = 1, 0

    def start(self, total: int) -> None:
        """Set how many units of work the section will report."""
        self._total, self._units = max(1, total), 0

    def advance(self, what: str = "") -> None:
        """Mark one unit done; ``what`` names the next (shown beside the bar)."""
        self._units = min(self._units + 1, self._total)
        if self._bar is not None:
            if what:
                self._bar.set_postfix_str(what, refresh=False)
            self._bar.update(self._offset + self._share * self._units / self._total - self._bar.n)

    def describe(self, what: str) -> None:
        """Show what is running now."""
        if self._bar is not None:
            self._bar.set_postfix_str(what)


@dataclass
class Table:
    """A display table: cells are already formatted; the raw numbers are in ``Result.data``."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    note: str = ""


@dataclass
class Target:
    """A number the project holds itself to, with the value this run measured.

    Build one with ``at_most`` or ``at_least``, or directly with ``passed`` decided by the
    caller. ``measured`` is ``None`` when the quantity was never reached (the target is missed).
    ``unjudged`` says why this run does not judge the target (then ``passed`` is ``False`` and
    the report shows that reason instead of a verdict); see ``full_size_only``. ``source`` says
    what kind of figure it is: ``"target"`` (a bar the project holds itself to), ``"README claim"``
    (a number the README states) or ``"informational"`` (shown against a bar, not held to it).
    """

    name: str
    requirement: str
    measured: float | None
    unit: str
    passed: bool
    detail: str = ""
    limit: float | None = None
    source: str = "target"
    unjudged: str = ""

    @classmethod
    def at_most(
        cls,
        name: str,
        measured: float | None,
        limit: float,
        unit: str,
        detail: str = "",
        *,
        strict: bool = False,
        source: str = "target",
    ) -> Target:
        """``measured <= limit`` (``<`` when ``strict``)."""
        ok = measured is not None and math.isfinite(measured) and (measured < limit if strict else measured <= limit)
        requirement = f"{'<' if strict else '≤'} {limit:g} {unit}".rstrip()
        return cls(name, requirement, measured, unit, ok, detail, limit, source)

    @classmethod
    def at_least(
        cls, name: str, measured: float | None, limit: float, unit: str, detail: str = "", *, source: str = "target"
    ) -> Target:
        """``measured >= limit``."""
        ok = measured is not None and math.isfinite(measured) and measured >= limit
        return cls(name, f"≥ {limit:g} {unit}".rstrip(), measured, unit, ok, detail, limit, source)

    def full_size_only(self, config: Config) -> Target:
        """This target, or in a quick run the same figure left unjudged ("not measured at quick size").

        For targets a smoke-sized run cannot measure: ratios tighter than its few short samples
        resolve, or quantities defined at the full model size (training to an accuracy).
        """
        if config.size != "quick":
            return self
        return dataclasses.replace(self, passed=False, unjudged=NOT_MEASURED_AT_QUICK_SIZE)

    @property
    def shown(self) -> str:
        """The measured value as the report prints it."""
        if self.measured is None or not math.isfinite(self.measured):
            return "never reached"
        return f"{self.measured:.3g} {self.unit}".rstrip()


@dataclass
class Series:
    """One line of a panel."""

    label: str
    x: list[float]
    y: list[float | None]
    style: str = "-"


@dataclass
class Panel:
    """One set of axes."""

    title: str
    xlabel: str
    ylabel: str
    series: list[Series]
    logx: bool = False
    logy: bool = False
    ylim: tuple[float, float] | None = None  # a zoomed y range (default: fit the data)


@dataclass
class Plot:
    """A figure of one or more panels, saved as ``<section>-<name>.png``.

    ``caption`` is printed under it in the report: it explains every term of the legends and
    says whether a time axis is measured or estimated.
    """

    name: str
    title: str
    panels: list[Panel]
    columns: int = 2
    headline: bool = False
    caption: str = ""


@dataclass
class Result:
    """Everything one section measured."""

    tables: list[Table] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    plots: list[Plot] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for target, raw in zip(self.targets, out["targets"], strict=True):
            raw["shown"] = target.shown
        return finite_or_none(out)


@dataclass(frozen=True)
class Section:
    """A benchmark section: ``run`` measures and returns a ``Result``.

    Attributes:
        name: Short name used by ``--sections`` and in file names.
        title: Heading in the report.
        summary: What it measures and how, in a paragraph of Markdown.
        run: The measurement.
        estimate: Seconds it takes at size quick and default on two cores (large: twice default);
            only the progress bar's estimate of the time left reads it.
        heading_at: The title and summary of a run at a configuration, for a section whose workload
            depends on the size (``title`` and ``summary`` are then the default size's, for ``--list``).
    """

    name: str
    title: str
    summary: str
    run: Callable[[Config, Progress], Result]
    estimate: tuple[float, float] = (5.0, 60.0)
    heading_at: Callable[[Config], tuple[str, str]] | None = None

    def heading(self, config: Config) -> tuple[str, str]:
        """The title and summary of this section in a run at ``config``: what that run measured."""
        return self.heading_at(config) if self.heading_at else (self.title, self.summary)

    def expected_seconds(self, size: Size) -> float:
        """How long the section is expected to take at ``size`` (for the progress bar's estimate)."""
        quick, default = self.estimate
        return {"quick": quick, "default": default, "large": 2 * default}[size]


def finite_or_none(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by ``None`` (JSON has no such numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def format_ratio(median: float, low: float, high: float) -> str:
    """``1.013× (0.998–1.030)``: the median ratio with the range over pairs."""
    return f"{median:.3f}× ({low:.3f}–{high:.3f})"


def format_seconds(seconds: float) -> str:
    """A duration with a unit that keeps three significant digits."""
    magnitude = abs(seconds)
    if float(f"{magnitude:.3g}") >= 1:  # as rounded, so 0.9996 s reads 1 s, not 1e+03 ms
        return f"{seconds:.3g} s"
    if float(f"{magnitude * 1e3:.3g}") >= 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"
