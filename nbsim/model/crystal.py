"""Crystal lattice: unit cell → real and reciprocal vectors, misset, size, mosaic domains and phi steps.

The arithmetic follows nanoBragg step by step (including its construction of c* and the
regeneration of the real cell from the reciprocal one), because that sequence is what makes a
triclinic cell print and diffract exactly as the reference does.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..config import CrystalConfig, Scalar, check_cell, scalar_value
from ..errors import NbsimError
from ..rng import Ran1, cap_rotation, matrix_to_misset_rad
from ..vectors import as_float64, cross, dot, norm, radians, rotate_about_axis, rotate_xyz


@dataclass
class Lattice:
    """Real (Å) and reciprocal (Å⁻¹) cell vectors as rows of 3×3 tensors, before any phi or mosaic."""

    real_A: torch.Tensor
    reciprocal_per_A: torch.Tensor
    volume_A3: torch.Tensor
    misset_rad: tuple[float, float, float] | None

    def cell_parameters(self) -> tuple[float, ...]:
        """a, b, c (Å), alpha, beta, gamma (degrees) of the real cell, as nanoBragg prints them."""
        return _cell_parameters(self.real_A, self.reciprocal_per_A, self.volume_A3)

    def reciprocal_parameters(self) -> tuple[float, ...]:
        """The reciprocal cell's a*, b*, c* (Å⁻¹) and angles (degrees)."""
        return _cell_parameters(self.reciprocal_per_A, self.real_A, 1.0 / self.volume_A3)


def _cell_parameters(vectors: torch.Tensor, dual: torch.Tensor, volume: torch.Tensor) -> tuple[float, ...]:
    lengths = norm(vectors).detach()
    dual_lengths = norm(dual).detach()
    angles = []
    for i, (j, k) in enumerate(((1, 2), (0, 2), (0, 1))):
        sin_angle = min(1.0, max(-1.0, scalar_value(dual_lengths[i] * volume / lengths[j] / lengths[k])))
        cos_angle = scalar_value(dot(vectors[j], vectors[k]) / lengths[j] / lengths[k])
        cos_angle = 1.0 if cos_angle * cos_angle > 1.0 else cos_angle
        angles.append(math.degrees(math.atan2(sin_angle, cos_angle)))
    return (*[float(v) for v in lengths], *angles)


