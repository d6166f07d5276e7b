"""Render a ``Plot`` (from a run, or from its JSON) to a PNG."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display needed, and no GUI backend picked at import

import matplotlib.pyplot as plt

from .core import Panel, Plot, Series

__all__ = ["file_name", "plot_from_json", "render_to"]


def file_name(section: str, plot: Plot) -> str:
    """The PNG name of a section's plot."""
    return f"{section}-{plot.name}.png"


def plot_from_json(raw: dict[str, Any]) -> Plot:
    """A ``Plot`` back from its JSON form."""
    panels = [Panel(**{**panel, "series": [Series(**series) for series in panel["series"]]}) for panel in raw["panels"]]
    return Plot(**{**raw, "panels": panels})


MARKERS = "osD^vP<>X*"
LINESTYLES = ("--", "-.", ":", "-")  # two-character styles first, so "--" is not read as "-"
COLORS = "bgrcmykw"


def _look(style: str, index: int, count: int, points: int) -> dict[str, Any]:
    """Line and marker keywords for the ``index``-th of ``count`` series in a panel.

    Lines that coincide would hide each other, so every series gets its own hollow marker, the
    earlier ones larger (coinciding points nest), and on a long series the markers of different
    series fall on different points. ``style``'s line style and colour are kept; its marker is
    replaced.
    """
    look: dict[str, Any] = {"linewidth": 1.4, "linestyle": "-"}
    for linestyle in LINESTYLES:
        if linestyle in style:
            look["linestyle"] = linestyle
            break
    color = next((c for c in style if c in COLORS), None)
    if color is not None:
        look["color"] = color
    every = max(1, points // 10)
    look.update(
        marker=MARKERS[index % len(MARKERS)],
        markersize=4 + 5 * (count - 1 - index) / max(1, count - 1),
        fillstyle="none",
        markeredgewidth=1.1,
        markevery=(index % every, every),
    )
    return look


def render_to(plot: Plot, path: Path) -> str:
    """Draw ``plot`` into ``path`` (PNG); returns the file name."""
    columns = min(plot.columns, len(plot.panels))
    rows = math.ceil(len(plot.panels) / columns)
    width = max(5.2 * columns, 7.5)
    figure, axes = plt.subplots(rows, columns, figsize=(width, 3.8 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, plot.panels, strict=False):
        count = len(panel.series)
        for index, series in enumerate(panel.series):
            y = [math.nan if v is None else v for v in series.y]
            ax.plot(series.x, y, label=series.label, **_look(series.style, index, count, len(series.x)))
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        if panel.logx:
            ax.set_xscale("log")
        if panel.logy:
            ax.set_yscale("log")
        if panel.ylim is not None:
            ax.set_ylim(*panel.ylim)
        ax.grid(True, alpha=0.3)
        if panel.series:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(plot.panels) :]:
        ax.set_visible(False)
    figure.suptitle(textwrap.fill(plot.title, width=int(width * 11)), fontsize=11)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path.name
