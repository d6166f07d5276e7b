"""``plot``: a ``Monitor``'s JSON-lines log drawn as per-layer heatmaps over steps (``python -m inputaware_optim
plot``; needs matplotlib)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["PLOTTED", "plot"]


PLOTTED = (
    ("modules", "input_rms", "input RMS", True),
    ("modules", "input_zero_fraction", "fraction of exact zeros in the input", False),
    ("parameters", "update_to_weight", "update norm / weight norm", True),
)


def plot(log: str | Path, out: str | Path) -> Path:
    """Draw a ``Monitor`` JSON-lines log as per-layer heatmaps over steps (input RMS, zero fraction,
    update-to-weight ratio) into a PNG; returns its path. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in Path(log).read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{log} holds no record; write one with Monitor(..., jsonl={str(log)!r})")
    figure = _figure(records, Path(log).name)
    out = Path(out)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def _figure(records: list[dict[str, Any]], source: str) -> Any:
    """One heatmap per statistic: a row per layer (named by qualified name and kind), a column per record."""
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    layers = {name: kind for r in records for name, kind in r.get("layers", {}).items()}
    rows = [
        list(dict.fromkeys(n for r in records for n, s in r[table].items() if statistic in s))
        for table, statistic, _, _ in PLOTTED
    ]
    heights = [max(1, len(names)) for names in rows]
    size = (11, 2.5 + 0.9 * len(PLOTTED) + 0.22 * sum(heights))
    figure, axes = plt.subplots(len(PLOTTED), 1, figsize=size, squeeze=False, gridspec_kw={"height_ratios": heights})
    figure.suptitle(f"Monitor: {source}, steps {steps[0]} to {steps[-1]} ({len(records)} logged)")
    for axis, panel, names in zip(axes[:, 0], PLOTTED, rows, strict=True):
        _panel(figure, axis, panel, names, records, layers)
    figure.tight_layout()
    return figure


def _panel(figure: Any, axis: Any, panel: Any, names: list[str], records: list[dict[str, Any]], layers: Any) -> None:
    """One statistic's heatmap and colour bar: exact zeros black on a logarithmic one, values not logged grey."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm, Normalize

    table, statistic, title, logarithmic = panel
    # A value not logged (None) or not finite is NaN; a panel with no layer keeps one (empty) row.
    grid = np.array([[r[table].get(n, {}).get(statistic) for r in records] for n in names or [""]], dtype=float)
    grid[~np.isfinite(grid)] = np.nan
    zeros = logarithmic and bool((grid == 0).any())
    norm: Any = Normalize(0.0, 1.0) if statistic.endswith("fraction") else None
    shown = grid
    if logarithmic:
        positive = grid[np.isfinite(grid) & (grid > 0)]
        low, high = (positive.min(), positive.max()) if positive.size else (1e-3, 1.0)
        norm = LogNorm(low, high if high > low else low * 10)
        shown = np.where(grid == 0, low / 10, grid)
    image = axis.imshow(
        np.ma.masked_invalid(shown),
        aspect="auto",
        interpolation="nearest",
        norm=norm,
        cmap=plt.get_cmap("viridis").with_extremes(bad="#d9d9d9", under="black"),
        extent=(records[0]["step"] - 0.5, records[-1]["step"] + 0.5, len(names) - 0.5, -0.5),
    )
    kinds = [layers.get(n.rpartition(".")[0] if table == "parameters" else n) for n in names]
    labels = [f"{n} ({k})" if k else n for n, k in zip(names, kinds, strict=True)]
    axis.set_yticks(range(len(names)), labels, fontsize=7)
    axis.set_title(title)
    axis.set_xlabel("step")
    bar = figure.colorbar(image, ax=axis, extend="min" if zeros else "neither")
    notes = (["black: exactly 0"] if zeros else []) + (["grey: not logged"] if np.isnan(grid).any() else [])
    bar.set_label(title + (f"\n({'; '.join(notes)})" if notes else ""), fontsize=7)