def reciprocal_from_cell(cell_A_deg: tuple[Scalar, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """nanoBragg's default orientation of the reciprocal cell: a* along x, b* in the xy plane.

    Returns the reciprocal vectors (rows), the real cell lengths and the cell volume.
    """
    a, b, c, alpha, beta, gamma = (as_float64(v) for v in cell_A_deg)
    b = torch.where(b <= 0, a, b)
    c = torch.where(c <= 0, a, c)
    alpha, beta, gamma = (torch.where(x <= 0, torch.full_like(x, math.pi / 2), radians(x))
                          for x in (alpha, beta, gamma))
    half_sum = (alpha + beta + gamma) / 2
    skew = torch.abs(torch.sin(half_sum) * torch.sin(half_sum - alpha) * torch.sin(half_sum - beta)
                     * torch.sin(half_sum - gamma))
    volume = 2.0 * a * b * c * torch.sqrt(skew)
    if scalar_value(volume) <= 0.0:
        raise NbsimError(f"impossible unit cell: volume {scalar_value(volume):g} A^3")
    a_star = b * c * torch.sin(alpha) / volume
    b_star = c * a * torch.sin(beta) / volume
    c_star = a * b * torch.sin(gamma) / volume
    sin_gamma_star = torch.clamp(c / volume / a_star / b_star, -1.0, 1.0)
    cos_alpha_star = _clamp_cos((torch.cos(beta) * torch.cos(gamma) - torch.cos(alpha))
                                / (torch.sin(beta) * torch.sin(gamma)))
    cos_beta_star = _clamp_cos((torch.cos(gamma) * torch.cos(alpha) - torch.cos(beta))
                               / (torch.sin(gamma) * torch.sin(alpha)))
    cos_gamma_star = _clamp_cos((torch.cos(alpha) * torch.cos(beta) - torch.cos(gamma))
                                / (torch.sin(alpha) * torch.sin(beta)))
    zero = torch.zeros_like(a)
    reciprocal = torch.stack([
        torch.stack([a_star, zero, zero]),
        torch.stack([b_star * cos_gamma_star, b_star * sin_gamma_star, zero]),
        torch.stack([c_star * cos_beta_star,
                     c_star * (cos_alpha_star - cos_beta_star * cos_gamma_star) / sin_gamma_star,
                     c_star * volume / (a * b * c * sin_gamma_star)]),
    ])
    return reciprocal, torch.stack([a, b, c]), volume


def _clamp_cos(value: torch.Tensor) -> torch.Tensor:
    """nanoBragg replaces an out-of-range cosine by +1 (whatever its sign)."""
    return torch.where(value * value > 1.0, torch.ones_like(value), value)


MISSET_RANDOM_CAP_DEG = 90.0
"""The spherical cap -misset random draws from. nanoBragg passes 90 where its rotation takes radians (a cap of 90
rad, many turns); `-physics corrected` passes 90 degrees."""


def build_lattice(config: CrystalConfig, wavelength_A: Scalar, generator: Ran1, corrected: bool = False) -> Lattice:
    """Real and reciprocal cell vectors after -cell/-mat and -misset, as nanoBragg derives them (`corrected`: the
    -misset random cap in degrees, see MISSET_RANDOM_CAP_DEG)."""
    mosflm_matrix = config.mosflm_matrix
    if config.cell_A_deg is None and mosflm_matrix is None:
        raise NbsimError("no crystal: give -cell a b c alpha beta gamma or -mat with a MOSFLM matrix")
    reciprocal = cell_lengths = cell_volume = None
    if config.cell_A_deg is not None:
        check_cell(config.cell_A_deg)
        reciprocal, cell_lengths, cell_volume = reciprocal_from_cell(config.cell_A_deg)
    if mosflm_matrix is not None:
        matrix = torch.tensor(mosflm_matrix, dtype=torch.float64).reshape(3, 3)
        reciprocal = matrix.T / as_float64(wavelength_A)

    misset_rad = None
    if config.misset_random:
        seed = -(config.misset_seed if config.misset_seed is not None else int(time.time()))
        cap = math.radians(MISSET_RANDOM_CAP_DEG) if corrected else MISSET_RANDOM_CAP_DEG
        _, _, umat, _ = cap_rotation(generator, seed, cap)
        misset_rad = matrix_to_misset_rad(umat)
        angles = torch.tensor(misset_rad, dtype=torch.float64)
    elif config.misset_deg is not None:
        angles = radians(torch.stack([as_float64(v) for v in config.misset_deg]))
        misset_rad = tuple(float(v) for v in angles.detach())
    if misset_rad is not None:
        reciprocal = rotate_xyz(reciprocal, angles)

    b_cross_c = cross(reciprocal[1], reciprocal[2])
    c_cross_a = cross(reciprocal[2], reciprocal[0])
    a_cross_b = cross(reciprocal[0], reciprocal[1])
    if cell_volume is not None:
        b_cross_c = b_cross_c * (cell_lengths[0] / cell_volume / norm(b_cross_c))
        c_cross_a = c_cross_a * (cell_lengths[1] / cell_volume / norm(c_cross_a))
        a_cross_b = a_cross_b * (cell_lengths[2] / cell_volume / norm(a_cross_b))
        volume = cell_volume
    else:
        volume = 1.0 / dot(reciprocal[0], b_cross_c)
    real = torch.stack([b_cross_c, c_cross_a, a_cross_b]) * volume
    regenerated = torch.stack([cross(real[1], real[2]), cross(real[2], real[0]), cross(real[0], real[1])]) / volume
    return Lattice(real_A=real, reciprocal_per_A=regenerated, volume_A3=volume, misset_rad=misset_rad)


def cell_counts(config: CrystalConfig, lattice: Lattice) -> tuple[int, int, int]:
    """Na, Nb, Nc: from -N/-Na/-Nb/-Nc, or from the crystal size where one is given (at least 1).

    Sizes and cell lengths are converted to metres as nanoBragg converts them, because the ceiling
    of their ratio is often an integer in theory and rounding then decides the count.
    """
    lengths_m = norm(lattice.real_A.detach() * 1e-10)
    counts = []
    for n, size_mm, length_m in zip(config.n_cells, config.crystal_size_mm, lengths_m, strict=True):
        if size_mm > 0:
            n = math.ceil(size_mm / 1000 / float(length_m))
        counts.append(max(int(n), 1))
    return counts[0], counts[1], counts[2]


@dataclass
class PhiSampling:
    """Spindle rotation: start, step and count, after nanoBragg's automatic rules."""

    start_rad: float
    step_rad: float
    steps: int
    osc_rad: float

    def angles_rad(self) -> np.ndarray:
        """Every phi step's angle, radians."""
        return np.array([self.start_rad + self.step_rad * k for k in range(self.steps)])


def phi_sampling(config: CrystalConfig) -> PhiSampling:
    """-phi/-osc/-phistep/-phisteps with nanoBragg's defaults for whatever was left out."""
    start = radians(config.phi_start_deg)
    osc = -1.0 if config.osc_range_deg is None else radians(config.osc_range_deg)
    step = -1.0 if config.phi_step_deg is None else radians(config.phi_step_deg)
    steps = -1 if config.phi_steps is None else config.phi_steps
    if steps < 0:
        if osc < 0.0:
            steps, osc, step = (1, 0.0, 0.0) if step <= 0.0 else (2, step, step)
        elif step <= 0.0:
            steps, step = 2, osc / 2.0
        else:
            steps = math.ceil(osc / step)
    else:
        steps = max(steps, 1)
        if osc < 0.0:
            if step <= 0.0:
                osc = radians(1.0)
                step = osc / steps
            else:
                osc, steps = step, 2
        elif step < 0.0:
            step = osc / steps
    return PhiSampling(start_rad=start, step_rad=step, steps=steps, osc_rad=osc)


def effective_phi_rad(sampling: PhiSampling, corrected: bool = False) -> np.ndarray:
    """The spindle angle each phi step really uses.

    nanoBragg only rotates the crystal when phi is non-zero; a step at exactly zero reuses the
    orientation left by the previous step (cyclically, the last step of the previous pass).
    `corrected`: every step uses its own angle (fresh vectors at phi = 0).
    """
    angles = sampling.angles_rad()
    effective = angles.copy()
    if corrected or not np.any(angles != 0.0):
        return effective
    last_nonzero = angles[np.nonzero(angles)[0][-1]]
    previous = last_nonzero
    for k, angle in enumerate(angles):
        effective[k] = angle if angle != 0.0 else previous
        previous = effective[k]
    return effective


@dataclass
class MosaicDomains:
    """Unit rotation axes and angle fractions of the mosaic domains (domain 0 is the identity)."""

    axes: np.ndarray
    angle_fractions: np.ndarray
    spread_rad: torch.Tensor

    @property
    def count(self) -> int:
        """How many mosaic domains."""
        return len(self.axes)

    def matrices(self) -> torch.Tensor:
        """Rotation matrices (domains, 3, 3), differentiable in the spread. Each angle is the C's,
        spread·fraction in single precision (nanoBragg passes the spread as a float; the float64 product
        differs by up to 1e-7, which moved a fuzzed -printout_pixel I by up to 2e-7), unless the spread
        carries gradients: their finite-difference checks need the smooth float64 product."""
        spread_value = scalar_value(self.spread_rad)
        if spread_value <= 0.0:
            return torch.eye(3, dtype=torch.float64).expand(self.count, 3, 3)
        smooth = isinstance(self.spread_rad, torch.Tensor) and self.spread_rad.requires_grad
        mats = [torch.eye(3, dtype=torch.float64)]
        for axis, fraction in zip(self.axes[1:], self.angle_fractions[1:], strict=True):
            angle = (self.spread_rad * float(fraction) if smooth
                     else torch.tensor(float(np.float32(spread_value) * np.float32(fraction)), dtype=torch.float64))
            mats.append(_axis_angle_tensor(torch.as_tensor(axis, dtype=torch.float64), angle))
        return torch.stack(mats)


def _axis_angle_tensor(axis: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    basis = torch.eye(3, dtype=torch.float64)
    return torch.stack([rotate_about_axis(e, axis, angle) for e in basis], dim=1)


def default_warnings(config: CrystalConfig) -> list[str]:
    """What nanoBragg warns about when its rules replace a requested mosaic domain or unit cell count."""
    lines = []
    spread = None if config.mosaic_spread_deg is None else scalar_value(config.mosaic_spread_deg)
    domains = config.mosaic_domains
    if (domains is None or domains <= 0) and spread is not None and spread > 0:
        lines.append("finite mosaic spread but no domain count: using 10 mosaic domains")
    elif domains is not None and domains > 0 and (spread is None or spread < 0):
        lines.append("mosaic domains but no mosaic spread: using 1 mosaic domain")
    elif domains is not None and domains > 0 and spread == 0:
        lines.append("zero mosaic spread: using 1 mosaic domain")
    empty = [axis for axis, n, size in zip("abc", config.n_cells, config.crystal_size_mm, strict=True)
             if n <= 0 and size <= 0]
    if empty:
        lines.append(f"no unit cells along {', '.join(empty)} (-N 0): rendering one cell along "
                     f"{'it' if len(empty) == 1 else 'each'}, as nanoBragg does")
    return lines


def mosaic_domain_count(config: CrystalConfig) -> int:
    """Mosaic domains after nanoBragg's defaults: 10 for a spread without a count, 1 without a spread."""
    spread_deg = -1.0 if config.mosaic_spread_deg is None else scalar_value(config.mosaic_spread_deg)
    count = -1 if config.mosaic_domains is None else config.mosaic_domains
    if count <= 0:
        return 10 if spread_deg > 0.0 else 1
    return count if spread_deg > 0.0 else 1


def mosaic_domains(config: CrystalConfig, generator: Ran1) -> MosaicDomains:
    """Spread and domain count with nanoBragg's defaults, orientations drawn as the C draws them."""
    spread = radians(as_float64(-1.0 if config.mosaic_spread_deg is None else config.mosaic_spread_deg))
    spread_value = scalar_value(spread)
    count = mosaic_domain_count(config)
    if spread_value < 0.0:
        spread = torch.zeros_like(spread)
        spread_value = 0.0
    seed = -config.mosaic_seed
    axes, fractions = [], []
    for _ in range(count):
        axis, fraction, _, seed = cap_rotation(generator, seed, spread_value)
        axes.append(axis)
        fractions.append(fraction)
    return MosaicDomains(axes=np.array(axes), angle_fractions=np.array(fractions), spread_rad=spread)


def oriented_cells(lattice: Lattice, phi: PhiSampling, spindle_axis: torch.Tensor,
                   mosaic: MosaicDomains, corrected: bool = False) -> torch.Tensor:
    """Real cell vectors for every (phi step, mosaic domain), shape (phi × domains, 3 vectors, 3)."""
    angles = torch.as_tensor(effective_phi_rad(phi, corrected), dtype=torch.float64)
    rotated = rotate_about_axis(lattice.real_A.unsqueeze(0), spindle_axis, angles.view(-1, 1))
    domain_mats = mosaic.matrices()
    cells = torch.einsum("mij,pvj->pmvi", domain_mats, rotated)
    return cells.reshape(-1, 3, 3)




