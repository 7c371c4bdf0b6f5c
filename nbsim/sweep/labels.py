"""A dataset's labels: what a point was drawn with (planning) and what its images hold (its batch job).

`drawn_labels` (torch-free, at planning): the draw's index, every drawn value (a flag's by its axis name,
`N`, `lambda`; the orientation as `misset_x_deg`, `misset_y_deg`, `misset_z_deg`; a `sase` spectrum as
`spectrum_mean_A` and `spectrum_weight_000` ...) and its seeds
(`noise_seed`, `mosaic_seed`, `misset_seed`, `calibration_seed`). `rendered_labels` (in the job): the A
matrix used (`A_00` .. `A_22`: rows x, y, z of the matrix whose columns are a*, b*, c* in Å⁻¹, after the
misset, before phi and mosaic), the wavelength, the resolution at the detector's farthest corner (Å), the
mosaic domains and φ steps rendered (`mosaic_domains`, `phi_steps`: a shot's own under -sampling advised) and
the image statistics (total photons, maximum, overloads).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import spectrum_mean_wavelength_A
from .draws import RANDOM_ORIENTATION, SPECTRUM, Draw

if TYPE_CHECKING:
    from ..config import SimulationConfig

OVERLOAD_ADU = 65535.0
"""nanoBragg's integer-image ceiling: a pixel at or above it is an overload."""
A_COLUMNS = tuple(f"A_{row}{column}" for row in range(3) for column in range(3))


def drawn_labels(draw: Draw | None) -> dict[str, Any]:
    """The draw's index, values and seeds as label columns ({} without a draw)."""
    if draw is None:
        return {}
    labels: dict[str, Any] = {"draw": draw.index}
    for key, value in draw.values:
        if key == RANDOM_ORIENTATION:
            labels.update(zip(("misset_x_deg", "misset_y_deg", "misset_z_deg"), value, strict=True))
        elif key == SPECTRUM:
            labels.update(spectrum_labels(value))
        else:
            labels[key.lstrip("-")] = value
    labels.update({f"{name}_seed": seed for name, seed in draw.seeds})
    return labels


def spectrum_labels(spectrum: tuple[tuple[float, float], ...]) -> dict[str, float]:
    """A drawn spectrum as label columns: its weighted mean wavelength and each channel's weight
    (`spectrum_weight_000`, ...; the channels' wavelengths are the draw's grid, kept in the point's record)."""
    return {"spectrum_mean_A": spectrum_mean_wavelength_A(spectrum),
            **{f"spectrum_weight_{index:03d}": weight for index, (_, weight) in enumerate(spectrum)}}


def rendered_labels(config: SimulationConfig) -> dict[str, float]:
    """The A matrix actually used, λ, the corner resolution and the mosaic domains and φ steps rendered (what
    -sampling advised chose for the shot), from the point's configuration (the lattice and geometry
    nanoBragg's set-up derives, float64)."""
    from ..config import scalar_value
    from ..model.crystal import build_lattice, mosaic_domain_count, phi_sampling
    from ..model.geometry import build_geometry
    from ..rng import Ran1

    wavelength_A = scalar_value(config.beam.wavelength_A)
    lattice = build_lattice(config.crystal, wavelength_A, Ran1(), config.corrected)
    a_matrix = lattice.reciprocal_per_A.detach().double().T.reshape(-1).tolist()
    return {**dict(zip(A_COLUMNS, a_matrix, strict=True)), "wavelength_A": wavelength_A,
            "corner_resolution_A": corner_resolution_A(config, wavelength_A, build_geometry),
            "mosaic_domains": mosaic_domain_count(config.crystal), "phi_steps": phi_sampling(config.crystal).steps}


def corner_resolution_A(config: SimulationConfig, wavelength_A: float, build_geometry) -> float:
    """d = λ / (2 sin θ) at the detector corner of largest scattering angle 2θ."""
    geometry = build_geometry(config.detector)
    origin = geometry.pix0_m.detach().double()
    fast = geometry.fdet.detach().double() * geometry.pixels_f * geometry.pixel_size_m
    slow = geometry.sdet.detach().double() * geometry.pixels_s * geometry.pixel_size_m
    beam = geometry.beam.detach().double()
    cosines = [float((corner @ beam) / corner.norm()) for corner in
               (origin, origin + fast, origin + slow, origin + fast + slow)]
    theta = math.acos(max(-1.0, min(1.0, min(cosines)))) / 2
    return wavelength_A / (2 * math.sin(theta)) if theta > 0 else math.inf


def image_statistics(image: np.ndarray, detector_image: np.ndarray | None = None) -> dict[str, float]:
    """Total photons and maximum of the noise-free image; overloads: pixels of the detector image (without
    one, of the noise-free image in photons) at or above 65535."""
    counted = image if detector_image is None else detector_image
    return {"total_photons": float(np.sum(image, dtype=np.float64)), "max_photons": float(np.max(image)),
            "overloads": int(np.count_nonzero(counted >= OVERLOAD_ADU))}
