"""The per-pixel physics as one pure tensor function, written so that torch.compile fuses it.

Every quantity is an explicit per-component expression broadcast over
(rows, cols, sub-steps, sources, crystal orientations) — sub-steps are sub-pixels × sensor layers,
orientations are phi steps × mosaic domains — and the sum over the last three axes is the final
reduction, so Inductor emits one loop nest and never materialises the step product. The same
function runs eagerly (the `-compile off` path) on small tiles.

On a flat detector a pixel position is p = P_k + F·f̂ + S·ŝ (P_k: sub-step origin, F/S: pixel
offsets), so any projection v·p is linear in F and S: a·d, i·d, ô·d come from a few per-orientation
constants instead of a 3-vector per step. That keeps the per-step work to a handful of fused
multiply-adds.

Over 400 lines on purpose: the stages share private helpers (the sine polynomials, the lattice factors,
the table lookups), and one module keeps the whole per-pixel computation, which is hashed into every
compiled kernel's cache key, readable in one place.
"""

from __future__ import annotations

import math
from typing import NamedTuple, TypeVar

import torch

from ..model.structure_factors import lagrange_weights
from .inputs import KernelOptions, KernelTensors, Projection

ROUND_SHAPE_NORM = 0.723601254558268
GAUSS_WIDTH = 0.63
TOPHAT_RADIUS_SQR = 0.3969


# sin(πx)/x as a polynomial in x² on |x| ≤ ½. float64: 8 terms interpolating it at the Chebyshev nodes
# of x² ∈ [0, ¼] (computed in 50-digit arithmetic; sin(πx) then within 3.3e-16 of the exact value, the
# same as the 10-term Taylor series). float32: a 5-term fit minimising the relative error (5e-9, below
# float32 rounding). A polynomial on a reduced argument is far cheaper than a general sine and needs no
# range reduction of its own.
_SIN_PI_COEFFICIENTS = (3.1415926535897927, -5.1677127800497855, 2.5501640398618677, -0.599264528825224,
                        0.08214587881631043, -0.0073703643265304155, 0.0004659870158043378, -2.113362735205297e-05)
_SIN_PI_COEFFICIENTS_FLOAT32 = (3.141592636934065, -5.1677096867340495, 2.5500697530009737, -0.5982422641064848,
                                0.07756062573090196)


def sin_pi(x: torch.Tensor) -> torch.Tensor:
    """sin(πx) for |x| ≤ ½: Horner's rule in x² when compiled (as many terms as the dtype can use; it
    fuses into the kernel loop), torch.sin when eager (one operation instead of twenty)."""
    if not torch.compiler.is_compiling():
        return torch.sin(math.pi * x)
    return sin_pi_polynomial(x)


def sin_pi_polynomial(x: torch.Tensor) -> torch.Tensor:
    """The Horner polynomial of sin_pi (float32 inputs use the shorter fitted one)."""
    coefficients = _SIN_PI_COEFFICIENTS_FLOAT32 if x.dtype in (torch.float32, torch.float16, torch.bfloat16) \
        else _SIN_PI_COEFFICIENTS
    x2 = x * x
    total = torch.full_like(x, coefficients[-1])
    for coefficient in reversed(coefficients[:-1]):
        total = total * x2 + coefficient
    return total * x


def node_series_limit(dtype: torch.dtype) -> float:
    """The |Nδ| below which sincg is its Taylor series in x = πδ, N(1 − (N² − 1)x²/6 + (N² − 1)(3N² − 7)x⁴/360):
    where the series' first omitted term, about (Nx)⁴/360 of the derivative, meets the rounding that the
    quotient's derivative suffers, about ε/(Nx)² (both near ε^⅔ then; the value is exact to ε either way)."""
    return (360.0 * torch.finfo(dtype).eps) ** (1.0 / 6.0) / math.pi


