"""The amorphous background of each pixel (nbsim.background): evaluated once per pixel at its centre, on the
sensor's front face, for every source, with the kernel's own solid angle, polarization and capture
functions. It is a separate, eager pass (one evaluation per pixel and source, against the kernel's steps),
so it never changes a compiled kernel, and it does not depend on the sub-pixel, phi or mosaic sampling."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch.utils._pytree import tree_map

from ..background import BackgroundCurve
from .inputs import KernelOptions, KernelTensors, Projection
from .physics import pixel_frame, polarization_factor, project, solid_angle


class BackgroundInputs(NamedTuple):
    """The kernel inputs moved to the pixel centre (one sub-step) in float64, the padded curve, the scale, the
    sensor's whole thickness times μ (0 without a sensor) and the dtype the image is rendered in."""

    centre: KernelTensors
    stol_per_A: torch.Tensor
    F: torch.Tensor
    scale: float
    mu_thickness: float
    dtype: torch.dtype


def background_inputs(t: KernelTensors, centre_m: torch.Tensor, curve: BackgroundCurve,
                      mu_thickness: float) -> BackgroundInputs:
    """`t` in float64 with its one sub-step at `centre_m` (the first pixel's centre on the front face, (3,)): every
    projection's origin recomputed from its vectors. float64 whatever the render's dtype: sin(θ)/λ at small angles
    comes from 1 − cos 2θ, which float32 would hold to a few digits only."""
    dtype = t.origins.dtype
    t = tree_map(lambda x: x.double() if x.is_floating_point() else x, t)
    centre = centre_m.to(t.origins)

    def at_centre(p: Projection) -> Projection:
        return p._replace(origin=(p.vectors @ centre).unsqueeze(0))

    moved = t._replace(origins=centre.view(1, 3), layer_of_substep=t.layer_of_substep[:1] * 0,
                       cells=tuple(at_centre(p) for p in t.cells), incident=at_centre(t.incident),
                       odet=at_centre(t.odet), polar_e=at_centre(t.polar_e), polar_b=at_centre(t.polar_b))
    return BackgroundInputs(moved, torch.as_tensor(curve.stol_per_A, device=t.origins.device),
                            torch.as_tensor(curve.F, device=t.origins.device), curve.scale, mu_thickness, dtype)


def polint(x_nodes: torch.Tensor, y_nodes: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """simtbx's four-point interpolation: the cubic through the curve's points nearest-1 .. nearest+2, nearest
    the last point at or below x (Lagrange's form of its Neville scheme, float64)."""
    nearest = torch.clamp(torch.searchsorted(x_nodes, x, right=True) - 1, 1, len(x_nodes) - 3)
    xs = [x_nodes[nearest + offset] for offset in (-1, 0, 1, 2)]
    ys = [y_nodes[nearest + offset] for offset in (-1, 0, 1, 2)]
    total = torch.zeros_like(x)
    for i in range(4):
        weight = torch.ones_like(x)
        for j in range(4):
            if j != i:
                weight = weight * ((x - xs[j]) / (xs[i] - xs[j]))
        total = total + weight * ys[i]
    return total


def background_rows(rows: torch.Tensor, cols: torch.Tensor, b: BackgroundInputs,
                    options: KernelOptions) -> torch.Tensor:
    """Background photons of each pixel (R, C), computed in float64, in the render's dtype."""
    t = b.centre
    options = dataclasses.replace(options, use_dmin=False)
    f = pixel_frame(rows.double(), cols.double(), t, options)
    omega = solid_angle(f.inverse_path[:, :, 0], t, options)
    cos2theta = f.cos2theta[:, :, 0, :]
    stol = 0.5 * t.inv_wavelength * torch.sqrt(torch.clamp(2.0 - 2.0 * cos2theta, min=0.0))
    F = polint(b.stol_per_A, b.F, stol)
    if options.polarization == "none":
        polar = torch.ones_like(cos2theta)
    else:
        polar = polarization_factor(f, t, options)[:, :, 0, :]
    weights = t.source_weight / t.source_weight.shape[0]
    intensity = (torch.sign(F) * F * F * polar * weights).sum(-1)
    capture = torch.ones_like(omega)
    if b.mu_thickness > 0:
        parallax = (project(f, t.odet, options)[..., 0] * f.inverse_path)[:, :, 0]
        capture = 1.0 - torch.exp(-b.mu_thickness / parallax)
    return (b.scale * intensity * omega * capture).to(b.dtype)


def pixel_centre_m(pix0_m: torch.Tensor, fdet: torch.Tensor, sdet: torch.Tensor, pixel_size_m: float) -> torch.Tensor:
    """The first pixel's centre: pix0 + ½ pixel along f̂ and ŝ (float64)."""
    return (pix0_m.detach() + 0.5 * pixel_size_m * (fdet + sdet)).double()
