"""DIALS reflection tables (`.refl`: `strong.refl`, `indexed.refl`) as observed spots, read without DIALS.

A `.refl` is MessagePack (dials.array_family.flex's `as_msgpack`): the array ["dials::af::reflection_table",
version 1, {"identifiers": {id: experiment identifier}, "nrows": N, "data": {column: [type, [N, bytes]]}}],
each column's values packed little-endian (a `vec3<double>` as three float64 a row, an `int` as int32, a
`std::size_t` as uint64). The `msgpack` package unpacks the array (DIALS's format, not a parser of our own);
numpy reads the few columns a fit needs: `id` (the experiment of a spot; -1 unindexed), `panel` (the detector
panel it lies on, DIALS's index), `xyzobs.px.value` (the centroid, x along fast and y along slow in pixels from
the panel's first pixel's outer corner, z the frame) and `intensity.sum.value` (to keep the brightest). Other
columns are left packed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputFileError

TABLE_KIND = "dials::af::reflection_table"
COLUMN_TYPES = {"vec3<double>": ("<f8", 3), "double": ("<f8", 1), "int": ("<i4", 1), "std::size_t": ("<u8", 1),
                "bool": ("?", 1)}
"""The packed columns this reader unpacks: dtype and values per row."""


@dataclass(frozen=True)
class ReflectionTable:
    """The columns of a `.refl` a fit uses."""

    identifiers: dict[int, str]
    """The table's `id` → the experiment's identifier (the `identifier` of an experiment in the .expt)."""
    experiment_id: np.ndarray
    """(N,) int: which experiment each spot belongs to (-1: not indexed)."""
    centroid_px: np.ndarray
    """(N, 3): x (fast), y (slow) in pixels from its panel's first pixel's outer corner, and z (frame)."""
    intensity: np.ndarray
    """(N,) the summed intensity (counts; NaN where the table has no `intensity.sum.value`)."""
    panel: np.ndarray
    """(N,) int: the panel each spot lies on (0 where the table has no `panel` column)."""

    def spots(self, identifier: str | None, number: int, max_spots: int, multi_panel: bool = False) -> np.ndarray:
        """Centre pixels (row, col), or (panel, row, col) with `multi_panel`, of the brightest `max_spots` spots of
        one experiment: the rows whose `id` is the one the table gives the experiment's identifier, or, where
        the table names no identifiers, the experiment's position `number` in its list."""
        if self.identifiers:
            ids = [key for key, value in self.identifiers.items() if value == identifier]
            if not ids:
                return np.zeros((0, 2), dtype=np.int64)
            chosen = np.isin(self.experiment_id, ids)
        else:
            chosen = self.experiment_id == number
        centroid, intensity = self.centroid_px[chosen], self.intensity[chosen]
        order = np.argsort(-np.nan_to_num(intensity, nan=-np.inf), kind="stable")[:max_spots]
        pixels = np.floor(centroid[order][:, [1, 0]]).astype(np.int64)
        return np.column_stack([self.panel[chosen][order], pixels]) if multi_panel else pixels

    def covers(self, identifiers: Sequence[str | None]) -> bool:
        """Whether the table's experiments include any of these identifiers (or it names none: then its ids
        are positions in the experiment list)."""
        return not self.identifiers or bool(set(self.identifiers.values()) & set(identifiers))


def read_reflection_table(path: str | Path) -> ReflectionTable:
    """The `id`, `panel`, `xyzobs.px.value` and `intensity.sum.value` columns of a DIALS `.refl` (see the module's
    docstring); a missing, unreadable or malformed file is a one-line InputFileError."""
    import msgpack

    path = Path(path)
    try:
        document = msgpack.unpackb(path.read_bytes(), strict_map_key=False, raw=False)
    except FileNotFoundError:
        raise InputFileError(str(path), "no such file") from None
    except OSError as error:
        raise InputFileError(str(path), f"cannot be read ({error.strerror or error})") from None
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise InputFileError(str(path), f"not a DIALS reflection table (MessagePack: {error})") from None
    if not (isinstance(document, list) and len(document) == 3 and document[0] == TABLE_KIND
            and isinstance(document[2], dict)):
        raise InputFileError(str(path), f"not a DIALS reflection table (no {TABLE_KIND})")
    if document[1] != 1:
        raise InputFileError(str(path), f"a reflection table of version {document[1]} (this reader knows 1)")
    table = document[2]
    try:
        rows = int(table["nrows"])
        columns = table["data"]
        identifiers = {int(key): str(value) for key, value in (table.get("identifiers") or {}).items()}
        experiment_id = _column(columns, "id", rows).astype(np.int64)
        centroid = _column(columns, "xyzobs.px.value", rows)
        intensity = (_column(columns, "intensity.sum.value", rows) if "intensity.sum.value" in columns
                     else np.full(rows, np.nan))
        panel = _column(columns, "panel", rows).astype(np.int64) if "panel" in columns else np.zeros(rows, np.int64)
    except (KeyError, TypeError, ValueError) as error:
        raise InputFileError(str(path), f"a malformed reflection table ({error})") from None
    return ReflectionTable(identifiers, experiment_id, centroid, intensity, panel)


def _column(columns: dict, name: str, rows: int) -> np.ndarray:
    """One packed column as a numpy array: (rows,) or (rows, 3)."""
    if name not in columns:
        raise KeyError(f"no column {name!r}")
    kind, (count, data) = columns[name]
    if kind not in COLUMN_TYPES:
        raise ValueError(f"column {name!r} is of type {kind!r}, not one this reader unpacks")
    dtype, width = COLUMN_TYPES[kind]
    if int(count) != rows or len(data) != rows * width * np.dtype(dtype).itemsize:
        raise ValueError(f"column {name!r} holds {len(data)} bytes for {count} of {rows} rows")
    values = np.frombuffer(data, dtype=dtype)
    return values.reshape(rows, width) if width > 1 else values
