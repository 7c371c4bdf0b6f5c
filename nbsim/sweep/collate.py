"""Collate a scenario's batches: timing and correlation tables and one xarray-readable store.

The collated store has one dimension per sweep axis (size, dtype, device, compile, then each extra axis
by name, `phi` for `-phi`), every metric as a variable over them, and the images of each detector size
as `image_n<size>` over the other axes plus `slow_n<size>`, `fast_n<size>`, one chunk per point: a
rotation series reads as one (phi, slow, fast) array after `.squeeze()`, and `.sel(...)` of one point
reads one chunk. It is built point by point, so memory holds one image at a time however large the sweep.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from .progress import Progress
from .store import DETECTOR_IMAGE, AtomicStore, open_store_array, read_json

TIMING_COLUMNS = ("batch", "cold_s", "warm_median_s", "warm_min_s", "warm_max_s", "reference", "reference_median_s",
                  "speedup", "peak_rss_mb", "threads", "compile_cache", "bytes_per_image", "host", "slurm_job_id")
REFERENCE_NAMES = {"nbsim-float64-cpu": "nbsim float64 on the CPU", "c": "the C nanoBragg"}
"""How tables and plots name each kind of reference: without a C binary the speedup is over nbsim's
own float64 image, not over nanoBragg."""


def reference_label(rows: list[dict[str, Any]]) -> str:
    kinds = sorted({str(row["reference"]) for row in rows if row.get("reference")})
    return " / ".join(REFERENCE_NAMES.get(kind, kind) for kind in kinds) or "the reference"
CORRELATION_COLUMNS = ("correlation", "max_abs_error", "max_rel_error", "sum_ratio", "finite")
_BATCH_IDENTITY = ("host", "cpu", "slurm_job_id", "versions", "process_startup_s", "batch")
LABEL_PREFIX = "label:"
"""Rows carry a point's labels (nbsim.sweep.labels) under this prefix, apart from its axes and metrics."""


def point_rows(batch_records: list[Path], reference_records: list[Path]) -> list[dict[str, Any]]:
    """One row per point, in batch order: its axes, status, timings, comparison with its reference, the
    reference's kind and time, and where its image is (`batch`, `index`)."""
    references: dict[str, tuple[str | None, float | None]] = {}
    for path in reference_records:
        record = read_json(path)
        for point in record["points"]:
            references[point["name"]] = (record.get("reference"), (point.get("timing") or {}).get("warm_median_s"))
    rows = []
    for path in batch_records:
        record = read_json(path)
        identity = {key: record.get(key) for key in _BATCH_IDENTITY}
        for point in record["points"]:
            timing = point.get("timing") or {}
            reference_kind, reference_s = references.get(point["reference"], (None, None))
            row: dict[str, Any] = {"scenario": record["scenario"], "point": point["name"], **point["axes"],
                                   "status": point["status"], "batch": record["batch"], "index": point["index"],
                                   "reference": reference_kind, "reference_median_s": reference_s}
            row.update({key: timing[key] for key in TIMING_COLUMNS if key in timing})
            row["bytes_per_image"] = record.get("bytes_per_image")
            row["detector"] = DETECTOR_IMAGE in point.get("images", ())
            row.update({LABEL_PREFIX + key: value for key, value in (point.get("labels") or {}).items()})
            if timing.get("warm_median_s") and reference_s:
                row["speedup"] = reference_s / timing["warm_median_s"]
            if point["status"] != "ok":
                row["reason"] = point.get("reason")
            row.update(point.get("comparison") or {})
            row["attributes"] = json.dumps({**identity, **{k: v for k, v in point.items()
                                                           if k not in ("axes", "labels")}}, default=str)
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
    labels = {"speedup": f"speedup over {reference_label(rows)}"}
    with open(md_path, "w") as stream:
        stream.write("| " + " | ".join(labels.get(c, c) for c in header) + " |\n|" + "---|" * len(header) + "\n")
        for row in rows:
            stream.write("| " + " | ".join(_format(row.get(c)) for c in header) + " |\n")


