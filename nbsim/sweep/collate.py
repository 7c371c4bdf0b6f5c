"""Collate a scenario's batches: timing and correlation tables and one xarray-readable store.

The collated store has one dimension per sweep axis (size, dtype, device, compile, then each extra axis
by name, `phi` for `-phi`) and every variable spans them all: each metric, and `image` over the axes plus
`slow` and `fast`, one chunk per point. Images smaller than the sweep's largest size fill the first
rows and columns of theirs, the rest NaN. `slow` and `fast` are pixel indices; `slow_mm` and `fast_mm`
the pixel centres' distances from the detector's first corner along them, in mm, when every point has
the same pixel size (`pixel_mm`, a variable over the axes, says each point's). A rotation series reads
as one (phi, slow, fast) array after `.squeeze()`, and `.sel(...)` of one point reads one chunk. It is
built point by point, so memory holds one image at a time however large the sweep.
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
from .store import AtomicStore, open_store_array, read_json

TIMING_COLUMNS = ("batch", "cold_s", "warm_median_s", "warm_min_s", "warm_max_s", "reference", "reference_median_s",
                  "speedup", "peak_rss_mb", "threads", "compile_cache", "host", "slurm_job_id")
REFERENCE_NAMES = {"nbsim-float64-cpu": "nbsim float64 on the CPU", "c": "the C nanoBragg"}
"""How tables and plots name each kind of reference: without a C binary the speedup is over nbsim's
own float64 image, not over nanoBragg."""
NBSIM_REFERENCE = "nbsim-float64-cpu"


def is_reference_row(row: dict[str, Any]) -> bool:
    """A float64 CPU point compared with nbsim's float64 CPU reference is the reference's own
    configuration: its time is not a speedup over anything."""
    return row.get("reference") == NBSIM_REFERENCE and row.get("dtype") == "float64" and row.get("device") == "cpu"


def reference_label(rows: list[dict[str, Any]]) -> str:
    kinds = sorted({str(row["reference"]) for row in rows if row.get("reference")})
    return " / ".join(REFERENCE_NAMES.get(kind, kind) for kind in kinds) or "the reference"
CORRELATION_COLUMNS = ("correlation", "one_minus_r", "max_abs_error", "max_rel_error", "sum_ratio", "finite")
"""`one_minus_r` is 1 − correlation: what tables show, since every good point's r prints as 1."""
_BATCH_IDENTITY = ("host", "cpu", "slurm_job_id", "versions", "process_startup_s", "batch")


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
            if timing.get("warm_median_s") and reference_s and not is_reference_row(row):
                row["speedup"] = reference_s / timing["warm_median_s"]
            if point["status"] != "ok":
                row["reason"] = point.get("reason")
            row.update(point.get("comparison") or {})
            if isinstance(row.get("correlation"), float):
                row["one_minus_r"] = 1.0 - row["correlation"]
            row["pixel_mm"] = ((point.get("config") or {}).get("detector") or {}).get("pixel_size_mm")
            row["attributes"] = json.dumps({**identity, **{k: v for k, v in point.items() if k != "axes"}},
                                           default=str)
            rows.append(row)
    return rows


def _format(value: Any) -> str:
    """A CSV cell: every digit of a float (the reader's tables round; nbsim.sweep.report)."""
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)
    return str(value)


def write_table(rows: list[dict[str, Any]], axes: list[str], csv_path: Path, columns: tuple[str, ...]) -> None:
    """The table as CSV: every column that has a value in some row, every digit (the reader's tables, rounded,
    are nbsim.sweep.report's)."""
    header = ["point", *axes, "status",
              *[c for c in columns if any(r.get(c) not in (None, "") for r in rows)]]
    with open(csv_path, "w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(header)
        for row in rows:
            writer.writerow([_format(row.get(c)) for c in header])


def write_collated_store(rows: list[dict[str, Any]], stores: dict[str, Path], axes: list[str], output: Path,
                         label: str = "collate") -> None:
    """The collated store (see the module's docstring); `stores` maps a batch name to its store. The rows
    are gridded over the axes by pandas and xarray (a DataFrame indexed by the axes, as a Dataset: sorted
    coordinates, NaN where no point is); the images are then copied one point at a time."""
    grid = xr.Dataset.from_dataframe(pd.DataFrame(rows).set_index(axes))
    attributes = {"description": "nbsim sweep: one entry per point, every variable over the sweep axes", "axes": axes}
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
        largest = int(max(grid["size"].values))
        pixel_mm = grid["pixel_mm"].values.astype(np.float64) if "pixel_mm" in grid else np.full(shape, np.nan)
        store.variable("pixel_mm", tuple(axes), shape, np.float64, data=pixel_mm)
        for dimension in ("slow", "fast"):
            store.coordinate(dimension, list(range(largest)))
        sizes_mm = set(pixel_mm[np.isfinite(pixel_mm)].tolist())
        images = store.variable("image", (*axes, "slow", "fast"), (*shape, largest, largest), np.float32,
                                chunks=(*(1 for _ in axes), largest, largest))
        if len(sizes_mm) == 1:
            centres_mm = ((np.arange(largest) + 0.5) * sizes_mm.pop()).tolist()
            for dimension in ("slow", "fast"):
                store.coordinate(f"{dimension}_mm", centres_mm, dimension=dimension)
            images.attrs["coordinates"] = "slow_mm fast_mm"
        indexes = {axis: grid.indexes[axis] for axis in axes}
        ok = [row for row in rows if row["status"] == "ok"]
        progress = Progress(len(ok), label)
        by_batch: dict[str, list[dict]] = {}
        for row in ok:
            by_batch.setdefault(row["batch"], []).append(row)
        for batch, members in by_batch.items():
            stored = open_store_array(stores[batch], "image")
            for row in members:
                size = row["size"]
                where = (*(indexes[axis].get_loc(row[axis]) for axis in axes), slice(0, size), slice(0, size))
                images[where] = np.asarray(stored[row["index"]], dtype=np.float32)
                progress.advance()
        store.commit()
