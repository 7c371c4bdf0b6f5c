"""The large input files nanoBragg takes, HKL lists (nanoBragg's text, MTZ or sf-mmCIF), atomic models
(-model) and SMV masks, each read strictly with a one-line error naming the file (line and token, or
column, where known), by `resolve.resolve`. The small ones (MOSFLM matrices, source lists) are read when the
arguments are parsed, by nbsim.io.text's numpy-free readers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InputFileError
from .images import read_smv
from .paths import require_file
from .structure_files import AtomicModel, ReflectionTable, hkl_format, read_model, read_reflection_file

if TYPE_CHECKING:
    from ..config import SimulationConfig


@dataclass(frozen=True)
class InputFiles:
    """The contents of the large files a configuration names (None where it names none): tables read when
    a render is set up. The small ones (-mat, -sourcefile) are read into the configuration itself when
    the arguments are parsed."""

    hkl: ReflectionTable | None
    """The -hkl table over the full P1 sphere."""
    mask: np.ndarray | None
    """(slow, fast) booleans, True where a pixel is rendered."""
    model: AtomicModel | None
    """The -model's cell and atom count, checked (its |F| depend on the detector: setup computes them)."""


def input_file_paths(config: SimulationConfig) -> dict[str, str | None]:
    """The large input files a configuration names (-hkl, -mask, -model), by InputFiles field."""
    return {"hkl": config.structure.hkl_file, "mask": config.detector.mask_file,
            "model": config.structure.model_file}


def read_input_file(field: str, config: SimulationConfig) -> ReflectionTable | AtomicModel | np.ndarray:
    """The input file of one InputFiles field that `config` names, read strictly by its reader."""
    path = input_file_paths(config)[field]
    if field == "hkl":
        return read_reflection_file(path, config.structure.column)
    return {"mask": read_mask, "model": read_model}[field](path)


def read_input_files(config: SimulationConfig) -> InputFiles:
    """Read every large input file the configuration names, each strictly."""
    return InputFiles(**{field: read_input_file(field, config) if path else None
                         for field, path in input_file_paths(config).items()})


def structure_file_cell(config: SimulationConfig) -> tuple[float, ...] | None:
    """The unit cell of the -model, or of an MTZ or mmCIF -hkl file (asked when neither -cell nor -mat is
    given, so a file without one is an error); None for a text table or no file."""
    structure = config.structure
    path = structure.model_file or structure.hkl_file
    if path is None:
        return None
    require_file(path)
    if structure.model_file:
        return read_model(path).cell_A_deg
    if hkl_format(path) == "text":
        return None
    cell = read_reflection_file(path, structure.column).cell_A_deg
    if cell is None:
        raise InputFileError(str(path), "the file gives no unit cell: give -cell or -mat")
    return cell


def read_mask(path: str | Path) -> np.ndarray:
    """(slow, fast) booleans from an SMV mask: True where the pixel is rendered (non-zero in the file)."""
    _, data = read_smv(Path(path))
    return data != 0