def label_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The label columns of the rows, in first-seen order (without their prefix)."""
    return [key[len(LABEL_PREFIX):] for key in dict.fromkeys(k for row in rows for k in row)
            if key.startswith(LABEL_PREFIX)]


def write_labels(rows: list[dict[str, Any]], csv_path: Path) -> None:
    """`tables/labels.csv`: one row per rendered point, its name, batch and index, and every label."""
    labels = label_columns(rows)
    with open(csv_path, "w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(["point", "batch", "index", *labels])
        for row in rows:
            if row["status"] == "ok":
                writer.writerow([row["point"], row["batch"], row["index"],
                                 *(_format_exact(row.get(LABEL_PREFIX + label)) for label in labels)])


def _format_exact(value: Any) -> str:
    """Labels keep every digit (repr), so a drawn value read back is the value rendered."""
    return "" if value is None else repr(value) if isinstance(value, float) else str(value)


def write_collated_store(rows: list[dict[str, Any]], stores: dict[str, Path], axes: list[str], output: Path,
                         label: str = "collate") -> None:
    """The collated store (see the module's docstring); `stores` maps a batch name to its store. The rows
    are gridded over the axes by pandas and xarray (a DataFrame indexed by the axes, as a Dataset: sorted
    coordinates, NaN where no point is); the images are then copied one point at a time."""
    grid = xr.Dataset.from_dataframe(pd.DataFrame(rows).set_index(axes))
    attributes = {"description": "nbsim sweep: one entry per point; images per detector size", "axes": axes}
    with AtomicStore(output, attributes) as store:
        for axis in axes:
            store.coordinate(axis, grid[axis].values.tolist())
        shape = tuple(grid.sizes[axis] for axis in axes)
        for name in (*TIMING_COLUMNS, *CORRELATION_COLUMNS):
            if name in grid and grid[name].dtype.kind in "iuf" and bool(grid[name].notnull().any()):
                store.variable(name, tuple(axes), shape, np.float64, data=grid[name].values.astype(np.float64))
        for name in ("status", "reference", "compile_cache", "attributes"):
            values = grid[name].values if name in grid else np.full(shape, None)
            text = np.vectorize(lambda v: "" if pd.isna(v) else str(v), otypes=[object])(values)
            store.variable(name, tuple(axes), shape, str, data=text)
        coordinates = _write_labels(store, rows, grid, axes, shape)
        for image in _copy_images(store, rows, grid, axes, stores, label):
            image.attrs["coordinates"] = " ".join(coordinates)
        store.commit()


def _write_labels(store: AtomicStore, rows: list[dict[str, Any]], grid: xr.Dataset, axes: list[str],
                  shape: tuple[int, ...]) -> list[str]:
    """Each numeric label: a coordinate along `draw` where it has one value per draw (drawn values, seeds,
    the A matrix, λ, ... of a dataset), else a variable over every axis. Returns the coordinates' names
    (the images name them in their CF `coordinates` attribute, so xarray reads them as coordinates)."""
    coordinates = []
    for label in label_columns(rows):
        column = LABEL_PREFIX + label
        if column not in grid or grid[column].dtype.kind not in "iuf" or label in axes:
            continue
        per_draw = {}
        if "draw" in axes:
            for row in rows:
                per_draw.setdefault(row["draw"], set()).add(row.get(column))
        if per_draw and all(len(values) == 1 for values in per_draw.values()):
            draws = grid["draw"].values.tolist()
            store.coordinate(label, [next(iter(per_draw[d])) for d in draws], dimension="draw")
            coordinates.append(label)
        else:
            store.variable(label, tuple(axes), shape, np.float64, data=grid[column].values.astype(np.float64))
    return coordinates


def _copy_images(store: AtomicStore, rows: list[dict[str, Any]], grid: xr.Dataset, axes: list[str],
                 stores: dict[str, Path], label: str) -> list:
    """Each size's images as `image_n<size>` (float32; with a detector stage also `detector_image_n<size>`,
    16-bit ADU), sharded along the last axis and written one shard at a time (each shard file written once),
    reading one image at a time from the batch stores; returns the arrays."""
    other_axes = tuple(a for a in axes if a != "size")
    indexes = {axis: grid.indexes[axis] for axis in other_axes}
    ok = [row for row in rows if row["status"] == "ok"]
    kinds = {"image": np.float32, **({DETECTOR_IMAGE: np.uint16} if any(row.get("detector") for row in ok) else {})}
    progress = Progress(len(ok) * len(kinds), label)
    targets = []
    for size in grid["size"].values.tolist():
        image_shape = (*(grid.sizes[a] for a in other_axes), size, size)
        for kind, dtype in kinds.items():
            target = store.image_variable(f"{kind}_n{size}", (*other_axes, f"slow_n{size}", f"fast_n{size}"),
                                          image_shape, dtype, shard_axis=len(other_axes) - 1)
            _copy_kind(target, [row for row in ok if row["size"] == size], kind, other_axes, indexes, stores,
                       progress)
            targets.append(target)
    return targets


def _copy_kind(target, rows: list[dict[str, Any]], kind: str, other_axes: tuple[str, ...], indexes: dict,
               stores: dict[str, Path], progress: Progress) -> None:
    per_shard = target.shards[len(other_axes) - 1]
    blocks: dict[tuple, list[tuple[tuple[int, ...], dict]]] = {}
    for row in rows:
        where = tuple(indexes[axis].get_loc(row[axis]) for axis in other_axes)
        blocks.setdefault((*where[:-1], where[-1] // per_shard), []).append((where, row))
    arrays: dict[str, Any] = {}
    for (*outer, block), members in blocks.items():
        first = block * per_shard
        stop = min(first + per_shard, target.shape[len(other_axes) - 1])
        data = np.full((stop - first, *target.shape[-2:]), target.fill_value, dtype=target.dtype)
        for where, row in members:
            if row["batch"] not in arrays:
                arrays[row["batch"]] = open_store_array(stores[row["batch"]], kind)
            data[where[-1] - first] = arrays[row["batch"]][row["index"]]
            progress.advance()
        target[(*outer, slice(first, stop))] = data
