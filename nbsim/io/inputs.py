"""The input files nanoBragg takes: HKL lists, MOSFLM orientation matrices, source lists and SMV masks,
each read strictly with a one-line error naming the file, line and token."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InputFileError
from .images import read_smv
from .text import numeric_rows, parse_number, read_text

if TYPE_CHECKING:
    from ..config import SimulationConfig


@dataclass(frozen=True)
class InputFiles:
    """The contents of the files a configuration names (None where it names none)."""

    hkl: np.ndarray | None
    """(reflections, 4): h, k, l, F."""
    mosflm_matrix: tuple[float, ...] | None
    sources: tuple[tuple[float, float, float, float, float], ...] | None
    mask: np.ndarray | None
    """(slow, fast) booleans, True where a pixel is rendered."""


def input_file_paths(config: SimulationConfig) -> dict[str, str | None]:
    """The input files a configuration names (-hkl, -mat, -sourcefile, -mask), by InputFiles field."""
    return {"hkl": config.structure.hkl_file, "mosflm_matrix": config.crystal.mosflm_matrix_file,
            "sources": config.beam.source_file, "mask": config.detector.mask_file}


def read_input_file(field: str, path: str | Path):
    """One input file, read strictly by the reader of its InputFiles field."""
    readers = {"hkl": read_hkl, "mosflm_matrix": read_mosflm_matrix, "sources": read_source_file,
               "mask": read_mask}
    return readers[field](path)


def read_input_files(config: SimulationConfig) -> InputFiles:
    """Read every input file the configuration names, each strictly."""
    return InputFiles(**{field: read_input_file(field, path) if path else None
                         for field, path in input_file_paths(config).items()})


def read_hkl(path: str | Path) -> np.ndarray:
    """Rows of h, k, l, F from a text file; indices must be integers, F a finite number."""
    rows = numeric_rows(path, 4, 4)
    if not rows:
        raise InputFileError(str(path), "no reflections in file")
    for line_number, (h, k, l, _) in rows:
        if h != round(h) or k != round(k) or l != round(l):
            raise InputFileError(str(path), f"Miller indices must be integers (got {h:g} {k:g} {l:g})",
                                 line_number)
    return np.array([values for _, values in rows], dtype=np.float64)


def read_mosflm_matrix(path: str) -> tuple[float, ...]:
    """The first nine numbers of a MOSFLM matrix file (A matrix, row by row); the rest is ignored."""
    tokens = read_text(path).split()[:9]
    if len(tokens) < 9:
        raise InputFileError(str(path), f"a MOSFLM matrix needs 9 numbers, found {len(tokens)}")
    values = []
    for index, token in enumerate(tokens):
        values.append(parse_number(token, path, index // 3 + 1))
    if abs(np.linalg.det(np.array(values).reshape(3, 3))) == 0.0:
        raise InputFileError(str(path), "the orientation matrix is singular")
    return tuple(values)


def read_source_file(path: str | Path) -> tuple[tuple[float, float, float, float, float], ...]:
    """Source file rows: X Y Z (m, position of the source), weight, wavelength (m); missing → NaN."""
    rows = numeric_rows(path, 1, 5)
    if not rows:
        raise InputFileError(str(path), "no sources in file")
    sources = []
    for line_number, values in rows:
        padded = values + [math.nan] * (5 - len(values))
        if len(values) == 5 and values[4] <= 0:
            raise InputFileError(str(path), f"wavelength {values[4]:g} m must be positive", line_number)
        sources.append(tuple(padded))
    return tuple(sources)


def read_mask(path: str | Path) -> np.ndarray:
    """(slow, fast) booleans from an SMV mask: True where the pixel is rendered (non-zero in the file)."""
    _, data = read_smv(Path(path))
    return data != 0
