"""The input files nanoBragg takes besides images: HKL lists, MOSFLM orientation matrices and source lists,
each read strictly with a one-line error naming the file, line and token."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..errors import InputFileError
from .text import numeric_rows, parse_number, read_text


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
