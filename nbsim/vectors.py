"""Small differentiable 3-vector helpers on tensors whose last dimension is 3.

They follow nanoBragg's conventions (rotation order x, y, z; right-handed rotation about an axis;
zero vectors stay zero when normalised) so that setup geometry matches the reference to rounding.
"""

from __future__ import annotations

import torch

M_1_PI = 0.318309886183790671538
DEGREES_PER_RADIAN = 180.0 * M_1_PI


def as_float64(value) -> torch.Tensor:
    """A float or tensor as a float64 tensor (kept in the autograd graph when it is one)."""
    return torch.as_tensor(value, dtype=torch.float64)


def radians(degrees):
    """Degrees → radians exactly as nanoBragg converts them (a division by 180/π)."""
    return degrees / DEGREES_PER_RADIAN


def dot(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """x·x' + y·y' + z·z', summed left to right as the C does (setup values round identically)."""
    return u[..., 0] * v[..., 0] + u[..., 1] * v[..., 1] + u[..., 2] * v[..., 2]


def cross(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Cross product along the last axis."""
    return torch.stack((u[..., 1] * v[..., 2] - u[..., 2] * v[..., 1],
                        u[..., 2] * v[..., 0] - u[..., 0] * v[..., 2],
                        u[..., 0] * v[..., 1] - u[..., 1] * v[..., 0]), -1)


def norm(u: torch.Tensor) -> torch.Tensor:
    """Euclidean length along the last axis."""
    return torch.sqrt(dot(u, u))


def unit(u: torch.Tensor) -> torch.Tensor:
    """u/|u|, or the zero vector when |u| is zero (as nanoBragg's unitize)."""
    length = norm(u)
    safe = torch.where(length == 0, torch.ones_like(length), length)
    return torch.where((length == 0).unsqueeze(-1), torch.zeros_like(u), u / safe.unsqueeze(-1))


def rotate_xyz(v: torch.Tensor, angles_rad: torch.Tensor) -> torch.Tensor:
    """Rotate about x, then y, then z by the three angles (nanoBragg's rotate())."""
    x, y, z = v.unbind(-1)
    ax, ay, az = angles_rad.unbind(-1)
    cx, sx = torch.cos(ax), torch.sin(ax)
    y, z = y * cx - z * sx, y * sx + z * cx
    cy, sy = torch.cos(ay), torch.sin(ay)
    x, z = x * cy + z * sy, -x * sy + z * cy
    cz, sz = torch.cos(az), torch.sin(az)
    x, y = x * cz - y * sz, x * sz + y * cz
    return torch.stack((x, y, z), -1)


def rotate_about_axis(v: torch.Tensor, axis: torch.Tensor, angle_rad: torch.Tensor) -> torch.Tensor:
    """Rodrigues rotation of v about axis by angle (axis used as given, like nanoBragg's rotate_axis)."""
    cos_a = torch.cos(angle_rad).unsqueeze(-1)
    sin_a = torch.sin(angle_rad).unsqueeze(-1)
    along = dot(axis, v).unsqueeze(-1) * (1.0 - cos_a)
    return axis * along + v * cos_a + cross(axis, v) * sin_a
