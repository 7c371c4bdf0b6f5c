"""A scenario's plots: speedup and warm time along the sweep's main axis, and image previews.

The main axis is the detector size when it varies, else the first extra axis that does (a rotation
series plots along `phi`). One line per (dtype, device, compile); where several points share an x value
(other axes varying), the line is their median with a min-max band, so a sweep of thousands of points
still draws a handful of lines. Error bars span each value's range over the timed repeats (`speedup_min` to
`speedup_max`, `warm_min_s` to `warm_max_s`; of all the points at that x), as the tables give it: a trend
inside the bars is the machine's load, not nbsim.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from .collate import reference_label
from .report import varying_axes
from .store import open_store_array

SERIES_AXES = ("dtype", "device", "compile")
RANGE_KEYS = {"speedup": ("speedup_min", "speedup_max"), "warm_median_s": ("warm_min_s", "warm_max_s")}
"""The columns that hold a plotted value's range over the repeats."""
MAX_PREVIEW_COLUMNS = 4
MAX_PREVIEW_ROWS = 4
PREVIEW_PIXELS = 256


def main_axis(rows: list[dict[str, Any]], axes: list[str]) -> str:
    """The axis a scenario's plots run along: the first that varies besides the series, else size."""
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
    """A scenario's speedup and time plots and its grid of image previews, as PNG files."""
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
        series = list(_series(ok, x_axis, key))
        for label, xs, median, low, high, repeats in series:
            line = axis.plot(xs, median, marker="o" if len(xs) <= 50 else None, label=label)
            if any(lo != hi for lo, hi in zip(low, high, strict=True)):
                axis.fill_between(xs, low, high, alpha=0.25, color=line[0].get_color())
            if len(xs) <= 50 and repeats is not None:
                repeats_low, repeats_high = repeats
                axis.errorbar(xs, median, yerr=[np.subtract(median, repeats_low), np.subtract(repeats_high, median)],
                              fmt="none", capsize=3, color=line[0].get_color())
        if log:
            axis.set_yscale("log")
            if x_axis == "size":
                axis.set_xscale("log")
        axis.set_xlabel("detector size (pixels per side)" if x_axis == "size" else x_axis)
        axis.set_ylabel(ylabel)
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
        if series:
            axis.legend(fontsize=7)
        else:  # a dataset: nothing timed or compared
            axis.text(0.5, 0.5, "nothing measured: no timing or reference in this sweep", ha="center",
                      va="center", transform=axis.transAxes)
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        plt.close(figure)
    _previews(ok, stores, axes, previews_png, plt)


def _series(rows: list[dict], x_axis: str, key: str):
    """(label, x values, median, min, max, and the lowest and highest of the points' ranges over the repeats per
    x value: None for the whole series where any of its points has none) per (dtype, device, compile)."""
    groups: dict[tuple, dict[Any, list[dict]]] = {}
    for row in rows:
        if isinstance(row.get(key), (int, float)):
            groups.setdefault(tuple(row[a] for a in SERIES_AXES), {}).setdefault(row[x_axis], []).append(row)
    low_key, high_key = RANGE_KEYS.get(key, (None, None))

    def bound(points: list[dict], range_key: str | None, pick) -> float:
        values = [point.get(range_key) for point in points]
        return float(pick(values)) if all(isinstance(v, (int, float)) for v in values) else math.nan

    for series, by_x in sorted(groups.items(), key=lambda item: str(item[0])):
        xs = sorted(by_x, key=lambda v: (isinstance(v, str), v))
        shared = max(len(v) for v in by_x.values())
        label = ", ".join(f"{a}={v}" for a, v in zip(SERIES_AXES, series, strict=True))
        if shared > 1:
            label += f" (median of up to {shared} points, band min-max)"
        values = {x: [point[key] for point in by_x[x]] for x in xs}
        repeats_low = [bound(by_x[x], low_key, min) for x in xs]
        repeats_high = [bound(by_x[x], high_key, max) for x in xs]
        repeats = None if any(math.isnan(v) for v in repeats_low + repeats_high) else (repeats_low, repeats_high)
        if repeats is not None:
            label += " (bars: the range over the repeats)"
        yield (label, xs, [float(np.median(values[x])) for x in xs], [min(values[x]) for x in xs],
               [max(values[x]) for x in xs], repeats)


def preview_grid(rows: list[dict[str, Any]], axes: list[str]) -> tuple[str, list[Any], list[tuple], list[str]]:
    """How previews are laid out: columns along the first axis that varies (the detector size when it
    does), rows along the combinations of the other varying axes, each cut to at most MAX_PREVIEW_COLUMNS
    and MAX_PREVIEW_ROWS values spread evenly over the sweep. Returns the column axis, its values, the row
    combinations and the row axes."""
    varying = varying_axes(rows, axes)
    column_axis, row_axes = varying[0], varying[1:]
    columns = _sorted_unique(row[column_axis] for row in rows)
    combinations = _sorted_unique(tuple(row[a] for a in row_axes) for row in rows)
    return column_axis, _spread(columns, MAX_PREVIEW_COLUMNS), _spread(combinations, MAX_PREVIEW_ROWS), row_axes


