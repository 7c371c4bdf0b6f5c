"""nanoBragg's random numbers: the Numerical Recipes `ran1` generator and the spherical-cap rotations.

Mosaic domain orientations (and `-misset random`) must be drawn exactly as the C draws them, so this
module reproduces its generator, including the shuffle table that persists between calls and the
single-precision arithmetic of its cap sampling.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
from collections.abc import Callable

import numpy as np

_IA, _IM, _IQ, _IR, _NTAB = 16807, 2147483647, 127773, 2836, 32
_NDIV = 1 + (_IM - 1) // _NTAB
_AM = 1.0 / _IM
_RNMX = 1.0 - 1.2e-7


def _park_miller(idum: int) -> int:
    k = idum // _IQ
    idum = _IA * (idum - k * _IQ) - _IR * k
    return idum + _IM if idum < 0 else idum


class Ran1:
    """The `ran1` generator with the state the C keeps in static variables (the shuffle table).

    `draw(seed)` plays the role of `ran1(&seed)`: a seed <= 0 (re)initialises the table, a positive
    seed continues it. One instance stands for one nanoBragg process, so that `-misset random` and the
    mosaic domains share the table as they do in the C.
    """

    def __init__(self) -> None:
        self._iy = 0
        self._iv = [0] * _NTAB

    def draw(self, idum: int) -> tuple[float, int]:
        """One uniform deviate in (0, 1) as a float32 value, and the updated seed."""
        if idum <= 0 or not self._iy:
            idum = 1 if -idum < 1 else -idum
            for j in range(_NTAB + 7, -1, -1):
                idum = _park_miller(idum)
                if j < _NTAB:
                    self._iv[j] = idum
            self._iy = self._iv[0]
        idum = _park_miller(idum)
        j = self._iy // _NDIV
        self._iy = self._iv[j]
        self._iv[j] = idum
        value = np.float32(_AM * self._iy)
        return (float(np.float32(_RNMX)) if value > _RNMX else float(value)), idum

    def table(self) -> tuple[int, ...]:
        """The state the C keeps in ran1's static variables: iy, then the shuffle table."""
        return (self._iy, *self._iv)


def cap_rotation(generator: Ran1, idum: int, cap_rad: float) -> tuple[np.ndarray, float, np.ndarray, int]:
    """A random rotation within a spherical cap (nanoBragg's mosaic_rotation_umat).

    Returns the unit rotation axis, the fraction of the cap it turns by (so that a differentiable
    spread can rebuild the angle as spread·fraction; the C rounds that product to single precision,
    a 1e-7 relative difference), the 3×3 matrix, and the updated seed.
    """
    r1, idum = generator.draw(idum)
    r2, idum = generator.draw(idum)
    r3, idum = generator.draw(idum)
    r1, r2, r3 = 2.0 * r1 - 1.0, 2.0 * r2 - 1.0, 2.0 * r3 - 1.0
    xy_radius = math.sqrt(1.0 - r2 * r2)
    fraction = np.float32(_powf()(float(np.float32(1.0 - r3 * r3)), float(np.float32(1.0 / 3.0))))
    angle = float(np.float32(cap_rad) * fraction)
    axis = np.array([xy_radius * math.sin(math.pi * r1), xy_radius * math.cos(math.pi * r1), r2])
    return axis, float(fraction), axis_angle_matrix(axis, angle), idum


@functools.cache
def _powf() -> Callable[[float, float], float]:
    """The C library's single-precision pow, which nanoBragg's cap sampling calls: numpy's float32 power
    differs from glibc's in the last bit for 14% of the cap draws (a mosaic matrix 1e-9 off), float64 pow
    rounded to single for 0.07%; that rounding stands in where no C library can be loaded."""
    name = ctypes.util.find_library("m")
    if name is None:
        return lambda x, y: float(np.float32(x ** y))
    powf = ctypes.CDLL(name).powf
    powf.restype, powf.argtypes = ctypes.c_float, (ctypes.c_float, ctypes.c_float)
    return powf


def axis_angle_matrix(axis: np.ndarray, angle_rad: float) -> np.ndarray:
    """Rotation matrix about a unit axis, written as nanoBragg's quaternion expansion."""
    v1, v2, v3 = axis
    c, s = math.cos(angle_rad), math.sin(angle_rad)
    t = 1.0 - c
    return np.array([
        [c + t * v1 * v1, t * v1 * v2 - s * v3, t * v1 * v3 + s * v2],
        [t * v1 * v2 + s * v3, c + t * v2 * v2, t * v2 * v3 - s * v1],
        [t * v1 * v3 - s * v2, t * v2 * v3 + s * v1, c + t * v3 * v3],
    ])


def matrix_to_misset_rad(umat: np.ndarray) -> tuple[float, float, float]:
    """x, y, z rotation angles of an orthonormal matrix (nanoBragg's umat2misset for a proper rotation)."""
    rows = umat / np.linalg.norm(umat, axis=1, keepdims=True)
    (uxx, uxy, _), (uyx, uyy, _), (uzx, uzy, uzz) = rows
    if uzx * uzx < 1.0:
        return (math.atan2(uzy, uzz), math.atan2(-uzx, math.sqrt(uzy * uzy + uzz * uzz)), math.atan2(uyx, uxx))
    return (math.pi, math.pi / 2, math.atan2(uxy, -uyy))
