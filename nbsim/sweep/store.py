"""The sweep's files: JSON records and zarr stores.

Stores are zarr (format 3) groups with xarray's dimension names, so `xr.open_zarr` reads them. Images are
compressed losslessly (Blosc: zstd after a bit shuffle) and sharded: one file holds many images' chunks,
so a store's file count grows with its shards, not its images (a batch store: 5 files per 100 images and
image kind; a collated store: one file per SHARD_BYTES), while `.sel` of one point still reads one chunk.

Two ways of writing:

* `AtomicStore` (the collated store): written array by array into `<name>.partial-<pid>` beside its final
  path and renamed into place when complete; a job killed mid-write leaves only a `.partial-*` folder that
  nothing reads (the next write of the same store removes it).
* `BatchStore` (a batch's images): created once for its job (the job's digest in its attributes) and filled
  point by point: finished points are written at least every FLUSH_S seconds (and whenever they fill a
  shard), their images first, then their entries (records, one JSON line each) appended to
  `entries.jsonl`, then their marks in the `done` array (one byte per point): the completion marker, and
  readers take only points marked done. zarr writes every file (a shard, the
  `done` chunk) to a temporary name and renames it, so a kill (SIGKILL, a SLURM wall time) leaves each
  file either old or new, never torn; a torn last line of the log is cut off when the store is reopened,
  and an entry whose point is not marked done is ignored. The rerun of the same job reopens the store and
  renders only the points not done. A store of another job (changed points) is replaced.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

DETECTOR_IMAGE = "detector_image"
"""The detector stage's image (16-bit ADU) beside the noise-free `image`, with a `sweep.detector` block."""
ENTRY_LOG = "entries.jsonl"
"""A batch store's append-only log of its points' entries (records), one JSON line each."""
SHARD_BYTES = 16 * 2**20
"""The most uncompressed bytes of one shard (one file)."""
FLUSH_S = 1.0
"""A batch store writes its finished points at least this often (seconds): a kill loses at most the
points of the last second, while a shard file is rewritten once per flush rather than once per point."""
BATCH_SHARD_IMAGES = 20
"""Images per shard of a batch store. A point written into a shard rewrites that shard's file (zarr writes
whole files), so a batch's shards are kept small: 5 files per 100 images and image kind. A collated store,
written a whole shard at a time, fills its shards up to SHARD_BYTES."""


def json_safe(value: Any) -> Any:
    """`value` as JSON would read it back (non-JSON values as text)."""
    return json.loads(json.dumps(value, default=str, allow_nan=True))


def write_json(path: Path, payload: dict) -> None:
    """Write `payload` as indented, sorted JSON, atomically."""
    from ..io.atomic import atomic_write_text

    atomic_write_text(path, json.dumps(json_safe(payload), indent=1, sort_keys=True) + "\n")


def read_json(path: Path) -> dict:
    """A JSON file's contents."""
    return json.loads(Path(path).read_text())


def read_store(path: Path):
    """A store as an xarray Dataset (lazy: `.sel` on one point reads that point's chunk)."""
    import xarray as xr

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Consolidated metadata")
        return xr.open_zarr(path, consolidated=True)


def open_store_array(path: Path, name: str):
    """One array of a store, for reading point by point without xarray's overhead."""
    import zarr

    return zarr.open_array(str(Path(path) / name), mode="r")


def coordinate_values(values: list) -> np.ndarray:
    """Numbers stay numbers; anything else, or a mix, becomes text."""
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return np.asarray(values)
    return np.asarray([str(v) for v in values], dtype=str)


def compressors() -> list:
    """Lossless compression of every image array: Blosc's zstd after a bit shuffle."""
    from zarr.codecs import BloscCodec, BloscShuffle

    return [BloscCodec(cname="zstd", clevel=3, shuffle=BloscShuffle.bitshuffle)]


