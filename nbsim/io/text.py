"""Strict readers for the small numeric text files nanoBragg takes (matrix, sources), numpy-free: the
command line reads them while parsing its arguments."""

from __future__ import annotations

import math
import re
from pathlib import Path

from ..errors import InputFileError

_SEPARATORS = re.compile(r"[ \t,;:!]+")
_C_FLOAT_PREFIX = re.compile(r"^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_C_INT_PREFIX = re.compile(r"^\s*[+-]?\d+")


def c_atof(text: str) -> float:
    """C's atof: the longest numeric prefix, inf/nan words, or 0."""
    match = _C_FLOAT_PREFIX.match(text)
    if match:
        return float(match.group(0))
    word = text.strip().lower().lstrip("+-")
    if word.startswith(("inf", "nan")):
        sign = -1.0 if text.strip().startswith("-") else 1.0
        return sign * (math.inf if word.startswith("inf") else math.nan)
    return 0.0


def c_atoi(text: str) -> int:
    """C's atoi: the leading integer of `text`, 0 when there is none (as nanoBragg reads flags)."""
    match = _C_INT_PREFIX.match(text)
    return int(match.group(0)) if match else 0


def read_text(path: str | Path) -> str:
    """Whole file as text, with a one-line error when it is missing or unreadable."""
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        raise InputFileError(str(path), "no such file") from None
    except IsADirectoryError:
        raise InputFileError(str(path), "is a directory, not a file") from None
    except UnicodeDecodeError:
        raise InputFileError(str(path), "not a text file") from None
    except OSError as error:
        raise InputFileError(str(path), error.strerror or "cannot be read") from None


def parse_number(token: str, path: str | Path, line_number: int) -> float:
    """A finite float, or an error naming the file, line and token."""
    try:
        value = float(token)
    except ValueError:
        raise InputFileError(str(path), f"'{token}' is not a number", line_number) from None
    if not math.isfinite(value):
        raise InputFileError(str(path), f"'{token}' is not a finite number", line_number)
    return value


def numeric_rows(path: str | Path, min_columns: int, max_columns: int) -> list[tuple[int, list[float]]]:
    """Non-blank lines split on nanoBragg's separators, each checked for its column count.

    Returns (line number, values) pairs; the line numbers are 1-based, for error messages.
    """
    rows = []
    for line_number, line in enumerate(read_text(path).splitlines(), start=1):
        tokens = [t for t in _SEPARATORS.split(line.strip()) if t]
        if not tokens:
            continue
        if not min_columns <= len(tokens) <= max_columns:
            expected = str(min_columns) if min_columns == max_columns else f"{min_columns} to {max_columns}"
            raise InputFileError(str(path), f"expected {expected} numbers, found {len(tokens)}", line_number)
        rows.append((line_number, [parse_number(t, path, line_number) for t in tokens]))
    return rows


def read_mosflm_matrix(path: str | Path) -> tuple[float, ...]:
    """The first nine numbers of a MOSFLM matrix file (A matrix, row by row); the rest is ignored."""
    tokens = read_text(path).split()[:9]
    if len(tokens) < 9:
        raise InputFileError(str(path), f"a MOSFLM matrix needs 9 numbers, found {len(tokens)}")
    values = []
    for index, token in enumerate(tokens):
        values.append(parse_number(token, path, index // 3 + 1))
    if _determinant_3x3(values) == 0.0:
        raise InputFileError(str(path), "the orientation matrix is singular")
    return tuple(values)


def read_source_file(path: str | Path) -> tuple[tuple[float | None, ...], ...]:
    """Source file rows: X Y Z (m, position of the source), weight, wavelength (m); a missing column is
    None (nanoBragg's default for it), so the rows stay plain, comparable, JSON-able values."""
    rows = numeric_rows(path, 1, 5)
    if not rows:
        raise InputFileError(str(path), "no sources in file")
    sources = []
    for line_number, values in rows:
        padded = values + [None] * (5 - len(values))
        if len(values) == 5 and values[4] <= 0:
            raise InputFileError(str(path), f"wavelength {values[4]:g} m must be positive", line_number)
        sources.append(tuple(padded))
    return tuple(sources)


HC_EV_A = 12398.42
"""h·c in eV·Å, nanoBragg's constant for -energy."""
_SPECTRUM_HEADERS = {("wavelength_a", "weight"): False, ("energy_ev", "weight"): True}


def read_spectrum_file(path: str | Path) -> tuple[tuple[float, float], ...]:
    """A -spectrumfile: one channel per line, wavelength (Å) and weight; text after '#' is a comment.
    Before the first channel, a header naming the columns may say the unit: `wavelength_A weight` (the
    default) or `energy_eV weight` (eV, converted with nanoBragg's h·c = 12398.42 eV·Å), with or without
    a leading '#'. Returns (wavelength_A, weight) rows: every wavelength or energy positive, every weight
    non-negative, their sum positive."""
    lines = read_text(path).splitlines()
    in_eV = False
    channels = []
    header_allowed = True
    for line_number, line in enumerate(lines, start=1):
        words = line.replace("#", " # ", 1).split()
        if not words:
            continue
        named = tuple(word.lower() for word in words if word != "#")
        if header_allowed and named in _SPECTRUM_HEADERS:
            in_eV = _SPECTRUM_HEADERS[named]
            header_allowed = False
            continue
        tokens = [t for t in _SEPARATORS.split(line.split("#", 1)[0].strip()) if t]
        if not tokens:
            continue
        header_allowed = False
        if len(tokens) != 2:
            unit = "energy (eV)" if in_eV else "wavelength (A)"
            raise InputFileError(str(path), f"expected 2 numbers, {unit} and weight, found {len(tokens)}",
                                 line_number)
        value, weight = (parse_number(t, path, line_number) for t in tokens)
        if value <= 0:
            what = f"energy {value:g} eV" if in_eV else f"wavelength {value:g} A"
            raise InputFileError(str(path), f"{what} must be positive", line_number)
        if weight < 0:
            raise InputFileError(str(path), f"weight {weight:g} must not be negative", line_number)
        channels.append((HC_EV_A / value if in_eV else value, weight))
    if not channels:
        raise InputFileError(str(path), "no spectrum channels in file")
    if sum(weight for _, weight in channels) <= 0:
        raise InputFileError(str(path), "the weights sum to 0")
    return tuple(channels)


def _determinant_3x3(values: list[float]) -> float:
    """The determinant of a 3×3 matrix given row by row."""
    a, b, c, d, e, f, g, h, i = values
    return a * (e * i - f * h) - b * (d * i - f * g) + c * (d * h - e * g)
