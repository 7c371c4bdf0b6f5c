"""The sweep's files: JSON records and zarr stores, each written atomically.

Stores are zarr (format 3) groups with xarray's dimension names, so `xr.open_zarr` reads them. They are
written array by array into `<name>.partial-<pid>` beside their final path and renamed into place when
complete: readers never see a partial store, a job killed mid-write leaves only a `.partial-*` folder
that nothing reads (the next write of the same store removes it), and memory stays bounded by what one
write holds.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np


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