def images_per_shard(count: int, image_bytes: int, most: int | None = None) -> int:
    """Images per shard along an axis of `count` images: all of them, or `most`, within SHARD_BYTES."""
    return max(1, min(count, most or count, SHARD_BYTES // max(1, image_bytes)))


def _create_image_array(group, name: str, dimensions: Sequence[str], shape: tuple[int, ...], dtype: Any,
                        fill_value: Any, shard_axis: int, most_per_shard: int | None = None):
    """An image array chunked one image per chunk, sharded along `shard_axis`, compressed."""
    chunks = (*(1 for _ in shape[:-2]), *shape[-2:])
    shards = list(chunks)
    shards[shard_axis] = images_per_shard(shape[shard_axis], np.dtype(dtype).itemsize * shape[-1] * shape[-2],
                                          most_per_shard)
    return group.create_array(name, shape=shape, dtype=dtype, chunks=chunks, shards=tuple(shards),
                              compressors=compressors(), dimension_names=list(dimensions), fill_value=fill_value)


def job_digest(job: dict) -> str:
    """What identifies a batch's job (its parameters as JSON data)."""
    return hashlib.sha256(json.dumps(json_safe(job), sort_keys=True).encode()).hexdigest()


class BatchStore:
    """A batch's images (`<name> (point, slow, fast)` per image kind, `(point, panel, slow, fast)` for a
    multi-panel detector, padded to its largest panel) and its points' entries, written point by point and
    resumable (see the module's docstring)."""

    def __init__(self, path: Path, digest: str, points: list[str], image_shape: tuple[int, ...],
                 images: dict[str, Any],
                 attributes: dict[str, Any]):
        import zarr

        self.path = Path(path)
        self.images = dict(images)
        try:
            group = zarr.open_group(str(self.path), mode="r+")
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=f"Object at {ENTRY_LOG} is not recognized")
                members = set(group.array_keys())
            if group.attrs.get("job") != digest or {*self.images, "done"} - members:
                raise ValueError("another job's store")
        except (FileNotFoundError, ValueError, KeyError, zarr.errors.GroupNotFoundError):
            group = self._create(digest, points, image_shape, attributes)
        self.group = group
        self._done = group["done"]
        self._arrays = {name: group[name] for name in self.images}
        self._pending: list[tuple[int, dict[str, np.ndarray], str]] = []
        self._flushed = time.monotonic()
        self._log = self.path / ENTRY_LOG
        self._cut_torn_line()

    def _create(self, digest: str, points: list[str], image_shape: tuple[int, ...], attributes: dict[str, Any]):
        import zarr

        shutil.rmtree(self.path, ignore_errors=True)
        group = zarr.open_group(str(self.path), mode="w", zarr_format=3)
        group.attrs.update(json_safe({**attributes, "job": digest}))
        names = group.create_array("point", shape=(len(points),), dtype=str, dimension_names=["point"],
                                   fill_value=None)
        names[...] = np.asarray(points, dtype=str)
        for name, dtype in self.images.items():
            fill = np.nan if np.dtype(dtype).kind == "f" else 0
            dimensions = ("point", *("panel", "slow", "fast")[-len(image_shape):])
            _create_image_array(group, name, dimensions, (len(points), *image_shape), dtype, fill, 0,
                                BATCH_SHARD_IMAGES)
        # The log before `done`, the member whose presence makes a store reusable: a kill between the two
        # then leaves a store that is made again, never one reopened without its log.
        (self.path / ENTRY_LOG).touch()
        group.create_array("done", shape=(len(points),), dtype=np.uint8, chunks=(len(points),),
                           dimension_names=["point"], fill_value=0)
        return group

    def _cut_torn_line(self) -> None:
        """A kill mid-append leaves a last line without its newline: cut it off before appending."""
        data = self._log.read_bytes() if self._log.is_file() else b""
        if data and not data.endswith(b"\n"):
            with open(self._log, "r+b") as stream:
                stream.truncate(data.rfind(b"\n") + 1)

    def entries(self) -> list[dict | None]:
        """Each point's entry, None for a point not yet done."""
        done = self._done[...]
        entries: list[dict | None] = [None] * len(done)
        with open(self._log) as stream:
            for line in stream:
                entry = json.loads(line)
                if done[entry["index"]]:
                    entries[entry["index"]] = entry
        return entries

    def write(self, index: int, images: dict[str, np.ndarray], entry: dict) -> None:
        """A finished point, kept until the next flush: at most FLUSH_S after the last one, or when the
        points waiting fill a shard (a shard file is rewritten once per flush, not once per point)."""
        self._pending.append((index, images, json.dumps(json_safe({**entry, "index": index}), sort_keys=True)))
        if len(self._pending) >= BATCH_SHARD_IMAGES or time.monotonic() - self._flushed >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        """The waiting points: their images (each run of consecutive points in one write per shard), their
        entries appended to the log, then their done marks."""
        pending, self._pending = self._pending, []
        self._flushed = time.monotonic()
        if not pending:
            return
        runs: list[list[tuple[int, dict[str, np.ndarray], str]]] = []
        for item in pending:
            if runs and item[0] == runs[-1][-1][0] + 1:
                runs[-1].append(item)
            else:
                runs.append([item])
        for run in runs:
            for name in run[0][1]:
                self._arrays[name][run[0][0]:run[-1][0] + 1] = np.stack([images[name] for _, images, _ in run])
        with open(self._log, "a") as stream:
            stream.write("".join(line + "\n" for _, _, line in pending))
        done = self._done[...]
        done[[index for index, _, _ in pending]] = 1
        self._done[...] = done

    def finish(self, attributes: dict[str, Any]) -> None:
        """The last points flushed, the batch's attributes, and its metadata consolidated."""
        import zarr

        self.flush()
        self.group.attrs.update(json_safe(attributes))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Consolidated metadata")
            warnings.filterwarnings("ignore", message=f"Object at {ENTRY_LOG} is not recognized")
            zarr.consolidate_metadata(str(self.path))


def completed_points(path: Path) -> np.ndarray:
    """Which points of a batch store are complete (marked done): what readers may take."""
    return open_store_array(path, "done")[...] == 1


class AtomicStore:
    """A zarr group built array by array, renamed into place by `commit()`; used as a context manager,
    a failure before the commit removes the partial folder."""

    def __init__(self, path: Path, attributes: dict[str, Any]):
        import zarr

        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for stale in self.path.parent.glob(self.path.name + ".partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        self.partial = self.path.with_name(self.path.name + f".partial-{os.getpid()}")
        self.group = zarr.open_group(str(self.partial), mode="w", zarr_format=3)
        self.group.attrs.update(json_safe(attributes))

    def coordinate(self, name: str, values: list, dimension: str | None = None) -> None:
        """A 1-D coordinate along `dimension` (its own name by default)."""
        data = coordinate_values(values)
        array = self.group.create_array(name, shape=data.shape, dtype=data.dtype if data.dtype.kind != "U" else str,
                                        dimension_names=[dimension or name], fill_value=None)
        array[...] = data

    def image_variable(self, name: str, dimensions: tuple[str, ...], shape: tuple[int, ...], dtype: Any,
                       shard_axis: int):
        """An image array (NaN-filled floats, 0-filled integers), one image per chunk, sharded along
        `shard_axis`, compressed."""
        fill = np.nan if np.dtype(dtype).kind == "f" else 0
        return _create_image_array(self.group, name, dimensions, shape, dtype, fill, shard_axis)

    def variable(self, name: str, dimensions: tuple[str, ...], shape: tuple[int, ...], dtype: Any,
                 chunks: tuple[int, ...] | None = None, data: np.ndarray | None = None):
        """A data variable (NaN-filled floats, empty text), optionally written at once; returns the array."""
        text = dtype is str or np.dtype(dtype).kind in "US"
        array = self.group.create_array(
            name, shape=shape, dtype=str if text else dtype, chunks=chunks or shape,
            dimension_names=list(dimensions), fill_value="" if text else np.nan)
        if data is not None:
            array[...] = data
        return array

    def commit(self) -> None:
        """Consolidate the store's metadata and move it into place, replacing any store there."""
        import zarr

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Consolidated metadata")
            zarr.consolidate_metadata(str(self.partial))
        shutil.rmtree(self.path, ignore_errors=True)
        os.replace(self.partial, self.path)

    def __enter__(self) -> AtomicStore:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if error is not None:
            shutil.rmtree(self.partial, ignore_errors=True)
