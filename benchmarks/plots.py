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


PALETTE = (
    *("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray"),
    *("tab:olive", "tab:cyan", "navy", "darkgoldenrod", "lime", "teal"),
)


def colours(plot: Plot) -> dict[str, str]:
    """One colour per series label across every panel of ``plot``: the colour a label's first series
    asks for (its style) unless an earlier label has it, else the next free one of the palette. So a
    colour means the same thing in every panel, and two labels never share one."""
    taken: dict[str, str] = {}
    for panel in plot.panels:
        for series in panel.series:
            if series.label in taken:
                continue
            used = set(taken.values())
            asked = next((c for c in series.style if c in COLORS), None)
            if asked is None or asked in used:
                asked = next((c for c in PALETTE if c not in used), "k")
            taken[series.label] = asked
    return taken


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
    by_label = colours(plot)
    for ax, panel in zip(axes.flat, plot.panels, strict=False):
        count = len(panel.series)
        for index, series in enumerate(panel.series):
            y = [math.nan if v is None else v for v in series.y]
            look = {**_look(series.style, index, count, len(series.x)), "color": by_label[series.label]}
            ax.plot(series.x, y, label=series.label, **look)
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
