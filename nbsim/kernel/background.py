"""The amorphous background of each pixel (nbsim.model.background): evaluated once per pixel at its centre, on the
sensor's front face, for every source, with the kernel's own solid angle, polarization and capture
functions. It is a separate, eager pass (one evaluation per pixel and source, against the kernel's steps),
so it never changes a compiled kernel, and it does not depend on the sub-pixel, phi or mosaic sampling."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import torch
from torch.utils._pytree import tree_map

from ..model.background import BackgroundCurve
from .inputs import KernelOptions, KernelTensors, Projection
from .physics import pixel_frame, polarization_factor, project, restrict, solid_angle


class BackgroundInputs(NamedTuple):
    """The kernel inputs moved to the pixel centre (one sub-step) in float64 and cut to one source per incident
    direction; per direction its sources, their 1/λ and weights (all summing to 1) and the weighted moments
    Σ w·(1/λ)^k, k = 0..6; the padded curve as four-point Lagrange segments; the scale, the sensor's whole
    thickness times μ (0 without a sensor) and the render's dtype."""

    centre: KernelTensors
    inv_wavelength: list[torch.Tensor]
    weight: list[torch.Tensor]
    moments: torch.Tensor
    curve: LagrangeSegments
    scale: float
    mu_thickness: float
    dtype: torch.dtype


class LagrangeSegments(NamedTuple):
    """simtbx's four-point interpolation (`polint`) precomputed: for x at or above nodes[i] (and below the next
    node), the cubic through nodes[i−1 .. i+2] is Σ_k values[k]/Π_{m≠k}(node_k − node_m) · Π_{m≠k}(x − node_m);
    `points` (segments, 4) holds those four nodes and `scaled` (segments, 4) the fractions. `squared` (segments,
    7) holds each cubic's square as powers of x, and `non_negative` (segments,) whether the cubic stays ≥ 0 over
    its segment (then sign(F)·F² is its square there)."""

    nodes: torch.Tensor
    points: torch.Tensor
    scaled: torch.Tensor
    squared: torch.Tensor
    non_negative: torch.Tensor


def lagrange_segments(x_nodes: torch.Tensor, y_nodes: torch.Tensor) -> LagrangeSegments:
    """The four-point Lagrange interpolation of a curve, segment by segment, precomputed once per curve."""
    starts = torch.arange(1, len(x_nodes) - 2)
    points = torch.stack([x_nodes[starts + offset] for offset in (-1, 0, 1, 2)], dim=1)
    values = torch.stack([y_nodes[starts + offset] for offset in (-1, 0, 1, 2)], dim=1)
    denominators = torch.ones_like(points)
    for k in range(4):
        for m in range(4):
            if m != k:
                denominators[:, k] = denominators[:, k] * (points[:, k] - points[:, m])
    scaled = values / denominators
    squared, non_negative = [], []
    for segment, (nodes, fractions) in enumerate(zip(points.tolist(), scaled.tolist(), strict=True)):
        cubic = sum(fraction * np.poly([node for m, node in enumerate(nodes) if m != k])
                    for k, fraction in enumerate(fractions))  # highest power first
        squared.append(np.convolve(cubic, cubic)[::-1])
        low, high = x_nodes[segment + 1].item(), x_nodes[segment + 2].item()
        turning = [r.real for r in np.roots(np.polyder(cubic)) if abs(r.imag) < 1e-12 and low < r.real < high]
        finite = abs(low) < 1e90 and abs(high) < 1e90  # a padded end: the cubic may turn negative far out
        non_negative.append(finite and all(np.polyval(cubic, x) >= 0 for x in [low, high, *turning]))
    return LagrangeSegments(x_nodes, points, scaled, torch.as_tensor(np.array(squared), device=points.device),
                            torch.as_tensor(non_negative, device=points.device))


def background_inputs(t: KernelTensors, centre_m: torch.Tensor, curve: BackgroundCurve,
                      mu_thickness: float) -> BackgroundInputs:
    """`t` in float64 with its one sub-step at `centre_m` (the first pixel's centre on the front face, (3,)), every
    projection's origin recomputed from its vectors, and its sources cut to one per incident direction (a
    spectrum's channels share theirs). float64 whatever the render's dtype: sin(θ)/λ at small angles comes from
    1 − cos 2θ, which float32 would hold to a few digits only."""
    dtype = t.origins.dtype
    t = tree_map(lambda x: x.double() if x.is_floating_point() else x, t)
    centre = centre_m.to(t.origins)

    def at_centre(p: Projection) -> Projection:
        return p._replace(origin=(p.vectors @ centre).unsqueeze(0))

    moved = t._replace(origins=centre.view(1, 3), layer_of_substep=t.layer_of_substep[:1] * 0,
                       cells=tuple(at_centre(p) for p in t.cells), incident=at_centre(t.incident),
                       odet=at_centre(t.odet), polar_e=at_centre(t.polar_e), polar_b=at_centre(t.polar_b))
    directions, source_direction = torch.unique(t.incident.vectors, dim=0, return_inverse=True)
    members = [torch.nonzero(source_direction == d)[:, 0] for d in range(len(directions))]
    weight = t.source_weight / t.source_weight.shape[0]
    inv_wavelength = [t.inv_wavelength[m] for m in members]
    weights = [weight[m] for m in members]
    moments = torch.stack([torch.stack([(w * v ** k).sum() for k in range(7)])
                           for v, w in zip(inv_wavelength, weights, strict=True)])
    device = t.origins.device
    nodes = torch.as_tensor(curve.stol_per_A, device=device)
    return BackgroundInputs(restrict(moved, source=torch.stack([m[0] for m in members])), inv_wavelength, weights,
                            moments, lagrange_segments(nodes, torch.as_tensor(curve.F, device=device)), curve.scale,
                            mu_thickness, dtype)


