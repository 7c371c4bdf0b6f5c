"""How a fit refines what it refines (the names are nbsim.fit.names'): the quantities' reparametrisation
(bounds by construction: positive quantities as logarithms), the unit cell's free parameters for its lattice
system, and the orientation as a small rotation vector about the starting orientation.

The optimiser sees one flat vector of dimensionless numbers, each a "typical step" of its quantity (a
hundredth of a degree of rotation, a ten-thousandth of a cell length...), so that the first L-BFGS steps
are of sensible size whatever the units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import NbsimError
from ..model.crystal import reciprocal_from_cell

PANEL_STEP = 1e-3
"""The panels' typical step: a micrometre of a group's shift (mm), a thousandth of a degree of its rotation."""

CELL_NAMES = ("a", "b", "c", "alpha", "beta", "gamma")
ANGLE_TOLERANCE_DEG = 1e-3
LENGTH_TOLERANCE = 1e-4


@dataclass(frozen=True)
class LatticeSystem:
    """A lattice system's free cell parameters: `free` indexes (a, b, c, alpha, beta, gamma), and `tied`
    says which entry each of the six copies (a = b = c for cubic; -1: an angle held at its starting value);
    `held_deg`: what the angles alpha, beta, gamma are where they are held, which a starting cell named to be of
    the system must show (the fit keeps the start's, cell_from_free)."""

    name: str
    free: tuple[int, ...]
    tied: tuple[int, ...]
    held_deg: tuple[float, float, float] = (90.0, 90.0, 90.0)


LATTICE_SYSTEMS = {
    "cubic": LatticeSystem("cubic", (0,), (0, 0, 0, -1, -1, -1)),
    "tetragonal": LatticeSystem("tetragonal", (0, 2), (0, 0, 2, -1, -1, -1)),
    "hexagonal": LatticeSystem("hexagonal", (0, 2), (0, 0, 2, -1, -1, -1), (90.0, 90.0, 120.0)),
    "rhombohedral": LatticeSystem("rhombohedral", (0, 3), (0, 0, 0, 3, 3, 3)),
    "orthorhombic": LatticeSystem("orthorhombic", (0, 1, 2), (0, 1, 2, -1, -1, -1)),
    "monoclinic": LatticeSystem("monoclinic", (0, 1, 2, 4), (0, 1, 2, -1, 4, -1)),
    "triclinic": LatticeSystem("triclinic", (0, 1, 2, 3, 4, 5), (0, 1, 2, 3, 4, 5)),
}
"""-1 in `tied`: the angle stays at its starting value (`held_deg`: 90°, or hexagonal's gamma 120°)."""


def lattice_system(cell: tuple[float, ...], name: str | None = None) -> LatticeSystem:
    """The lattice system a cell's metric shows (or the one named, checked against the cell)."""
    a, b, c, alpha, beta, gamma = cell

    def same(x: float, y: float) -> bool:
        return abs(x - y) <= LENGTH_TOLERANCE * max(x, y)

    def right(angle: float, value: float = 90.0) -> bool:
        return abs(angle - value) <= ANGLE_TOLERANCE_DEG

    if name is not None:
        if name not in LATTICE_SYSTEMS:
            raise NbsimError(f"unknown lattice system {name!r}: choose from {', '.join(LATTICE_SYSTEMS)}")
        system = LATTICE_SYSTEMS[name]
        for position, index in enumerate(system.tied):
            target = system.held_deg[position - 3] if index < 0 else cell[index]
            if not (same(cell[position], target) if position < 3 else right(cell[position], target)):
                wanted = f"{target:g}" if index < 0 else CELL_NAMES[index]
                raise NbsimError(f"the starting cell {' '.join(f'{v:g}' for v in cell)} is not {name}: its "
                                 f"{CELL_NAMES[position]} is not {wanted} (--lattice names the cell's own system "
                                 "or a lower one)")
        return system
    if right(alpha) and right(beta) and right(gamma):
        if same(a, b) and same(b, c):
            return LATTICE_SYSTEMS["cubic"]
        return LATTICE_SYSTEMS["tetragonal" if same(a, b) else "orthorhombic"]
    hexagonal = LATTICE_SYSTEMS["hexagonal"]
    if same(a, b) and all(right(angle, held) for angle, held in zip(cell[3:], hexagonal.held_deg, strict=True)):
        return hexagonal
    equal_angles = abs(alpha - beta) <= ANGLE_TOLERANCE_DEG and abs(beta - gamma) <= ANGLE_TOLERANCE_DEG
    if same(a, b) and same(b, c) and equal_angles:
        return LATTICE_SYSTEMS["rhombohedral"]
    if right(alpha) and right(gamma):
        return LATTICE_SYSTEMS["monoclinic"]
    return LATTICE_SYSTEMS["triclinic"]


def cell_from_free(start_cell: torch.Tensor, system: LatticeSystem, free_values: torch.Tensor) -> torch.Tensor:
    """The six cell parameters (Å, degrees) from the system's free ones; tied angles keep their start."""
    entries = [free_values[system.free.index(index)] if index >= 0 else start_cell[position]
               for position, index in enumerate(system.tied)]
    return torch.stack(entries)


def real_vectors(cell_A_deg: torch.Tensor) -> torch.Tensor:
    """Real cell vectors (rows, Å) of a cell in nanoBragg's default orientation (a* along x)."""
    reciprocal, _, _ = reciprocal_from_cell(tuple(cell_A_deg.unbind()))
    return torch.linalg.inv(reciprocal).T


def rotation_matrix(rotation_rad: torch.Tensor) -> torch.Tensor:
    """The rotation by |v| about v/|v| (Rodrigues), smooth through v = 0."""
    angle_sqr = (rotation_rad * rotation_rad).sum()
    small = angle_sqr < 1e-12
    safe = torch.where(small, torch.ones_like(angle_sqr), angle_sqr)
    angle = torch.sqrt(safe)
    sin_term = torch.where(small, 1.0 - angle_sqr / 6.0, torch.sin(angle) / angle)
    cos_term = torch.where(small, 0.5 - angle_sqr / 24.0, (1.0 - torch.cos(angle)) / safe)
    x, y, z = rotation_rad.unbind()
    zero = torch.zeros_like(x)
    skew = torch.stack([torch.stack([zero, -z, y]), torch.stack([z, zero, -x]), torch.stack([-y, x, zero])])
    return torch.eye(3, dtype=rotation_rad.dtype) + sin_term * skew + cos_term * (skew @ skew)


def rotation_vector(rotation: torch.Tensor) -> torch.Tensor:
    """The rotation vector (radians) of a rotation matrix: rotation_matrix's inverse, for angles below 180°."""
    cosine = torch.clamp((torch.trace(rotation) - 1.0) / 2.0, -1.0, 1.0)
    angle = torch.arccos(cosine)
    axis = torch.stack([rotation[2, 1] - rotation[1, 2], rotation[0, 2] - rotation[2, 0],
                        rotation[1, 0] - rotation[0, 1]])
    sine = torch.sin(angle)
    return axis / 2.0 if float(sine) < 1e-12 else axis * (angle / (2.0 * sine))


def starting_rotation(cell_A_deg: torch.Tensor, real_A: torch.Tensor) -> torch.Tensor:
    """U with real_A = real_vectors(cell) · Uᵀ: the starting orientation, as the rotation nearest to the
    exact map (a MOSFLM matrix's rounding leaves it a hair from orthogonal)."""
    return nearest_rotation(torch.linalg.solve(real_vectors(cell_A_deg), real_A).T)


def nearest_rotation(matrix: torch.Tensor) -> torch.Tensor:
    """The rotation nearest to a 3×3 matrix (the orthogonal factor of its polar decomposition)."""
    left, _, right = torch.linalg.svd(matrix)
    return left @ right


def misorientation_deg(a_matrix: torch.Tensor | np.ndarray, reference: torch.Tensor | np.ndarray) -> float:
    """The angle (degrees) of the rotation nearest to the map between two A matrices (rows a*, b*, c*):
    how far apart two orientations are, free of their cells' difference."""
    reference, a_matrix = (torch.as_tensor(m, dtype=torch.float64) for m in (reference, a_matrix))
    rotation = nearest_rotation(torch.linalg.solve(reference, a_matrix).T)
    cosine = (torch.trace(rotation) - 1.0) / 2.0
    return math.degrees(math.acos(max(-1.0, min(1.0, float(cosine)))))


@dataclass(frozen=True)
class Quantity:
    """One refinable quantity's layout: its length in the flat vector, its typical step, and whether it is
    refined on a logarithmic scale (positive by construction). `scale_held`: a cell whose free lengths keep
    their geometric mean (`held_scale_basis`)."""

    name: str
    size: int
    step: float
    log: bool
    scale_held: bool = False


SPECTRUM_STEPS = (0.1, 1e-3)
"""Typical steps of a spectrum's shift (eV, about 1e-5 of an X-ray energy, the wavelength's) and its stretch.
Both move additively: a logarithmic stretch let a damped Newton step on the broad spots of a search stage
(where the stretch and N both widen the rocking curves) run it to exp(−745) = 0, where its gradient
vanishes; a stretch at or below 0 is a rejected step (nbsim.fit.scattering)."""


def free_lengths(system: LatticeSystem) -> int:
    """How many of the lattice system's free cell parameters are lengths (they come first)."""
    return sum(1 for index in system.free if index < 3)


def held_scale_basis(lengths: int) -> torch.Tensor:
    """(lengths, lengths − 1): orthonormal changes of the log lengths that keep their sum (Helmert's contrasts):
    a cell refined beside a spectrum's shift keeps its scale, which a still cannot tell from the shift."""
    basis = torch.zeros(lengths, max(lengths - 1, 0), dtype=torch.float64)
    for column in range(lengths - 1):
        basis[:column + 1, column] = 1.0
        basis[column + 1, column] = -(column + 1.0)
        basis[:, column] /= math.sqrt((column + 1.0) * (column + 2.0))
    return basis


def quantity(name: str, system: LatticeSystem, panel_groups: int = 0, scale_held: bool = False) -> Quantity:
    """The layout of a refinable quantity (the cell's size follows the lattice system, one length fewer where
    its scale is held; the panels' the number of panel groups: a shift (mm) and a rotation vector (degrees)
    each)."""
    if name == "orientation":
        return Quantity(name, 3, math.radians(0.01), log=False)
    if name == "cell":
        return Quantity(name, len(system.free) - (1 if scale_held else 0), 1e-4, log=True, scale_held=scale_held)
    if name == "N":
        return Quantity(name, 3, 0.02, log=True)
    if name in ("mosaic", "scale"):
        return Quantity(name, 1, 0.05, log=True)
    if name == "distance":
        return Quantity(name, 1, 0.01, log=False)
    if name == "beam":
        return Quantity(name, 2, 0.005, log=False)
    if name == "wavelength":
        return Quantity(name, 1, 1e-5, log=True)
    if name == "background":
        return Quantity(name, 1, 0.05, log=True)
    if name == "panels":
        return Quantity(name, 6 * panel_groups, PANEL_STEP, log=False)
    if name == "spectrum":
        return Quantity(name, 2, SPECTRUM_STEPS[0], log=False)
    raise NbsimError(f"unknown parameter {name!r}")


def to_natural(start: torch.Tensor, internal: torch.Tensor, q: Quantity, system: LatticeSystem) -> torch.Tensor:
    """A quantity's value from its start and its internal (dimensionless) coordinates. The cell's angles
    move additively in steps of 0.01°, its lengths multiplicatively (with the scale held, along the
    contrasts of `held_scale_basis`); a spectrum's shift (eV) and stretch additively."""
    if q.name == "cell":
        lengths = free_lengths(system)
        if q.scale_held:
            length_steps = held_scale_basis(lengths) @ internal[:lengths - 1]
            angle_steps = internal[lengths - 1:]
        else:
            length_steps, angle_steps = internal[:lengths], internal[lengths:]
        return torch.cat([start[:lengths] * torch.exp(length_steps * q.step),
                          start[lengths:] + angle_steps * 0.01])
    if q.name == "spectrum":
        return start + internal * torch.tensor(SPECTRUM_STEPS, dtype=internal.dtype)
    if q.log:
        return start * torch.exp(internal * q.step)
    return start + internal * q.step
