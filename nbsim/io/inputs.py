"""The large input files nanoBragg takes, HKL lists and SMV masks, each read strictly with a one-line error
naming the file, line and token, by `setup.resolve`. The small ones (MOSFLM matrices, source lists) are
read when the arguments are parsed, by nbsim.io.text's numpy-free readers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InputFileError
from .images import read_smv
from .text import numeric_rows

if TYPE_CHECKING:
    from ..config import SimulationConfig


@dataclass(frozen=True)
class InputFiles:
    """The contents of the large files a configuration names (None where it names none): tables read when
    a render is set up. The small ones (-mat, -sourcefile) are read into the configuration itself when
    the arguments are parsed."""

    hkl: np.ndarray | None
    """(reflections, 4): h, k, l, F."""
    mask: np.ndarray | None
    """(slow, fast) booleans, True where a pixel is rendered."""


def input_file_paths(config: SimulationConfig) -> dict[str, str | None]:
    """The large input files a configuration names (-hkl, -mask), by InputFiles field."""
    return {"hkl": config.structure.hkl_file, "mask": config.detector.mask_file}


def read_input_file(field: str, path: str | Path) -> np.ndarray:
    """One input file, read strictly by the reader of its InputFiles field."""
    readers = {"hkl": read_hkl, "mask": read_mask}
    return readers[field](path)


def read_input_files(config: SimulationConfig) -> InputFiles:
    """Read every large input file the configuration names, each strictly."""
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


def read_mask(path: str | Path) -> np.ndarray:
    """(slow, fast) booleans from an SMV mask: True where the pixel is rendered (non-zero in the file)."""
    _, data = read_smv(Path(path))
    return data != 0