def segment_of(curve: LagrangeSegments, x: torch.Tensor) -> torch.Tensor:
    """The segment x lies in (its cubic's row in `curve`)."""
    return torch.clamp(torch.searchsorted(curve.nodes, x, right=True) - 2, 0, len(curve.points) - 1)


def polint(curve: LagrangeSegments, x: torch.Tensor) -> torch.Tensor:
    """simtbx's four-point interpolation at x: the cubic through the curve's points nearest−1 .. nearest+2,
    nearest the last point at or below x (float64)."""
    segment = segment_of(curve, x)
    differences = x.unsqueeze(-1) - curve.points[segment]
    d0, d1, d2, d3 = differences.unbind(-1)
    c0, c1, c2, c3 = curve.scaled[segment].unbind(-1)
    return c0 * (d1 * d2 * d3) + c1 * (d0 * d2 * d3) + c2 * (d0 * d1 * d3) + c3 * (d0 * d1 * d2)


def background_rows(rows: torch.Tensor, cols: torch.Tensor, b: BackgroundInputs,
                    options: KernelOptions) -> torch.Tensor:
    """Background photons of each pixel (R, C), computed in float64, in the render's dtype: the geometry once per
    pixel and incident direction, the curve once per pixel and source."""
    t = b.centre
    options = dataclasses.replace(options, use_dmin=False)
    f = pixel_frame(rows.double(), cols.double(), t, options)
    omega = solid_angle(f.inverse_path[:, :, 0], t, options)
    cos2theta = f.cos2theta[:, :, 0, :]
    sin_theta = 0.5 * torch.sqrt(torch.clamp(2.0 - 2.0 * cos2theta, min=0.0))
    if options.polarization == "none":
        polar = torch.ones_like(cos2theta)
    else:
        polar = polarization_factor(f, t, options)[:, :, 0, :]
    intensity = torch.zeros_like(omega)
    for direction in range(len(b.weight)):
        intensity += polar[:, :, direction] * curve_sum(b, direction, sin_theta[:, :, direction])
    capture = torch.ones_like(omega)
    if b.mu_thickness > 0:
        parallax = (project(f, t.odet, options)[..., 0] * f.inverse_path)[:, :, 0]
        capture = 1.0 - torch.exp(-b.mu_thickness / parallax)
    return (b.scale * intensity * omega * capture).to(b.dtype)


def curve_sum(b: BackgroundInputs, direction: int, sin_theta: torch.Tensor) -> torch.Tensor:
    """Σ_s w_s·sign(F)·F(sin θ/λ_s)² over the sources of one incident direction, for each pixel's sin θ.

    Where every source's sin θ/λ lies in one segment whose cubic P stays ≥ 0 there, the sum is
    Σ_k c_k·sin θ^k·Σ_s w_s/λ_s^k with c_k the coefficients of P²: the sources' moments, so a spectrum's channels
    cost one degree-6 polynomial per pixel. Other pixels (a sum across a curve point, or a padded end) sum the
    sources one by one."""
    curve, moments = b.curve, b.moments[direction]
    inv_wavelength, weight = b.inv_wavelength[direction], b.weight[direction]
    segment = segment_of(curve, sin_theta * inv_wavelength.min())
    alike = (segment == segment_of(curve, sin_theta * inv_wavelength.max())) & curve.non_negative[segment]
    coefficients = curve.squared[segment] * moments
    total = coefficients[..., 6]
    for power in range(5, -1, -1):
        total = total * sin_theta + coefficients[..., power]
    others = torch.nonzero(~alike, as_tuple=True)
    if others[0].numel():
        apart = sin_theta[others]
        exact = torch.zeros_like(apart)
        chunk = max(1, SOURCE_CHUNK_VALUES // apart.numel())
        for first in range(0, len(weight), chunk):
            sources = slice(first, first + chunk)
            F = polint(curve, apart.unsqueeze(-1) * inv_wavelength[sources])
            exact += (torch.sign(F) * F * F * weight[sources]).sum(-1)
        total = total.index_put(others, exact)
    return total


SOURCE_CHUNK_VALUES = 1 << 22
"""(pixel, source) values the curve is evaluated for at once where the moments do not serve."""


def pixel_centre_m(pix0_m: torch.Tensor, fdet: torch.Tensor, sdet: torch.Tensor, pixel_size_m: float) -> torch.Tensor:
    """The first pixel's centre: pix0 + ½ pixel along f̂ and ŝ (float64)."""
    return (pix0_m.detach() + 0.5 * pixel_size_m * (fdet + sdet)).double()
