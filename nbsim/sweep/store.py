"""The sweep's files: JSON records and zarr stores.

Stores are zarr (format 3) groups with xarray's dimension names, so `xr.open_zarr` reads them. Images are
compressed losslessly (Blosc: zstd after a bit shuffle) and sharded: one file holds many images' chunks,
so a store's file count grows with its shards, not its images, while `.sel` of one point still reads one
chunk.

Two ways of writing:

* `AtomicStore` (the collated store): written array by array into `<name>.partial-<pid>` beside its final
  path and renamed into place when complete; a job killed mid-write leaves only a `.partial-*` folder that
  nothing reads (the next write of the same store removes it).
* `BatchStore` (a batch's images): created once for its job (the job's digest in its attributes) and filled
  image by image. Each point's images are written first, then its entry (its record, JSON) in the `entry`
  array: an entry is the point's completion marker, and readers take only points with one. zarr writes
  every file (a shard, the entry chunk) to a temporary name and renames it, so a kill (SIGKILL, a SLURM
  wall time) leaves each file either old or new, never torn; the rerun of the same job reopens the store
  and renders only the points without an entry. A store of another job (changed points) is replaced.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

DETECTOR_IMAGE = "detector_image"
"""The detector stage's image (16-bit ADU) beside the noise-free `image`, with a `sweep.detector` block."""
SHARD_BYTES = 64 * 2**20
"""The most uncompressed bytes of one shard (one file)."""
SHARDS_PER_BATCH = 4
"""A batch's images go into at most this many shards per image array (fewer where a shard would pass
SHARD_BYTES): a batch of 100 images is about a dozen files."""


def json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str, allow_nan=True))


def write_json(path: Path, payload: dict) -> None:
    from ..io.atomic import atomic_write_text

    atomic_write_text(path, json.dumps(json_safe(payload), indent=1, sort_keys=True) + "\n")


def read_json(path: Path) -> dict:
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

    return zarr.open_group(str(path), mode="r")[name]


def coordinate_values(values: list) -> np.ndarray:
    """Numbers stay numbers; anything else, or a mix, becomes text."""
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return np.asarray(values)
    return np.asarray([str(v) for v in values], dtype=str)


def compressors() -> list:
    """Lossless compression of every image array: Blosc's zstd after a bit shuffle."""
    from zarr.codecs import BloscCodec, BloscShuffle

    return [BloscCodec(cname="zstd", clevel=3, shuffle=BloscShuffle.bitshuffle)]


def images_per_shard(count: int, image_bytes: int) -> int:
    """Images per shard of a `count`-image array: SHARDS_PER_BATCH shards, each within SHARD_BYTES."""
    return max(1, min(math.ceil(count / SHARDS_PER_BATCH), SHARD_BYTES // max(1, image_bytes)))


def _create_image_array(group, name: str, dimensions: Sequence[str], shape: tuple[int, ...], dtype: Any,
                        fill_value: Any, shard_axis: int):
    """An image array chunked one image per chunk, sharded along `shard_axis`, compressed."""
    chunks = (*(1 for _ in shape[:-2]), *shape[-2:])
    shards = list(chunks)
    shards[shard_axis] = images_per_shard(shape[shard_axis], np.dtype(dtype).itemsize * shape[-1] * shape[-2])
    return group.create_array(name, shape=shape, dtype=dtype, chunks=chunks, shards=tuple(shards),
                              compressors=compressors(), dimension_names=list(dimensions), fill_value=fill_value)


def job_digest(job: dict) -> str:
    """What identifies a batch's job (its parameters as JSON data)."""
    return hashlib.sha256(json.dumps(json_safe(job), sort_keys=True).encode()).hexdigest()


class BatchStore:
    """A batch's images (`<name> (point, slow, fast)` per image kind) and its points' entries, written point
    by point and resumable (see the module's docstring)."""

    def __init__(self, path: Path, digest: str, points: list[str], size: int, images: dict[str, Any],
                 attributes: dict[str, Any]):
        import zarr

        self.path = Path(path)
        self.images = dict(images)
        try:
            group = zarr.open_group(str(self.path), mode="r+")
            if group.attrs.get("job") != digest or set(self.images) - set(group.array_keys()):
                raise ValueError("another job's store")
        except (FileNotFoundError, ValueError, KeyError, zarr.errors.GroupNotFoundError):
            group = self._create(digest, points, size, attributes)
        self.group = group
        self._entries = group["entry"]

    def _create(self, digest: str, points: list[str], size: int, attributes: dict[str, Any]):
        import zarr

        shutil.rmtree(self.path, ignore_errors=True)
        group = zarr.open_group(str(self.path), mode="w", zarr_format=3)
        group.attrs.update(json_safe({**attributes, "job": digest}))
        names = group.create_array("point", shape=(len(points),), dtype=str, dimension_names=["point"],
                                   fill_value=None)
        names[...] = np.asarray(points, dtype=str)
        for name, dtype in self.images.items():
            fill = np.nan if np.dtype(dtype).kind == "f" else 0
            _create_image_array(group, name, ("point", "slow", "fast"), (len(points), size, size), dtype, fill, 0)
        group.create_array("entry", shape=(len(points),), dtype=str, chunks=(len(points),),
                           dimension_names=["point"], fill_value="")
        return group

    def entries(self) -> list[dict | None]:
        """Each point's entry, None for a point not yet complete."""
        return [json.loads(text) if text else None for text in self._entries[...].tolist()]

    def write(self, index: int, images: dict[str, np.ndarray], entry: dict) -> None:
        """A finished point: its images, then its entry (which marks it complete)."""
        for name, image in images.items():
            self.group[name][index] = image
        self._entries[index] = json.dumps(json_safe(entry), sort_keys=True)

    def finish(self, attributes: dict[str, Any]) -> None:
        """The batch's attributes, and its metadata consolidated (once every point is complete)."""
        import zarr

        self.group.attrs.update(json_safe(attributes))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Consolidated metadata")
            zarr.consolidate_metadata(str(self.path))


def completed_points(path: Path) -> np.ndarray:
    """Which points of a batch store are complete (their entries written): what readers may take."""
    return open_store_array(path, "entry")[...] != ""


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
