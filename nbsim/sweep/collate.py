"""Collate a scenario's batches: timing and correlation tables and one xarray-readable store.

The collated store has one dimension per sweep axis (size, dtype, device, compile, then each extra axis
by name, `phi` for `-phi`, `draw` for draws) and every variable spans them all: each metric, and `image`
(with a detector stage also `detector_image`) over the axes plus `slow` and `fast`, one chunk per point.
Images smaller than the sweep's largest size fill the first rows and columns of theirs, the rest NaN (0 in
`detector_image`). `slow` and `fast` are pixel indices; `slow_mm` and `fast_mm` the pixel centres'
distances from the detector's first corner along them, in mm, when every point has the same pixel size
(`pixel_mm`, a variable over the axes, says each point's). A rotation series reads as one (phi, slow, fast)
array after `.squeeze()`, and `.sel(...)` of one point reads one chunk. A -panelfile scenario's images
have a `panel` dimension before `slow` and `fast` (panels zero-padded to the largest; no `slow_mm`, `fast_mm`:
each panel has its own pixels). Images are copied one shard at a
time (nbsim.sweep.store.SHARD_BYTES, 16 MiB), so memory holds about one shard of images however large the
sweep. With draws, labels (nbsim.sweep.labels) are coordinates along `draw`.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import EMPTY_SHOT_ADVICE
from ..errors import NbsimError
from .fitting import write_fit_variables
from .merging import write_merge_variables
from .progress import Progress
from .store import DETECTOR_IMAGE, AtomicStore, open_store_array, read_json

if TYPE_CHECKING:
    import xarray as xr

TIMING_COLUMNS = ("batch", "cold_s", "warm_median_s", "warm_min_s", "warm_max_s", "reference", "reference_batch",
                  "reference_median_s", "reference_min_s", "reference_max_s", "speedup", "speedup_min", "speedup_max",
                  "peak_rss_mb", "threads", "mode", "compile_cache", "bytes_per_image", "host", "slurm_job_id")
"""`reference_batch`: the batch whose warm times are the reference's (`reference_*_s`); `speedup_min` and
`speedup_max`: the speedup's range over both sides' repeats (the reference's fastest over nbsim's slowest,
its slowest over nbsim's fastest); `mode`: the kernel path the point rendered with, 'jit (aot refused)' where
this machine refused its ahead-of-time packages (nbsim.timing.BenchResult.mode)."""
REFERENCE_NAMES = {"nbsim-float64-cpu": "nbsim float64 on the CPU", "c": "the C nanoBragg"}
"""How tables and plots name each kind of reference: without a C binary the speedup is over nbsim's
own float64 image, not over nanoBragg."""
NBSIM_REFERENCE = "nbsim-float64-cpu"


def is_reference_row(row: dict[str, Any]) -> bool:
    """A float64 CPU point compared with nbsim's float64 CPU reference, with the reference's compile setting
    (`reference_compile`, when the row knows it), is the reference's own configuration: its time is not a
    speedup over anything."""
    return (row.get("reference") == NBSIM_REFERENCE and row.get("dtype") == "float64" and row.get("device") == "cpu"
            and row.get("compile") == row.get("reference_compile", row.get("compile")))


def reference_label(rows: list[dict[str, Any]]) -> str:
    """What the rows were compared against (the C binary, nbsim float64), for titles."""
    kinds = sorted({str(row["reference"]) for row in rows if row.get("reference")})
    return " / ".join(REFERENCE_NAMES.get(kind, kind) for kind in kinds) or "the reference"
CORRELATION_COLUMNS = ("correlation", "one_minus_r", "max_abs_error", "max_rel_error", "sum_ratio", "finite")
"""`one_minus_r` is 1 − correlation: what tables show, since every good point's r prints as 1."""
_BATCH_IDENTITY = ("host", "cpu", "slurm_job_id", "versions", "process_startup_s", "batch")
LABEL_PREFIX = "label:"
"""Rows carry a point's labels (nbsim.sweep.labels) under this prefix, apart from its axes and metrics."""


REFERENCE_TIMES = {"warm_median_s": "reference_median_s", "warm_min_s": "reference_min_s",
                   "warm_max_s": "reference_max_s"}
"""A reference's warm times and the row columns that carry them."""


def point_rows(batch_records: list[Path], reference_records: list[Path]) -> list[dict[str, Any]]:
    """One row per point, in batch order: its axes, status, timings, comparison with its reference, the
    reference's kind and warm times, the speedup with its range, and where its image is (`batch`, `index`).

    The reference's times are those of the one measurement the table shows for it: for nbsim's float64
    reference, the sweep's own point of the reference's configuration (`is_reference_row`) where the sweep
    has one, timed like every other point; else the reference batch's (the C binary's, or a sweep without
    that point)."""
    references: dict[str, dict[str, Any]] = {}
    for path in reference_records:
        record = read_json(path)
        for point in record["points"]:
            references[point["name"]] = {"kind": record.get("reference"), "compile": record.get("compile"),
                                         "batch": record["batch"], "timing": point.get("timing") or {}}
    rows = []
    for path in batch_records:
        record = read_json(path)
        identity = {key: record.get(key) for key in _BATCH_IDENTITY}
        for point in record["points"]:
            timing = point.get("timing") or {}
            reference = references.get(point["reference"], {})
            row: dict[str, Any] = {"scenario": record["scenario"], "point": point["name"], **point["axes"],
                                   "status": point["status"], "batch": record["batch"], "index": point["index"],
                                   "reference": reference.get("kind"), "reference_point": point["reference"]}
            if reference.get("compile") is not None:
                row["reference_compile"] = str(reference["compile"])
            row.update({key: timing[key] for key in TIMING_COLUMNS if key in timing})
            row["bytes_per_image"] = record.get("bytes_per_image")
            row["detector"] = DETECTOR_IMAGE in point.get("images", ())
            row.update({LABEL_PREFIX + key: value for key, value in (point.get("labels") or {}).items()})
            if point["status"] != "ok":
                row["reason"] = point.get("reason")
            row.update(point.get("comparison") or {})
            if isinstance(row.get("correlation"), float):
                row["one_minus_r"] = 1.0 - row["correlation"]
            row["pixel_mm"] = ((point.get("config") or {}).get("detector") or {}).get("pixel_size_mm")
            row["attributes"] = json.dumps({**identity, **{k: v for k, v in point.items()
                                                           if k not in ("axes", "labels")}}, default=str)
            rows.append(row)
    own = {row["reference_point"]: row for row in rows if is_reference_row(row) and row.get("warm_median_s")}
    for row in rows:
        measured = own.get(row["reference_point"])
        if measured is not None:
            row["reference_batch"] = measured["batch"]
            row.update({column: measured.get(key) for key, column in REFERENCE_TIMES.items()})
        elif row["reference_point"] in references:
            reference = references[row["reference_point"]]
            row["reference_batch"] = reference["batch"]
            row.update({column: reference["timing"].get(key) for key, column in REFERENCE_TIMES.items()})
        if row.get("warm_median_s") and row.get("reference_median_s") and not is_reference_row(row):
            row["speedup"] = row["reference_median_s"] / row["warm_median_s"]
            if row.get("warm_min_s") and row.get("warm_max_s") and row.get("reference_min_s") \
                    and row.get("reference_max_s"):
                row["speedup_min"] = row["reference_min_s"] / row["warm_max_s"]
                row["speedup_max"] = row["reference_max_s"] / row["warm_min_s"]
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


def empty_shots(rows: list[dict[str, Any]], min_photons: float) -> str | None:
    """One line naming the rendered points whose noise-free image holds fewer than `min_photons` photons in
    all (a dataset's empty shots: a fluence or crystal too small for the detector to see anything), the first
    ten by draw (or name) and how many; None when there are none (or `min_photons` is 0)."""
    rendered = [row for row in rows if row["status"] == "ok" and LABEL_PREFIX + "total_photons" in row]
    empty = [row for row in rendered if row[LABEL_PREFIX + "total_photons"] < min_photons]
    if not empty:
        return None
    names = [f"draw {row['draw']}" if row.get("draw") is not None else str(row["point"]) for row in empty]
    shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    fewest = min(row[LABEL_PREFIX + "total_photons"] for row in empty)
    return (f"{len(empty)} of {len(rendered)} shots hold fewer than {min_photons:g} photons (sweep.min_photons; "
            f"the emptiest {fewest:.3g}): {shown}; {EMPTY_SHOT_ADVICE}")


def _format_exact(value: Any) -> str:
    """Labels keep every digit (repr), so a drawn value read back is the value rendered."""
    return "" if value is None else repr(value) if isinstance(value, float) else str(value)


def write_collated_store(rows: list[dict[str, Any]], stores: dict[str, Path], axes: list[str], output: Path,
                         label: str = "collate", fits: list[dict[str, Any]] | None = None,
                         merges: list[dict[str, Any]] | None = None) -> None:
    """The collated store (see the module's docstring); `stores` maps a batch name to its store. The rows
    are gridded over the axes by pandas and xarray (a DataFrame indexed by the axes, as a Dataset: sorted
    coordinates, NaN where no point is); the images are then copied one shard at a time. `fits`: the rows of
    a `fit:` section (nbsim.sweep.fitting.fit_rows), kept as `fit_*` variables; `merges`: a `merge:` section's
    (nbsim.sweep.merging.merge_rows), kept as `merge_*` variables. pandas and xarray are imported here, not
    with the module: the summary and plot jobs that read its rows need neither (half a CPU-second a job)."""
    import pandas as pd
    import xarray as xr

    grid = xr.Dataset.from_dataframe(pd.DataFrame(rows).set_index(axes))
    attributes = {"description": "nbsim sweep: one entry per point, every variable over the sweep axes", "axes": axes}
    with AtomicStore(output, attributes) as store:
        for axis in axes:
            store.coordinate(axis, grid[axis].values.tolist())
        shape = tuple(grid.sizes[axis] for axis in axes)
        for name in (*TIMING_COLUMNS, *CORRELATION_COLUMNS):
            if name in grid and grid[name].dtype.kind in "iuf" and bool(grid[name].notnull().any()):
                store.variable(name, tuple(axes), shape, np.float64, data=grid[name].values.astype(np.float64))
        for name in ("status", "reference", "mode", "compile_cache", "attributes"):
            values = grid[name].values if name in grid else np.full(shape, None)
            text = np.vectorize(lambda v: "" if pd.isna(v) else str(v), otypes=[object])(values)
            store.variable(name, tuple(axes), shape, str, data=text)
        image_arrays = {batch: open_store_array(stores[batch], "image")
                        for batch in dict.fromkeys(row["batch"] for row in rows if row["status"] == "ok")}
        pixels = _image_shape(rows, image_arrays)
        pixel_mm = grid["pixel_mm"].values.astype(np.float64) if "pixel_mm" in grid else np.full(shape, np.nan)
        store.variable("pixel_mm", tuple(axes), shape, np.float64, data=pixel_mm)
        for dimension, count in zip(IMAGE_DIMENSIONS[-len(pixels):], pixels, strict=True):
            store.coordinate(dimension, list(range(count)))
        coordinates = _write_labels(store, rows, grid, axes, shape)
        sizes_mm = set(pixel_mm[np.isfinite(pixel_mm)].tolist())
        if len(sizes_mm) == 1 and len(pixels) == 2:
            for dimension, count in zip(("slow", "fast"), pixels, strict=True):
                store.coordinate(f"{dimension}_mm", ((np.arange(count) + 0.5) * next(iter(sizes_mm))).tolist(),
                                 dimension=dimension)
            coordinates += ["slow_mm", "fast_mm"]
        for image in _copy_images(store, rows, grid, axes, stores, image_arrays, pixels, label):
            image.attrs["coordinates"] = " ".join(coordinates)
        if fits:
            write_fit_variables(store, fits, grid, axes)
        if merges:
            write_merge_variables(store, merges, grid, axes)
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


IMAGE_DIMENSIONS = ("panel", "slow", "fast")


def _image_shape(rows: list[dict[str, Any]], image_arrays: dict[str, Any]) -> tuple[int, ...]:
    """The collated image's trailing shape: the largest (slow, fast), or (panel, slow, fast), of the batch
    stores' images (`image_arrays`: each batch's opened `image` array)."""
    shapes = [array.shape[1:] for array in image_arrays.values()]
    if not shapes:
        largest = int(max(row["size"] for row in rows))
        return (largest, largest)
    if len({len(shape) for shape in shapes}) != 1:
        raise NbsimError("a scenario's points mix multi-panel (-panelfile) and single-panel images: give the "
                         "panel files their own scenario")
    return tuple(int(max(sizes)) for sizes in zip(*shapes, strict=True))


def _copy_images(store: AtomicStore, rows: list[dict[str, Any]], grid: xr.Dataset, axes: list[str],
                 stores: dict[str, Path], image_arrays: dict[str, Any], pixels: tuple[int, ...],
                 label: str) -> list:
    """`image` (float32; with a detector stage also `detector_image`, 16-bit ADU) over the axes plus the
    image's own dimensions (`pixels`: slow, fast or panel, slow, fast), sharded along the last axis and
    written one shard at a time (each shard file written once), each shard's images read from a batch store
    in one read; returns the arrays."""
    indexes = {axis: grid.indexes[axis] for axis in axes}
    ok = [row for row in rows if row["status"] == "ok"]
    kinds = {"image": np.float32, **({DETECTOR_IMAGE: np.uint16} if any(row.get("detector") for row in ok) else {})}
    progress = Progress(len(ok) * len(kinds), label, unit="images")  # each point's image and detector image
    shape = (*(grid.sizes[a] for a in axes), *pixels)
    targets = []
    for kind, dtype in kinds.items():
        target = store.image_variable(kind, (*axes, *IMAGE_DIMENSIONS[-len(pixels):]), shape, dtype,
                                      shard_axis=len(axes) - 1)
        opened = dict(image_arrays) if kind == "image" else {}
        _copy_kind(target, ok, kind, axes, indexes, stores, opened, progress)
        targets.append(target)
    return targets


def _copy_kind(target, rows: list[dict[str, Any]], kind: str, axes: list[str], indexes: dict,
               stores: dict[str, Path], arrays: dict[str, Any], progress: Progress) -> None:
    """Each shard of `target` filled from the batch stores' `kind` arrays (`arrays`: those already open, by
    batch; the others are opened once, on first use)."""
    per_shard = target.shards[len(axes) - 1]
    blocks: dict[tuple, list[tuple[tuple[int, ...], dict]]] = {}
    for row in rows:
        where = tuple(indexes[axis].get_loc(row[axis]) for axis in axes)
        blocks.setdefault((*where[:-1], where[-1] // per_shard), []).append((where, row))
    for (*outer, block), members in blocks.items():
        first = block * per_shard
        stop = min(first + per_shard, target.shape[len(axes) - 1])
        data = np.full((stop - first, *target.shape[len(axes):]), target.fill_value, dtype=target.dtype)
        by_batch: dict[str, list[tuple[tuple[int, ...], dict]]] = {}
        for where, row in members:
            by_batch.setdefault(row["batch"], []).append((where, row))
        for batch, placed in by_batch.items():
            if batch not in arrays:
                arrays[batch] = open_store_array(stores[batch], kind)
            low, high = min(r["index"] for _, r in placed), max(r["index"] for _, r in placed)
            read = arrays[batch][low:high + 1]  # one read of the batch's images in this block
            for where, row in placed:
                image = read[row["index"] - low]
                data[(where[-1] - first, *(slice(0, n) for n in image.shape))] = image
                progress.advance()
        target[(*outer, slice(first, stop))] = data
