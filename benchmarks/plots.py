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


def render_to(plot: Plot, path: Path) -> str:
    """Draw ``plot`` into ``path`` (PNG); returns the file name."""
    columns = min(plot.columns, len(plot.panels))
    rows = math.ceil(len(plot.panels) / columns)
    width = max(5.2 * columns, 7.5)
    figure, axes = plt.subplots(rows, columns, figsize=(width, 3.8 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, plot.panels, strict=False):
        for series in panel.series:
            y = [math.nan if v is None else v for v in series.y]
            ax.plot(series.x, y, series.style, label=series.label, linewidth=1.4, markersize=4)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        if panel.logx:
            ax.set_xscale("log")
        if panel.logy:
            ax.set_yscale("log")
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
