"""Sensor materials: the attenuation length of a detector's sensor at a wavelength, so that a sensor given a
thickness absorbs as the material does (and as processing software models its parallax).

The mass attenuation coefficients μ/ρ are NIST's (Hubbell & Seltzer, X-Ray Mass Attenuation Coefficients,
NIST Standard Reference Database 126), as cctbx's `cctbx.eltbx.attenuation_coefficient` tables hold them
with their densities: the tables dxtbx (DIALS) takes a sensor's μ from. They are copied for 1-200 keV
(docs/detector.md has the command that prints them) and interpolated log-log, as NIST's tables are meant
to be read; an absorption edge is listed twice (below, then above it)."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from .errors import NbsimError

HC_EV_A = 12398.42
"""Photon energy × wavelength, eV·Å (nanoBragg's constant)."""


@dataclass(frozen=True)
class SensorMaterial:
    """A sensor material: the name processing software knows it by, its density and NIST's μ/ρ."""

    name: str
    header_name: str
    """How the miniCBF header names it (`Silicon sensor, thickness ...`, `CdTe sensor, ...`)."""
    density_g_cm3: float
    mu_rho_cm2_g: tuple[tuple[float, float], ...]
    """(photon energy in keV, μ/ρ in cm²/g), energies ascending."""

    def attenuation_length_um(self, wavelength_A: float) -> float:
        """The 1/e attenuation length 1/μ at this wavelength, µm."""
        energy_keV = HC_EV_A / wavelength_A / 1000.0
        energies = [e for e, _ in self.mu_rho_cm2_g]
        if not energies[0] <= energy_keV <= energies[-1]:
            raise NbsimError(f"no {self.name} attenuation table at {wavelength_A:g} A ({energy_keV:.3g} keV; the table "
                             f"spans {energies[0]:g}-{energies[-1]:g} keV): give -detector_abs")
        upper = min(bisect.bisect_right(energies, energy_keV), len(energies) - 1)
        (e0, m0), (e1, m1) = self.mu_rho_cm2_g[upper - 1], self.mu_rho_cm2_g[upper]
        fraction = math.log(energy_keV / e0) / math.log(e1 / e0)
        mu_rho = math.exp(math.log(m0) + fraction * math.log(m1 / m0))
        return 1e4 / (mu_rho * self.density_g_cm3)


MATERIALS: dict[str, SensorMaterial] = {m.name: m for m in (
    SensorMaterial("Si", "Silicon", 2.33, (
        (1, 1570), (1.5, 535.5), (1.8389, 309.2), (1.8389, 3192), (2, 2777), (3, 978.4), (4, 452.9), (5, 245),
        (6, 147), (8, 64.68), (10, 33.89), (15, 10.34), (20, 4.464), (30, 1.436), (40, 0.7012), (50, 0.4385),
        (60, 0.3207), (80, 0.2228), (100, 0.1835), (150, 0.1448), (200, 0.1275))),
    SensorMaterial("CdTe", "CdTe", 6.2, (
        (1, 7927), (1.003, 7875), (1.006, 7824), (1.006, 8014), (1.5, 3291), (2, 1664), (3, 614.6),
        (3.537, 406.4), (3.537, 778.7), (3.631, 730), (3.727, 684), (3.727, 860.1), (4, 723), (4.018, 715.1),
        (4.018, 793.4), (4.177, 722.1), (4.341, 656.2), (4.341, 932.8), (4.475, 873.9), (4.612, 813.5),
        (4.612, 943.8), (4.773, 870.2), (4.939, 799.9), (4.939, 865.3), (5, 839.2), (6, 528.6), (8, 249.2),
        (10, 138.1), (15, 46.57), (20, 21.44), (26.711, 9.834), (26.711, 29.43), (30, 21.82), (31.814, 18.73),
        (31.814, 34.92), (40, 19.3), (50, 10.67), (60, 6.542), (80, 3.019), (100, 1.671), (150, 0.6071),
        (200, 0.3246))),
)}
DEFAULT_MATERIAL = "Si"


def sensor_material(name: str) -> SensorMaterial:
    """The named material, or a one-line error listing the known ones."""
    if name not in MATERIALS:
        raise NbsimError(f"unknown sensor material '{name}' (known: {', '.join(MATERIALS)})")
    return MATERIALS[name]