def sincg_parts(fraction: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Numerator and denominator of |sin(Nπh)/sin(πh)| from the fractional index δ = h − h0.

    With integer h0 the ratio is ±sin(Nπδ)/sin(πδ); intensities use its square, so the sign is
    dropped. Nδ is reduced again to its nearest integer, so both sines are evaluated on |x| ≤ ½:
    accurate in float32 where sin(πh) of a large h would not be. Next to the node (|Nδ| below
    `node_series_limit`, δ = 0 included) the ratio is its series over 1: the same value, and a derivative,
    where the quotient of two vanishing sines differentiates into two terms of order N/δ that cancel (at
    δ ~ 1e-17, a sample on a lattice plane, into a gradient of 1e15 made of rounding).
    """
    scaled = n * fraction
    near_node = torch.abs(scaled) < node_series_limit(fraction.dtype)
    angle_sqr = torch.square(math.pi * fraction)
    bend = n * n - 1.0
    series = n * (1.0 - bend * angle_sqr / 6.0 + bend * (3.0 * n * n - 7.0) * torch.square(angle_sqr) / 360.0)
    numerator = torch.where(near_node, series, sin_pi(scaled - torch.round(scaled)))
    denominator = torch.where(near_node, torch.ones_like(fraction), sin_pi(fraction))
    return numerator, denominator


def _sinc3(x: torch.Tensor) -> torch.Tensor:
    """Fourier transform of a sphere, 3(sin x − x cos x)/x³, with its limit 1 at x = 0."""
    at_zero = x == 0
    safe = torch.where(at_zero, torch.ones_like(x), x)
    return torch.where(at_zero, torch.ones_like(x), 3.0 * (torch.sin(safe) / safe - torch.cos(safe)) / (safe * safe))


def _gather(grid: torch.Tensor, h: torch.Tensor, k: torch.Tensor, l: torch.Tensor,
            grid_min: torch.Tensor, grid_extent: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """grid[h, k, l] for integer-valued indices within one node of the file's range.

    The table carries a border of default_F one node wide (see HKLGrid.padded), so its first
    entry is index grid_min − 1; grid_extent holds the padded table's (h, k, l) sizes, int32. The flat
    index is int32 arithmetic on each axis's node: exact for any table (a float32 index is not past
    2²⁴ entries), and three float-to-int32 conversions are single vector instructions where one
    float-to-int64 conversion is not (AVX2 has none). `offset` (int32, broadcast along the sources) is where
    each source's table starts: 0 with one table, a channel's start with one table per channel.
    """
    nodes = [(x - low + 1.0).to(torch.int32) for x, low in ((h, grid_min[0]), (k, grid_min[1]), (l, grid_min[2]))]
    return grid[(nodes[0] * grid_extent[1] + nodes[1]) * grid_extent[2] + nodes[2] + offset]


def _in_table(index: torch.Tensor, axis: int, grid_min: torch.Tensor, grid_max: torch.Tensor) -> torch.Tensor:
    """An integer-valued index on `axis` clamped to the padded table, one node beyond the file's range:
    every read stays inside the table, and one past the range lands on the default_F border."""
    return torch.clamp(index, grid_min[axis] - 1.0, grid_max[axis] + 1.0)


def structure_factor(h: torch.Tensor, k: torch.Tensor, l: torch.Tensor,
                     h0: torch.Tensor, k0: torch.Tensor, l0: torch.Tensor,
                     grid: torch.Tensor, grid_min: torch.Tensor, grid_max: torch.Tensor,
                     grid_extent: torch.Tensor, default_F: torch.Tensor, lookup: str,
                     offset: torch.Tensor) -> torch.Tensor:
    """F_cell at fractional (h, k, l): default_F, nearest grid node, or tricubic interpolation, in the table
    each source reads (`offset`, shaped to broadcast along the sources: `source_offsets`)."""
    if lookup == "default":
        return default_F.expand_as(h)
    if lookup == "nearest":
        return _gather(grid, *(_in_table(x, v, grid_min, grid_max) for v, x in enumerate((h0, k0, l0))),
                       grid_min, grid_extent, offset)
    h_floor, k_floor, l_floor = torch.floor(h), torch.floor(k), torch.floor(l)
    wh = lagrange_weights(h - h_floor)
    wk = lagrange_weights(k - k_floor)
    wl = lagrange_weights(l - l_floor)
    # Steps whose neighbourhood leaves the table are never used (cut by -dmin, F_latt = 0, or past
    # nanoBragg's interpolation switch) but are computed with the rest: clamped, their reads stay inside
    # the table, and no step that counts changes.
    h_nodes, k_nodes, l_nodes = ([_in_table(floor + offset, v, grid_min, grid_max) for offset in (-1, 0, 1, 2)]
                                 for v, floor in enumerate((h_floor, k_floor, l_floor)))
    total = torch.zeros_like(h)
    for i in range(4):
        for j in range(4):
            for m in range(4):
                node = _gather(grid, h_nodes[i], k_nodes[j], l_nodes[m], grid_min, grid_extent, offset)
                total = total + wh[i] * wk[j] * wl[m] * node
    return total


def lattice_factor(dh: torch.Tensor, dk: torch.Tensor, dl: torch.Tensor, n_cells: torch.Tensor,
                   reciprocal: torch.Tensor, fudge: torch.Tensor, options: KernelOptions) -> torch.Tensor:
    """F_latt from the distance (dh, dk, dl) to the nearest node, for the crystal shape in options."""
    na, nb, nc = n_cells[0], n_cells[1], n_cells[2]
    if options.shape == "square":
        (top_a, bottom_a), (top_b, bottom_b), (top_c, bottom_c) = (
            sincg_parts(fraction, n) for fraction, n in ((dh, na), (dk, nb), (dl, nc)))
        return (top_a * top_b * top_c) / (bottom_a * bottom_b * bottom_c)
    volume = na * nb * nc
    if options.shape == "round":
        hrad_sqr = dh * dh * na * na + dk * dk * nb * nb + dl * dl * nc * nc
        return volume * ROUND_SHAPE_NORM * _sinc3(math.pi * torch.sqrt(hrad_sqr * fudge))
    dx = dh * reciprocal[0, 0] + dk * reciprocal[1, 0] + dl * reciprocal[2, 0]
    dy = dh * reciprocal[0, 1] + dk * reciprocal[1, 1] + dl * reciprocal[2, 1]
    dz = dh * reciprocal[0, 2] + dk * reciprocal[1, 2] + dl * reciprocal[2, 2]
    rad_star_sqr = (dx * dx + dy * dy + dz * dz) * volume * volume
    if options.shape == "gauss":
        return volume * torch.exp(-(rad_star_sqr / GAUSS_WIDTH * fudge))
    return volume * (rad_star_sqr * fudge < TOPHAT_RADIUS_SQR).to(dh.dtype)


Index = int | torch.Tensor
"""A position along a count dimension: a Python int, or a one-element int64 tensor (a run-time value)."""


def _take(x: torch.Tensor, dim: int, index: Index) -> torch.Tensor:
    """x restricted to position `index` of dimension `dim`, which keeps its length 1."""
    if isinstance(index, torch.Tensor):
        return x.index_select(dim, index)
    return x.narrow(dim, index, 1)


Fields = TypeVar("Fields", bound=tuple)


def replaced(fields: Fields, **changes: object) -> Fields:
    """The named tuple `fields` with `changes`: its `_replace` in a form that Dynamo traces in one graph on
    every PyTorch nbsim supports (2.8 traces neither `_replace` nor `_fields` read from the instance)."""
    names = type(fields)._fields
    if not set(changes) <= set(names):
        raise TypeError(f"{type(fields).__name__} has no field {sorted(set(changes) - set(names))}")
    return type(fields)(*[changes.get(name, getattr(fields, name)) for name in names])


def restrict(t: KernelTensors, substep: Index | None = None, source: Index | None = None) -> KernelTensors:
    """The inputs for one sub-step and/or one source only (for step-ordered evaluation)."""
    if substep is not None:
        def at_substep(p: Projection) -> Projection:
            return replaced(p, origin=_take(p.origin, 0, substep))

        t = replaced(t, origins=_take(t.origins, 0, substep), layer_of_substep=_take(t.layer_of_substep, 0, substep),
                     cells=tuple(at_substep(p) for p in t.cells), incident=at_substep(t.incident),
                     odet=at_substep(t.odet), polar_e=at_substep(t.polar_e), polar_b=at_substep(t.polar_b))
    if source is not None:
        def at_source(p: Projection) -> Projection:
            return Projection(_take(p.origin, 1, source), _take(p.fast, 0, source), _take(p.slow, 0, source),
                              _take(p.vectors, 0, source))

        t = replaced(t, beam_terms=_take(t.beam_terms, 1, source), inv_wavelength=_take(t.inv_wavelength, 0, source),
                     source_weight=_take(t.source_weight, 0, source), grid_offset=_take(t.grid_offset, 0, source),
                     incident=at_source(t.incident),
                     polar_e=at_source(t.polar_e), polar_b=at_source(t.polar_b))
    return t


class PixelFrame(NamedTuple):
    """Per (pixel, sub-step) positions x, y, z and 1/|p| (R, C, K); pixel offsets fast (1, C, 1) and
    slow (R, 1, 1); cos 2θ and the -dmin mask per (pixel, sub-step, source) (R, C, K, S)."""

    x: torch.Tensor
    y: torch.Tensor
    z: torch.Tensor
    inverse_path: torch.Tensor
    fast: torch.Tensor
    slow: torch.Tensor
    cos2theta: torch.Tensor | None
    valid: torch.Tensor | None


def _rotate_components(x, y, z, axis: torch.Tensor, angle: torch.Tensor):
    """Component-wise Rodrigues rotation (used by the curved detector)."""
    cos_a, sin_a = torch.cos(angle), torch.sin(angle)
    along = (axis[0] * x + axis[1] * y + axis[2] * z) * (1.0 - cos_a)
    return (axis[0] * along + x * cos_a + (axis[1] * z - axis[2] * y) * sin_a,
            axis[1] * along + y * cos_a + (axis[2] * x - axis[0] * z) * sin_a,
            axis[2] * along + z * cos_a + (axis[0] * y - axis[1] * x) * sin_a)


def project(f: PixelFrame, projection: Projection, options: KernelOptions) -> torch.Tensor:
    """v·p for every (pixel, sub-step) and each of the V vectors: shape (R, C, K, V)."""
    if options.curved:
        v = projection.vectors
        return f.x.unsqueeze(-1) * v[:, 0] + f.y.unsqueeze(-1) * v[:, 1] + f.z.unsqueeze(-1) * v[:, 2]
    return projection.origin + f.fast.unsqueeze(-1) * projection.fast + f.slow.unsqueeze(-1) * projection.slow


def pixel_frame(rows: torch.Tensor, cols: torch.Tensor, t: KernelTensors, options: KernelOptions) -> PixelFrame:
    """Positions of every (pixel, sub-step), 1/|p|, and cos 2θ for every source.

    `rows` (R,) and `cols` (C,) name a tile's rows and columns; `cols` (R, C) gives each row its own
    columns (a list of scattered pixels is rows (P,) and cols (P, 1): what a fit renders)."""
    pixel_size, distance, dmin = t.scalars.pixel_size_m, t.scalars.distance_m, t.scalars.dmin_A
    fdet, sdet, beam = t.frame[0], t.frame[1], t.frame[2]
    fast = (cols * pixel_size).view(1, -1, 1) if cols.dim() == 1 else (cols * pixel_size).unsqueeze(-1)
    slow = (rows * pixel_size).view(-1, 1, 1)
    x = t.origins[:, 0] + fast * fdet[0] + slow * sdet[0]
    y = t.origins[:, 1] + fast * fdet[1] + slow * sdet[1]
    z = t.origins[:, 2] + fast * fdet[2] + slow * sdet[2]
    if options.curved:
        bx, by, bz = distance * beam[0], distance * beam[1], distance * beam[2]
        bx, by, bz = _rotate_components(bx, by, bz, sdet, y / distance)
        x, y, z = _rotate_components(bx, by, bz, fdet, z / distance)
    inverse_path = torch.rsqrt(x * x + y * y + z * z)
    frame = PixelFrame(x, y, z, inverse_path, fast, slow, cos2theta=None, valid=None)
    cos2theta = project(frame, t.incident, options) * inverse_path.unsqueeze(-1)
    valid = _dmin_valid(cos2theta, t.inv_wavelength, dmin) if options.use_dmin else None
    return replaced(frame, cos2theta=cos2theta, valid=valid)


def frame_slice(f: PixelFrame, substep: Index, source: Index | None = None) -> PixelFrame:
    """The frame of one sub-step (and source) cut from the frame of all: what pixel_frame computes for
    the restricted inputs, without computing it again."""
    def at(x: torch.Tensor) -> torch.Tensor:
        x = _take(x, 2, substep)
        return x if source is None or x.dim() < 4 else _take(x, 3, source)

    return replaced(f, x=at(f.x), y=at(f.y), z=at(f.z), inverse_path=at(f.inverse_path), cos2theta=at(f.cos2theta),
                    valid=None if f.valid is None else at(f.valid))


def solid_angle(inverse_path: torch.Tensor, t: KernelTensors, options: KernelOptions) -> torch.Tensor:
    """Pixel solid angle ω = pixel²/R²·close/R (or 1/R² for -point_pixel), from 1/R."""
    pixel_size, close_distance = t.scalars.pixel_size_m, t.scalars.close_distance_m
    inverse_sqr = inverse_path * inverse_path
    if options.point_pixel:
        return inverse_sqr
    return pixel_size * pixel_size * close_distance * inverse_sqr * inverse_path


def capture_fraction(f: PixelFrame, layer: torch.Tensor | float, t: KernelTensors,
                     options: KernelOptions) -> torch.Tensor:
    """Fraction of photons absorbed in sensor layer `layer`, for every (pixel, sub-step): (R, C, K)."""
    mu_step = t.scalars.mu_layer_step
    parallax = project(f, t.odet, options)[..., 0] * f.inverse_path
    return torch.exp(-layer * mu_step / parallax) - torch.exp(-(layer + 1.0) * mu_step / parallax)


def polarization_factor(f: PixelFrame, t: KernelTensors, options: KernelOptions) -> torch.Tensor:
    """Kahn factor ½(1 + cos²2θ − K·cos2ψ·sin²2θ) for every (pixel, sub-step, source): (R, C, K, S).

    ψ is the angle of d in the plane of the source's E and B vectors; cos 2ψ = (E² − B²)/(E² + B²)
    from the projections of d, and 1 where both vanish (nanoBragg's atan2(0, 0) = 0).
    "unpolarized" (K = 0) skips that term.
    """
    cos2theta_sqr = f.cos2theta * f.cos2theta
    if options.polarization == "unpolarized":
        return 0.5 * (1.0 + cos2theta_sqr)
    inverse_path = f.inverse_path.unsqueeze(-1)
    e_out = project(f, t.polar_e, options) * inverse_path
    b_out = project(f, t.polar_b, options) * inverse_path
    radius_sqr = e_out * e_out + b_out * b_out
    cos2psi = torch.where(radius_sqr > 0, _safe_ratio(e_out * e_out - b_out * b_out, radius_sqr),
                          torch.ones_like(radius_sqr))
    return 0.5 * (1.0 + cos2theta_sqr - t.scalars.kahn_factor * cos2psi * (1.0 - cos2theta_sqr))


def _safe_ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """numerator/denominator, and 0 where the denominator is 0 (gradient-safe)."""
    nonzero = denominator != 0
    return torch.where(nonzero, numerator / torch.where(nonzero, denominator, torch.ones_like(denominator)),
                       torch.zeros_like(numerator))


def pixel_polarization(f: PixelFrame, t: KernelTensors, options: KernelOptions) -> torch.Tensor:
    """Polarization factor of the first evaluated (sub-step, source) of each pixel, (R, C)."""
    if options.polarization == "none":
        return torch.ones_like(f.inverse_path[:, :, 0])
    if f.valid is None:
        return polarization_factor(frame_slice(f, 0, 0), restrict(t, 0, 0), options)[:, :, 0, 0]
    polar_all = polarization_factor(f, t, options)
    n_sub, n_src = f.valid.shape[2], f.valid.shape[3]
    order = torch.arange(n_sub * n_src, device=f.valid.device).view(1, 1, n_sub, n_src)
    first_index = torch.where(f.valid, order, n_sub * n_src).amin(dim=(2, 3), keepdim=True)
    return torch.where(order == first_index, polar_all, torch.zeros_like(polar_all)).sum(dim=(2, 3))


class StepTerms(NamedTuple):
    """Per (pixel, sub-step, source, orientation) Miller indices and factors, (R, C, K, S, O)."""

    h: torch.Tensor
    k: torch.Tensor
    l: torch.Tensor
    h0: torch.Tensor
    k0: torch.Tensor
    l0: torch.Tensor
    f_latt: torch.Tensor
    f_cell: torch.Tensor


class PixelTerms(NamedTuple):
    """What the step sum needs from each pixel, computed once per pixel (the first kernel stage).

    Pixels come last ("pixels-last" layout), so the compiled step sum runs its SIMD lanes across
    neighbouring pixels and loops over the steps, whose counts are only known at run time:
    projections (3, K, O, R, C), or three (K, O, R, C): a·p, b·p, c·p; inverse_path (K, R, C);
    factor (R, C): scale·capture·polar·ω; valid (K, S, R, C): 1 where -dmin keeps the source (shape
    (1, 1, 1, 1) when -dmin is off).
    """

    projections: torch.Tensor
    inverse_path: torch.Tensor
    factor: torch.Tensor
    valid: torch.Tensor

    @staticmethod
    def values_per_pixel(substeps: int, sources: int, orientations: int) -> int:
        """How many values the terms hold per pixel at most (`valid` holds K·S only with -dmin)."""
        return 3 * substeps * orientations + substeps + 1 + substeps * sources


def miller_indices(projections: torch.Tensor, inverse_path: torch.Tensor, t: KernelTensors,
                   pixels_last: bool = False) -> list[torch.Tensor]:
    """h = a·(d − i)/λ = (a·p)/|p|/λ − (a·i)/λ from the projections: three (R, C, K, S, O) tensors from
    (R, C, K, O) projections and (R, C, K) 1/|p|, or, pixels last, three (K, S, O, R, C) from (K, O, R, C)
    and (K, R, C)."""
    if pixels_last:
        scale = (inverse_path.unsqueeze(1) * t.inv_wavelength.view(-1, 1, 1)).unsqueeze(2)
        return [projections[v].unsqueeze(1) * scale - t.beam_terms[v].unsqueeze(-1).unsqueeze(-1) for v in range(3)]
    scale = (inverse_path.unsqueeze(-1) * t.inv_wavelength).unsqueeze(-1)
    return [projections[v].unsqueeze(3) * scale - t.beam_terms[v] for v in range(3)]


def cell_projections(f: PixelFrame, t: KernelTensors, options: KernelOptions) -> list[torch.Tensor]:
    """a·p, b·p, c·p for every (pixel, sub-step) and orientation: three (R, C, K, O) tensors."""
    return [project(f, t.cells[v], options) for v in range(3)]


def terms_from_projections(projections: torch.Tensor, inverse_path: torch.Tensor, t: KernelTensors,
                           options: KernelOptions, lookup: str | None = None,
                           pixels_last: bool = False) -> StepTerms:
    """Miller indices, lattice factor and structure factor for every step (layout: miller_indices)."""
    default_F, fudge = t.scalars.default_F, t.scalars.fudge
    h, k, l = miller_indices(projections, inverse_path, t, pixels_last)
    h0, k0, l0 = torch.ceil(h - 0.5), torch.ceil(k - 0.5), torch.ceil(l - 0.5)
    f_latt = lattice_factor(h - h0, k - k0, l - l0, t.n_cells, t.reciprocal, fudge, options)
    f_cell = structure_factor(h, k, l, h0, k0, l0, t.grid, t.grid_min, t.grid_max, t.grid_extent, default_F,
                              lookup or options.lookup, source_offsets(t, pixels_last))
    return StepTerms(h, k, l, h0, k0, l0, f_latt, f_cell)


def source_offsets(t: KernelTensors, pixels_last: bool = False) -> torch.Tensor:
    """Each source's table start, shaped to broadcast along the sources of (R, C, K, S, O) steps, or of
    (K, S, O, R, C) ones pixels last."""
    return t.grid_offset.view(1, -1, 1, 1, 1) if pixels_last else t.grid_offset.view(-1, 1)


def step_terms(f: PixelFrame, t: KernelTensors, options: KernelOptions,
               lookup: str | None = None) -> StepTerms:
    """A step's Miller indices and factors per (pixel, sub-step, source, orientation) (`StepTerms`)."""
    return terms_from_projections(cell_projections(f, t, options), f.inverse_path, t, options, lookup)


def last_layer_capture(f: PixelFrame, t: KernelTensors, options: KernelOptions) -> torch.Tensor:
    """Capture fraction of the last sensor layer at its first sub-pixel (what nanoBragg applies), (R, C)."""
    index = t.last_layer_substep
    return capture_fraction(frame_slice(f, index), t.layer_of_substep.index_select(0, index), restrict(t, index),
                            options)[:, :, 0]


def prepare_pixels(rows: torch.Tensor, cols: torch.Tensor, t: KernelTensors,
                   options: KernelOptions, stacked: bool = True) -> PixelTerms:
    """First stage: everything per pixel (and sub-step) that the steps share. `stacked=False` keeps the
    three cell projections separate (a stack is a buffer Inductor writes out, needed only between stages)."""
    f = pixel_frame(rows, cols, t, options)
    omega = solid_angle(f.inverse_path[:, :, 0], t, options)
    capture = last_layer_capture(f, t, options) if options.use_sensor else torch.ones_like(omega)
    polar = pixel_polarization(f, t, options)
    valid = (_pixels_last(f.valid.to(f.x.dtype)) if f.valid is not None
             else torch.ones((1, 1, 1, 1), dtype=f.x.dtype, device=f.x.device))
    projections = [p.permute(2, 3, 0, 1) for p in cell_projections(f, t, options)]
    return PixelTerms(projections=torch.stack(projections) if stacked else projections,
                      inverse_path=_pixels_last(f.inverse_path), factor=t.scalars.scale * capture * polar * omega,
                      valid=valid)


def _pixels_last(x: torch.Tensor) -> torch.Tensor:
    """An (R, C, ...) tensor as a contiguous (..., R, C) one: the step sum's loads along the pixels are
    then plain vector loads. (A copy, not .contiguous(), whose check would specialise counts of 1.)"""
    order = (*range(2, x.dim()), 0, 1)
    return x.permute(order).clone(memory_format=torch.contiguous_format)


def sum_steps(p: PixelTerms, t: KernelTensors,
              options: KernelOptions, weighted: bool = True) -> torch.Tensor:
    """Second stage: r_e²·fluence/steps·(I_bg + Σ w_s·F_cell²·F_latt²)·capture·polar·ω for each pixel, (R, C),
    w_s the source's relative weight (1 but with a spectrum). `weighted=False` leaves w_s out: the
    single-step kernel's one source has relative weight 1 exactly."""
    terms = terms_from_projections(p.projections, p.inverse_path, t, options, pixels_last=True)
    intensity = torch.square(terms.f_cell * terms.f_latt)
    if weighted:
        intensity = intensity * t.source_weight.view(1, -1, 1, 1, 1)
    if options.use_dmin:
        intensity = intensity * p.valid.unsqueeze(2)
    return p.factor * (t.scalars.background + intensity.sum(dim=(0, 1, 2)))


def pixel_kernel(rows: torch.Tensor, cols: torch.Tensor, t: KernelTensors,
                 options: KernelOptions) -> torch.Tensor:
    """Final pixel values (R, C) for a tile, both stages at once (the single-step kernel)."""
    return sum_steps(prepare_pixels(rows, cols, t, options, stacked=False), t, options, weighted=False)


def steps_out_of_range(p: PixelTerms, t: KernelTensors,
                       options: KernelOptions) -> torch.Tensor:
    """(R, C) flags: does any evaluated step of the pixel fall too close to the HKL grid edge to
    interpolate? (nanoBragg then switches interpolation off and looks up the nearest node, that step on.)"""
    terms = terms_from_projections(p.projections, p.inverse_path, t, options, lookup="default", pixels_last=True)
    outside = interpolation_outside(terms, t) & evaluated(terms, p.valid.unsqueeze(2) > 0 if options.use_dmin
                                                          else None, t)
    return outside.any(dim=0).any(dim=0).any(dim=0)


def interpolation_outside(terms: StepTerms, t: KernelTensors) -> torch.Tensor:
    """nanoBragg's test for a 4×4×4 neighbourhood reaching beyond the grid, per step."""
    low = t.grid_min
    high = t.grid_max
    return ((terms.h + 2 > high[0]) | (terms.h - 2 < low[0]) | (terms.k + 2 > high[1]) | (terms.k - 2 < low[1])
            | (terms.l + 2 > high[2]) | (terms.l - 2 < low[2]))


def evaluated(terms: StepTerms, valid: torch.Tensor | None, t: KernelTensors) -> torch.Tensor:
    """Steps nanoBragg evaluates fully: not cut by -dmin (`valid`, broadcastable to the steps), and
    F_latt ≠ 0 unless there is water."""
    mask = (terms.f_latt != 0) | (t.scalars.background != 0)
    if valid is not None:
        mask = mask & valid
    return mask


def _dmin_valid(cos2theta: torch.Tensor, inv_wavelength: torch.Tensor, dmin: torch.Tensor) -> torch.Tensor:
    """Sources kept by -dmin: d = 1/(2·stol) at least dmin, stol = ½|d − i|/λ (or stol = 0)."""
    stol = 0.5 * inv_wavelength * torch.sqrt(torch.clamp(2.0 - 2.0 * cos2theta, min=0.0))
    return (stol <= 0) | (dmin <= 0.5 / torch.where(stol > 0, stol, torch.ones_like(stol)))
