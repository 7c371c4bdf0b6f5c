"""The amorphous background as simtbx's `add_background` computes it: F against sin(θ)/λ (a scattering curve),
the number of molecules the beam crosses, and the photons each pixel receives (docs/physics.md, Background).

Each pixel receives `r_e²·fluence·molecules·Σ_s ŵ_s·sign(F)·F(stol_s)²·polar_s·ω·capture` photons, ŵ_s the
sources' weights summing to 1, F interpolated by simtbx's four-point polynomial (`polint`) between the curve's
points after its padding (two points at each end carry the end values out to ±1e98 and ±1e99 Å⁻¹), and
`molecules = thickness·beamsize²·density·N_A/molecular weight`. Linear in fluence, and independent of the
sampling (it is evaluated once per pixel, at the pixel centre). Torch-free set-up; the per-pixel evaluation is
nbsim.kernel.background.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import BeamConfig
from ..errors import InputFileError, NbsimError

AVOGADRO = 6.02214179e23
R_E_SQR_M2 = 7.94079248018965e-30

WATER_CURVE = ((0.0, 2.57), (0.0365, 2.58), (0.07, 2.8), (0.12, 5.0), (0.162, 8.0), (0.18, 7.32), (0.2, 6.75),
               (0.216, 6.75), (0.236, 6.5), (0.28, 4.5), (0.3, 4.3), (0.345, 4.36), (0.436, 3.77), (0.5, 3.17))
"""simtbx's water: sin(θ)/λ (Å⁻¹) and F (electrons per molecule), as its `sim_background` defaults to."""
AIR_CURVE = ((0.0, 14.1), (0.045, 13.5), (0.174, 8.35), (0.35, 4.78), (0.5, 4.22))
"""simtbx's air (its `add_air` path)."""
NAMED_CURVES = {"water": (WATER_CURVE, 1.0, 18.0), "air": (AIR_CURVE, 1.2e-3, 14.0)}
"""name → (curve, density g/cm³, molecular weight g/mol)."""
FILE_DEFAULTS = (1.0, 18.0)
"""Density and molecular weight of a curve read from a file unless given (water's)."""
WATER_F = 2.57
WATER_MW = 18.0


@dataclass(frozen=True)
class BackgroundCurve:
    """A padded scattering curve and the photons per electron² and steradian it scales to."""

    stol_per_A: np.ndarray
    """sin(θ)/λ of the padded curve, ascending, Å⁻¹."""
    F: np.ndarray
    scale: float
    """r_e² · fluence · molecules in the beam."""


def padded_curve(rows: tuple[tuple[float, float], ...] | list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """simtbx's padding of a curve: two points at each end, at ∓1e99 and ∓1e98 Å⁻¹, carrying the end values,
    so that four-point interpolation near the ends extrapolates them."""
    stol = np.array([row[0] for row in rows], np.float64)
    F = np.array([row[1] for row in rows], np.float64)
    return (np.concatenate([[-1e99, -1e98], stol, [1e98, 1e99]]),
            np.concatenate([[F[0], F[0]], F, [F[-1], F[-1]]]))


def read_curve(path: str) -> tuple[tuple[float, float], ...]:
    """A curve file: rows of sin(θ)/λ (Å⁻¹) and F (text after '#' and blank lines skipped), at least two,
    sin(θ)/λ strictly ascending."""
    from ..io.text import read_text

    rows = []
    for line_number, line in enumerate(read_text(path).splitlines(), start=1):
        tokens = line.split("#", 1)[0].replace(",", " ").split()
        if not tokens:
            continue
        try:
            values = [float(token) for token in tokens]
        except ValueError:
            raise InputFileError(path, f"expected sin(theta)/lambda and F, found {' '.join(tokens)!r}",
                                 line_number) from None
        if len(values) != 2:
            raise InputFileError(path, f"expected 2 numbers, sin(theta)/lambda and F, found {len(values)}",
                                 line_number)
        rows.append((values[0], values[1]))
    check_curve(tuple(rows), path)
    return tuple(rows)


def check_curve(rows: tuple[tuple[float, float], ...], path: str) -> None:
    """A curve needs two points or more, finite, at sin(θ)/λ ascending and not negative."""
    if len(rows) < 2:
        raise InputFileError(path, f"a scattering curve needs at least two points of sin(theta)/lambda and F "
                                   f"(found {len(rows)})")
    stol = np.array([row[0] for row in rows])
    if not np.all(np.isfinite(np.array(rows))):
        raise InputFileError(path, "the curve's values must be finite")
    if stol[0] < 0 or np.any(np.diff(stol) <= 0):
        raise InputFileError(path, "sin(theta)/lambda must ascend from 0 or above, each row above the last")


def background_curve(beam: BeamConfig, fluence: float, corrected: bool) -> BackgroundCurve | None:
    """The curve a render adds: -background's (water, air or a file), or, under -physics corrected, -water's
    constant F = 2.57 over nanoBragg's water volume (its -water µm cubed, 1 g/cm³, 18 g/mol); None without."""
    if beam.background is None:
        if not (corrected and beam.water_thickness_um > 0):
            return None
        water_m = beam.water_thickness_um * 1e-6
        molecules = water_m ** 3 * 1e6 * AVOGADRO / WATER_MW
        stol, F = padded_curve(((0.0, WATER_F), (1.0, WATER_F)))
        return BackgroundCurve(stol, F, R_E_SQR_M2 * fluence * molecules)
    check_background(beam)
    if beam.background in NAMED_CURVES:
        rows, density, molecular_weight = NAMED_CURVES[beam.background]
    else:
        rows, (density, molecular_weight) = read_curve(beam.background), FILE_DEFAULTS
    density = beam.background_density_g_cm3 if beam.background_density_g_cm3 is not None else density
    if beam.background_molecular_weight is not None:
        molecular_weight = beam.background_molecular_weight
    beamsize_m = beam.beamsize_mm * 1e-3
    molecules = beam.background_thickness_mm * 1e-3 * beamsize_m ** 2 * density * 1e6 * AVOGADRO / molecular_weight
    stol, F = padded_curve(rows)
    return BackgroundCurve(stol, F, R_E_SQR_M2 * fluence * molecules)


def check_background(beam: BeamConfig) -> None:
    """One-line errors for a second background beside -water, and the material's thickness, density, molecular
    weight and beam size."""
    if beam.water_thickness_um > 0:
        raise NbsimError("-background and -water both add a background: use one")
    if not (beam.background_thickness_mm > 0 and np.isfinite(beam.background_thickness_mm)):
        raise NbsimError(f"-background {beam.background} needs a thickness above 0 (-background_thick MM, "
                         f"got {beam.background_thickness_mm:g})")
    for name, value in (("-background_density", beam.background_density_g_cm3),
                        ("-background_mw", beam.background_molecular_weight)):
        if value is not None and not (value > 0 and np.isfinite(value)):
            raise NbsimError(f"{name} must be above 0 (got {value:g})")
    if not beam.beamsize_mm > 0:
        raise NbsimError(f"-background needs a beam size above 0 (-beamsize, got {beam.beamsize_mm:g})")