def _sorted_unique(values) -> list:
    return sorted(set(values), key=lambda v: tuple((isinstance(x, str), x) for x in (v if isinstance(v, tuple)
                                                                                      else (v,))))


def _spread(values: list, most: int) -> list:
    if len(values) <= most:
        return values
    return [values[round(i)] for i in np.linspace(0, len(values) - 1, most)]


def _short(axis: str, value: Any) -> str:
    """An axis value as a title names it: the size as 256², dtype/device/compile bare, others as name=value."""
    if axis == "size":
        return f"{value}²"
    if axis in SERIES_AXES:
        return f"compile {value}" if axis == "compile" else str(value)
    return f"{axis}={value}"


def _previews(rows: list[dict], stores: dict[str, Path], axes: list[str], path: Path, plt) -> None:
    """A grid of images along the sweep's axes (`preview_grid`), each titled with the values of the axes
    that vary: block maxima (spots survive), log colour scale from the median to the 99.9th percentile of
    the positive pixels (background pale, spots dark), axes in pixels, a colour bar each."""
    from matplotlib.colors import LogNorm

    column_axis, columns, combinations, row_axes = preview_grid(rows, axes) if rows else ("size", [], [], [])
    by_key = {}
    for row in rows:
        by_key.setdefault((row[column_axis], tuple(row[a] for a in row_axes)), row)
    width, height = max(1, len(columns)), max(1, len(combinations))
    figure, grid = plt.subplots(height, width, figsize=(3.2 * width + 0.4, 3.1 * height), squeeze=False)
    for axis in grid.ravel():
        axis.axis("off")
    for r, combination in enumerate(combinations):
        for c, value in enumerate(columns):
            row, axis = by_key.get((value, combination)), grid[r, c]
            if row is None:
                continue
            image = np.asarray(open_store_array(stores[row["batch"]], "image")[row["index"]], dtype=np.float64)
            if image.ndim == 3:  # a multi-panel detector's panels, side by side
                image = np.concatenate(list(image), axis=1)
            size_s, size_f = image.shape
            reduced = block_max(image)
            positive = reduced[reduced > 0]
            low, high = (np.percentile(positive, [50, 99.9]) if positive.size else (1.0, 10.0))
            shown = axis.imshow(np.clip(reduced, low, None), cmap="gray_r", interpolation="nearest",
                                norm=LogNorm(vmin=low, vmax=max(high, low * 1.01)), extent=(0, size_f, size_s, 0))
            axis.axis("on")
            axis.tick_params(labelsize=6)
            axis.set_xlabel("fast (pixels)", fontsize=6)
            axis.set_ylabel("slow (pixels)", fontsize=6)
            figure.colorbar(shown, ax=axis, fraction=0.046, pad=0.02).ax.tick_params(labelsize=6)
            title = " · ".join(_short(a, row[a]) for a in (column_axis, *row_axes))
            if reduced.shape != image.shape:
                title += f" (block max ÷{math.ceil(image.shape[0] / reduced.shape[0])})"
            axis.set_title(title, fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def plot_fit_errors(rows: list[dict[str, Any]], path: Path) -> None:
    """refined − true of every fitted shot, one panel per parameter, each titled with the median |start − true|
    it started from: a benchmark of refinement at a glance (rows: nbsim.sweep.fitting.fit_rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fitted = [row for row in rows if row["status"] == "ok"]
    parameters = list(dict.fromkeys(row["parameter"] for row in fitted)) or ["(no fitted shot)"]
    columns = min(4, len(parameters))
    lines = math.ceil(len(parameters) / columns)
    figure, axes = plt.subplots(lines, columns, figsize=(3.2 * columns, 2.6 * lines), squeeze=False)
    shots = list(dict.fromkeys(row["point"] for row in fitted))
    for axis, parameter in zip(axes.flat, parameters, strict=False):
        members = [row for row in fitted if row["parameter"] == parameter]
        where = [shots.index(row["point"]) for row in members]
        converged = [bool(row["converged"]) for row in members]
        axis.scatter(where, [row["error"] for row in members], s=14,
                     c=["tab:blue" if ok else "tab:red" for ok in converged])
        axis.axhline(0.0, color="0.3", linewidth=0.8)
        unit = members[0]["unit"] if members else ""
        started = float(np.median([abs(row["start_error"]) for row in members])) if members else math.nan
        axis.set_title(f"{parameter} ({unit})\nmedian |start − true| {started:.3g}", fontsize=8)
        axis.set_xlabel("shot", fontsize=8)
        axis.tick_params(labelsize=7)
        axis.grid(True, alpha=0.3)
    for axis in list(axes.flat)[len(parameters):]:
        axis.set_visible(False)
    figure.suptitle("refined − true per shot (red: the fit did not converge)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
