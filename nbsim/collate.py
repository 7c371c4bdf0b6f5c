"""Collate a scenario's points: timing and correlation tables, one xarray-readable store, plots."""

from __future__ import annotations

import csv
import json
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from .sweep import read_store, write_dataset

TIMING_COLUMNS = ("cold_s", "warm_median_s", "warm_min_s", "warm_max_s", "reference_median_s", "speedup",
                  "peak_rss_mb", "threads", "compile_cache", "host", "slurm_job_id")
CORRELATION_COLUMNS = ("correlation", "max_abs_error", "max_rel_error", "sum_ratio", "finite")


def _load(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def point_rows(timings: list[Path], comparisons: list[Path], references: dict[str, Path]) -> list[dict[str, Any]]:
    """One row per point: its axes, status, timings and comparison against its reference.

    `references` maps a point's reference name to the reference timing JSON.
    """
    rows = []
    for timing_path, comparison_path in zip(timings, comparisons, strict=True):
        record = _load(timing_path)
        comparison = _load(comparison_path)
        timing = record.get("timing") or {}
        row: dict[str, Any] = {"scenario": record["scenario"], "point": record["point"],
                               "size": int(record["args"][record["args"].index("-detpixels") + 1]),
                               "dtype": record["dtype"], "device": record["device"],
                               "compile": "on" if record["compile"] else "off", **record.get("extras", {}),
                               "status": record.get("status", "ok")}
        reference = _load(references[record["point"]])
        reference_time = (reference.get("timing") or {}).get("warm_median_s")
        row.update({key: timing.get(key) for key in TIMING_COLUMNS if key in timing})
        row["reference"] = reference.get("kind")
        row["reference_median_s"] = reference_time
        if timing.get("warm_median_s") and reference_time:
            row["speedup"] = reference_time / timing["warm_median_s"]
        if row["status"] != "ok":
            row["reason"] = record.get("reason")
        row.update({key: comparison.get(key) for key in CORRELATION_COLUMNS if key in comparison})
        rows.append(row)
    return rows


def _format(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def write_tables(rows: list[dict[str, Any]], axes: list[str], csv_path: Path, md_path: Path,
                 columns: tuple[str, ...]) -> None:
    """The same table as CSV and as a Markdown table."""
    header = ["point", *axes, "status", *[c for c in columns if any(c in r for r in rows)]]
    with open(csv_path, "w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(header)
        for row in rows:
            writer.writerow([_format(row.get(c)) for c in header])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_format(row.get(c)) for c in header) + " |" for row in rows]
    Path(md_path).write_text("\n".join(lines) + "\n")


def write_collated_store(rows: list[dict[str, Any]], stores: list[Path], axes: list[str], output: Path) -> None:
    """One zarr store: every metric and every image as a variable with a coordinate for every axis."""
    import xarray as xr

    coords = {axis: sorted({row[axis] for row in rows}, key=_sort_key) for axis in axes}
    shape = tuple(len(coords[a]) for a in axes)
    index = {row["point"]: tuple(coords[a].index(row[a]) for a in axes) for row in rows}
    variables: dict[str, Any] = {}
    for name in (*TIMING_COLUMNS, *CORRELATION_COLUMNS):
        if any(isinstance(row.get(name), (int, float)) and not isinstance(row.get(name), bool) for row in rows):
            data = np.full(shape, np.nan)
            for row in rows:
                if isinstance(row.get(name), (int, float)):
                    data[index[row["point"]]] = float(row[name])
            variables[name] = (axes, data)
    for name in ("status", "reference"):
        data = np.full(shape, "", dtype=object)
        for row in rows:
            data[index[row["point"]]] = str(row.get(name) or "")
        variables[name] = (axes, data.astype(str))
    attributes = np.full(shape, "", dtype=object)
    images: dict[int, np.ndarray] = {}
    for row, store in zip(rows, stores, strict=True):
        dataset = read_store(store)
        attributes[index[row["point"]]] = json.dumps(dict(dataset.attrs), default=str)
        if row["status"] != "ok":
            continue
        size = row["size"]
        image_axes = tuple(len(coords[a]) for a in axes if a != "size")
        block = images.setdefault(size, np.full((*image_axes, size, size), np.nan, dtype=np.float32))
        block[tuple(i for a, i in zip(axes, index[row["point"]], strict=True) if a != "size")] = \
            dataset["image"].values.astype(np.float32)
    variables["attributes"] = (axes, attributes.astype(str))
    other_axes = [a for a in axes if a != "size"]
    for size, block in images.items():
        variables[f"image_n{size}"] = ((*other_axes, f"slow_n{size}", f"fast_n{size}"), block)
    dataset = xr.Dataset(variables, coords=coords,
                         attrs={"description": "nbsim sweep: one entry per point; images per detector size",
                                "axes": json.dumps(axes)})
    write_dataset(output, dataset)


def _sort_key(value: Any):
    return (0, value) if isinstance(value, (int, float)) else (1, str(value))


def plot_scenario(rows: list[dict[str, Any]], stores: list[Path], axes: list[str], speedup_png: Path,
                  time_png: Path, previews_png: Path) -> None:
    """Speedup vs size, warm time vs pixels (log-log) and image previews for one scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series_axes = [a for a in axes if a != "size"]
    series: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["status"] == "ok":
            series.setdefault(tuple(row[a] for a in series_axes), []).append(row)
    for path, y_key, x_key, title, log in (
            (speedup_png, "speedup", "size", "speedup over the reference vs detector size", False),
            (time_png, "warm_median_s", "pixels", "warm time vs pixels", True)):
        figure, axis = plt.subplots(figsize=(6.4, 4.2))
        for key, members in sorted(series.items(), key=lambda item: str(item[0])):
            members = sorted(members, key=lambda r: r["size"])
            xs = [r["size"] if x_key == "size" else r["size"] ** 2 for r in members]
            ys = [r.get(y_key) for r in members]
            if any(y is not None for y in ys):
                axis.plot(xs, [np.nan if y is None else y for y in ys], marker="o",
                          label=", ".join(f"{a}={v}" for a, v in zip(series_axes, key, strict=True)))
        if log:
            axis.set_xscale("log")
            axis.set_yscale("log")
            axis.set_ylabel("warm median time (s)")
            axis.set_xlabel("pixels")
        else:
            axis.set_xlabel("detector size (pixels per side)")
            axis.set_ylabel("reference time / nbsim warm time")
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
        if series:
            axis.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        plt.close(figure)
    ok = [(row, store) for row, store in zip(rows, stores, strict=True) if row["status"] == "ok"]
    columns = max(1, min(4, len(ok)))
    figure_rows = max(1, math.ceil(len(ok) / columns))
    figure, grid = plt.subplots(figure_rows, columns, figsize=(3 * columns, 3 * figure_rows), squeeze=False)
    for axis in grid.ravel():
        axis.axis("off")
    for axis, (row, store) in zip(grid.ravel(), ok, strict=False):
        image = read_store(store)["image"].values.astype(np.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            axis.imshow(np.log10(np.maximum(image, image[image > 0].min() if (image > 0).any() else 1.0)),
                        cmap="gray_r")
        axis.set_title(row["point"], fontsize=6)
    figure.tight_layout()
    figure.savefig(previews_png, dpi=80)
    plt.close(figure)
