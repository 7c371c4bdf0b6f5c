"""A scenario's plots: speedup and warm time along the sweep's main axis, and image previews.

The main axis is the detector size when it varies, else the first extra axis that does (a rotation
series plots along `phi`). One line per (dtype, device, compile); where several points share an x value
(other axes varying), the line is their median with a min-max band, so a sweep of thousands of points
still draws a handful of lines.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from .collate import reference_label
from .store import open_store_array

SERIES_AXES = ("dtype", "device", "compile")
MAX_PREVIEWS = 12
PREVIEW_PIXELS = 256


def main_axis(rows: list[dict[str, Any]], axes: list[str]) -> str:
    varying = [a for a in axes if a not in SERIES_AXES and len({r[a] for r in rows}) > 1]
    return varying[0] if varying else "size"


def block_max(image: np.ndarray, pixels: int = PREVIEW_PIXELS) -> np.ndarray:
    """The image reduced to at most `pixels` per side by the maximum of each block, so that isolated
    Bragg spots survive the reduction."""
    block = max(1, math.ceil(max(image.shape) / pixels))
    if block == 1:
        return image
    slow, fast = (math.ceil(n / block) * block for n in image.shape)
    padded = np.full((slow, fast), -np.inf)
    padded[:image.shape[0], :image.shape[1]] = image
    return padded.reshape(slow // block, block, fast // block, block).max(axis=(1, 3))


def plot_scenario(rows: list[dict[str, Any]], stores: dict[str, Path], axes: list[str], speedup_png: Path,
                  time_png: Path, previews_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [row for row in rows if row["status"] == "ok"]
    x_axis = main_axis(rows, axes)
    reference = reference_label(ok)
    for path, key, title, ylabel, log in (
            (speedup_png, "speedup", f"speedup over {reference}", f"{reference} time / nbsim warm time", False),
            (time_png, "warm_median_s", "warm render time", "warm median time (s)", True)):
        figure, axis = plt.subplots(figsize=(6.4, 4.2))
        for label, xs, median, low, high in _series(ok, x_axis, key):
            line = axis.plot(xs, median, marker="o" if len(xs) <= 50 else None, label=label)
            if any(lo != hi for lo, hi in zip(low, high, strict=True)):
                axis.fill_between(xs, low, high, alpha=0.25, color=line[0].get_color())
        if log:
            axis.set_yscale("log")
            if x_axis == "size":
                axis.set_xscale("log")
        axis.set_xlabel("detector size (pixels per side)" if x_axis == "size" else x_axis)
        axis.set_ylabel(ylabel)
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
        if ok:
            axis.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        plt.close(figure)
    _previews(ok, stores, axes, previews_png, plt)


def _series(rows: list[dict], x_axis: str, key: str):
    """(label, x values, median, min, max) per (dtype, device, compile)."""
    groups: dict[tuple, dict[Any, list[float]]] = {}
    for row in rows:
        if isinstance(row.get(key), (int, float)):
            groups.setdefault(tuple(row[a] for a in SERIES_AXES), {}).setdefault(row[x_axis], []).append(row[key])
    for series, by_x in sorted(groups.items(), key=lambda item: str(item[0])):
        xs = sorted(by_x, key=lambda v: (isinstance(v, str), v))
        shared = max(len(v) for v in by_x.values())
        label = ", ".join(f"{a}={v}" for a, v in zip(SERIES_AXES, series, strict=True))
        if shared > 1:
            label += f" (median of up to {shared} points, band min-max)"
        yield (label, xs, [float(np.median(by_x[x])) for x in xs], [min(by_x[x]) for x in xs],
               [max(by_x[x]) for x in xs])


def _previews(rows: list[dict], stores: dict[str, Path], axes: list[str], path: Path, plt) -> None:
    """Up to MAX_PREVIEWS images spread evenly over the points: block maxima (spots survive), log colour
    scale from the median to the 99.9th percentile of the positive pixels (background pale, spots dark),
    a colour bar each, and the point's axis values as the title."""
    from matplotlib.colors import LogNorm

    chosen = [rows[round(i)] for i in np.linspace(0, len(rows) - 1, min(MAX_PREVIEWS, len(rows)))] if rows else []
    columns = max(1, min(4, len(chosen)))
    figure_rows = max(1, math.ceil(len(chosen) / columns))
    figure, grid = plt.subplots(figure_rows, columns, figsize=(3.6 * columns, 3.4 * figure_rows), squeeze=False)
    for axis in grid.ravel():
        axis.axis("off")
    for axis, row in zip(grid.ravel(), chosen, strict=False):
        image = np.asarray(open_store_array(stores[row["batch"]], "image")[row["index"]], dtype=np.float64)
        image = block_max(np.concatenate(list(image), axis=1) if image.ndim == 3 else image)  # panels side by side
        positive = image[image > 0]
        low, high = (np.percentile(positive, [50, 99.9]) if positive.size else (1.0, 10.0))
        shown = axis.imshow(np.clip(image, low, None), cmap="gray_r", interpolation="nearest",
                            norm=LogNorm(vmin=low, vmax=max(high, low * 1.01)))
        figure.colorbar(shown, ax=axis, fraction=0.046, pad=0.02).ax.tick_params(labelsize=6)
        title = ", ".join(f"{a}={row[a]}" for a in axes)
        reduced = "" if image.shape[0] == row["size"] else f" (block max {row['size']}->{image.shape[0]})"
        axis.set_title(title + reduced, fontsize=6, wrap=True)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
