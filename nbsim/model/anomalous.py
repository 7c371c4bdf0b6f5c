"""Anomalous scattering of a -model (docs/physics.md, Anomalous scattering): f′ and f″ of each element at each
wavelength the render uses (gemmi's Cromer–Liberman, or the user's `-fp_fdp` table), the channels the sources
fall into (one per distinct wavelength, or per energy bin), and one full-sphere P1 table per channel."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import InputFileError, NbsimError
from ..io.structure_files import ReflectionTable, anomalous_model_tables, model_partials

HC_EV_A = 12398.419843320026
"""h·c in eV·Å: energy_eV = HC_EV_A / wavelength_A."""

FactorTable = dict[str, tuple[tuple[float, float, float], ...]]
"""element → rows of (energy eV, f′, f″), ascending in energy."""


@dataclass(frozen=True)
class Channels:
    """The structure-factor channels of a render: each channel's energy and each source's channel."""

    energies_eV: np.ndarray
    source_channel: np.ndarray


def source_channels(wavelengths_A: np.ndarray, bins: int | None) -> Channels:
    """One channel per distinct source wavelength, or, with `bins`, per energy bin of equal width between the
    lowest and highest energy (a bin's energy: the mean of its sources'; empty bins are dropped)."""
    energies = HC_EV_A / np.asarray(wavelengths_A, np.float64)
    if bins is None:
        unique, inverse = np.unique(energies, return_inverse=True)
        return Channels(unique, inverse.astype(np.int64))
    if bins < 1:
        raise NbsimError(f"-energy_bins must be at least 1 (got {bins})")
    low, high = energies.min(), energies.max()
    edges = np.linspace(low, high, bins + 1)
    index = np.clip(np.searchsorted(edges, energies, side="right") - 1, 0, bins - 1)
    used, inverse = np.unique(index, return_inverse=True)
    centres = np.array([energies[index == b].mean() for b in used])
    return Channels(centres, inverse.astype(np.int64))


def read_factor_table(path: str) -> FactorTable:
    """An -fp_fdp file: rows `element energy_eV f′ f″` (blank lines and # comments skipped)."""
    from ..io.text import read_text

    table: dict[str, list[tuple[float, float, float]]] = {}
    for line_number, line in enumerate(read_text(path).splitlines(), start=1):
        tokens = line.split("#", 1)[0].split()
        if not tokens:
            continue
        if len(tokens) != 4:
            raise InputFileError(path, f"expected element energy_eV f' f'' (4 values), found {len(tokens)}",
                                 line_number)
        try:
            energy, fp, fpp = (float(token) for token in tokens[1:])
        except ValueError:
            raise InputFileError(path, f"energy, f' and f'' must be numbers (got {' '.join(tokens[1:])})",
                                 line_number) from None
        if not (energy > 0 and math.isfinite(fp) and math.isfinite(fpp)):
            raise InputFileError(path, "the energy must be above 0 and f', f'' finite", line_number)
        table.setdefault(_element_name(tokens[0], path, line_number), []).append((energy, fp, fpp))
    if not table:
        raise InputFileError(path, "no rows of element energy_eV f' f''")
    return {element: tuple(sorted(rows)) for element, rows in table.items()}


def _element_name(token: str, path: str, line_number: int) -> str:
    import gemmi

    element = gemmi.Element(token)
    if element.atomic_number == 0:
        raise InputFileError(path, f"unknown element {token!r}", line_number)
    return element.name


def scattering_factors(elements: tuple[str, ...], energy_eV: float, table: FactorTable | None,
                       table_path: str | None = None) -> dict[str, tuple[float, float]]:
    """f′ and f″ of each element at `energy_eV`: from the table (linear in energy between its rows; an energy
    outside its rows is an error) for the elements it lists, else gemmi's Cromer–Liberman."""
    import gemmi

    factors = {}
    for element in elements:
        rows = (table or {}).get(element)
        if rows is None:
            factors[element] = gemmi.cromer_liberman(z=gemmi.Element(element).atomic_number, energy=energy_eV)
            continue
        energies = np.array([row[0] for row in rows])
        if not energies[0] * (1 - 1e-9) <= energy_eV <= energies[-1] * (1 + 1e-9):
            raise NbsimError(f"{table_path}: no f' and f'' of {element} at {energy_eV:.6g} eV (the table gives "
                             f"{energies[0]:g} to {energies[-1]:g} eV)")
        factors[element] = (float(np.interp(energy_eV, energies, [row[1] for row in rows])),
                            float(np.interp(energy_eV, energies, [row[2] for row in rows])))
    return factors


def channel_tables(model_file: str, d_min_A: float, channels: Channels,
                   table_path: str | None) -> list[ReflectionTable]:
    """One full-sphere |F| table of the model per channel, with each element's f′ and f″ at its energy."""
    partials = model_partials(model_file, d_min_A)
    table = read_factor_table(table_path) if table_path else None
    source = "f' f'' from " + (f"{table_path} (else Cromer-Liberman)" if table_path else "Cromer-Liberman")
    energies = [float(energy) for energy in channels.energies_eV]
    return anomalous_model_tables(
        partials, [scattering_factors(partials.elements, energy, table, table_path) for energy in energies],
        [f"model, |F(+)| and |F(-)| by direct summation to {d_min_A:.3g} A at {energy:.6g} eV, {source}"
         for energy in energies])
