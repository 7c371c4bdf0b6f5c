"""The per-pixel physics as one pure tensor function, written so that torch.compile fuses it.

Every quantity is an explicit per-component expression broadcast over
(rows, cols, sub-pixels×layers, sources, crystal orientations); the sum over the last three axes is
the final reduction, so Inductor emits one loop nest and never materialises the step product.
The same function runs eagerly (the `-compile off` path) on small tiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .structure_factors import lagrange_weights

ROUND_SHAPE_NORM = 0.723601254558268
GAUSS_WIDTH = 0.63
TOPHAT_RADIUS_SQR = 0.3969


@dataclass(frozen=True)
class KernelOptions:
    """Choices that change the code the kernel compiles to (hashable, passed as constants)."""

    shape: str = "square"
    lookup: str = "default"  # "default" (no grid), "nearest" or "interpolate"
    point_pixel: bool = False
    curved: bool = False
    polarization: str = "kahn"  # "none" or "kahn"
    use_dmin: bool = False
    sensor_layers: int = 1
    use_sensor: bool = False
    first_layer_substeps: int = 1
    square_axes: tuple[bool, bool, bool] = (True, True, True)


def _sincg(fraction: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """sin(Nπh)/sin(πh) from the fractional index h − h0 (exact at integers, accurate in float32)."""
    x = math.pi * fraction
    at_node = fraction == 0
    denominator = torch.where(at_node, torch.ones_like(x), torch.sin(x))
    return torch.where(at_node, n * torch.ones_like(x), torch.sin(n * x) / denominator)


def _sinc3(x: torch.Tensor) -> torch.Tensor:
    """Fourier transform of a sphere, 3(sin x − x cos x)/x³, with its limit 1 at x = 0."""
    at_zero = x == 0
    safe = torch.where(at_zero, torch.ones_like(x), x)
    return torch.where(at_zero, torch.ones_like(x), 3.0 * (torch.sin(safe) / safe - torch.cos(safe)) / (safe * safe))


def _gather(grid: torch.Tensor, h: torch.Tensor, k: torch.Tensor, l: torch.Tensor,
            grid_min: torch.Tensor, grid_shape: tuple[int, int, int]) -> torch.Tensor:
    """grid[h, k, l] for integer-valued index tensors already known to lie inside the grid."""
    nk, nl = grid_shape[1], grid_shape[2]
    index = ((h - grid_min[0]) * nk + (k - grid_min[1])) * nl + (l - grid_min[2])
    index = index.clamp(0, grid.numel() - 1).to(torch.int64)
    return grid[index]


def structure_factor(h: torch.Tensor, k: torch.Tensor, l: torch.Tensor,
                     h0: torch.Tensor, k0: torch.Tensor, l0: torch.Tensor,
                     grid: torch.Tensor, grid_min: torch.Tensor, grid_max: torch.Tensor,
                     grid_shape: tuple[int, int, int], default_F: torch.Tensor, lookup: str) -> torch.Tensor:
    """F_cell at fractional (h, k, l): default_F, nearest grid node, or tricubic interpolation."""
    if lookup == "default":
        return default_F.expand_as(h)
    if lookup == "nearest":
        inside = ((h0 >= grid_min[0]) & (h0 <= grid_max[0]) & (k0 >= grid_min[1]) & (k0 <= grid_max[1])
                  & (l0 >= grid_min[2]) & (l0 <= grid_max[2]))
        return torch.where(inside, _gather(grid, h0, k0, l0, grid_min, grid_shape), default_F)
    h_floor, k_floor, l_floor = torch.floor(h), torch.floor(k), torch.floor(l)
    wh = lagrange_weights(h - h_floor)
    wk = lagrange_weights(k - k_floor)
    wl = lagrange_weights(l - l_floor)
    total = torch.zeros_like(h)
    for i in range(4):
        for j in range(4):
            for m in range(4):
                node = _gather(grid, h_floor + (i - 1), k_floor + (j - 1), l_floor + (m - 1), grid_min, grid_shape)
                total = total + wh[i] * wk[j] * wl[m] * node
    return total


def lattice_factor(dh: torch.Tensor, dk: torch.Tensor, dl: torch.Tensor, n_cells: torch.Tensor,
                   reciprocal: torch.Tensor, fudge: torch.Tensor, options: KernelOptions) -> torch.Tensor:
    """F_latt from the distance (dh, dk, dl) to the nearest node, for the crystal shape in options."""
    na, nb, nc = n_cells[0], n_cells[1], n_cells[2]
    if options.shape == "square":
        factor = torch.ones_like(dh)
        for use, fraction, n in zip(options.square_axes, (dh, dk, dl), (na, nb, nc), strict=True):
            if use:
                factor = factor * _sincg(fraction, n)
        return factor
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


def _rotate_components(x, y, z, axis: torch.Tensor, angle: torch.Tensor):
    """Component-wise Rodrigues rotation (used by the curved detector)."""
    cos_a, sin_a = torch.cos(angle), torch.sin(angle)
    along = (axis[0] * x + axis[1] * y + axis[2] * z) * (1.0 - cos_a)
    return (axis[0] * along + x * cos_a + (axis[1] * z - axis[2] * y) * sin_a,
            axis[1] * along + y * cos_a + (axis[2] * x - axis[0] * z) * sin_a,
            axis[2] * along + z * cos_a + (axis[0] * y - axis[1] * x) * sin_a)


def diffracted_directions(rows: torch.Tensor, cols: torch.Tensor, frame: torch.Tensor, offsets: torch.Tensor,
                          pixel_size: torch.Tensor, distance: torch.Tensor, options: KernelOptions):
    """Unit diffracted vectors and path lengths for every (row, col, sub-step), each (R, C, K).

    frame rows: pix0, fdet, sdet, odet, beam (metres, unit vectors); offsets rows: fast and slow
    sub-pixel offsets and layer depth (metres) for each of the K sub-steps.
    """
    pix0, fdet, sdet, odet, beam = frame[0], frame[1], frame[2], frame[3], frame[4]
    f_pos = cols.view(1, -1, 1) * pixel_size + offsets[0].view(1, 1, -1)
    s_pos = rows.view(-1, 1, 1) * pixel_size + offsets[1].view(1, 1, -1)
    depth = offsets[2].view(1, 1, -1)
    x = pix0[0] + f_pos * fdet[0] + s_pos * sdet[0] + depth * odet[0]
    y = pix0[1] + f_pos * fdet[1] + s_pos * sdet[1] + depth * odet[1]
    z = pix0[2] + f_pos * fdet[2] + s_pos * sdet[2] + depth * odet[2]
    if options.curved:
        bx, by, bz = distance * beam[0], distance * beam[1], distance * beam[2]
        bx, by, bz = _rotate_components(bx, by, bz, sdet, y / distance)
        x, y, z = _rotate_components(bx, by, bz, fdet, z / distance)
    airpath = torch.sqrt(x * x + y * y + z * z)
    return x / airpath, y / airpath, z / airpath, airpath


def polarization_factor(dx, dy, dz, ix, iy, iz, axis: torch.Tensor, kahn: torch.Tensor) -> torch.Tensor:
    """Kahn polarization factor ½(1 + cos²2θ − K·cos2ψ·sin²2θ) for incident i and diffracted d.

    ψ is the angle of d projected on the plane of E = i × (axis × i) and B = axis × i; cos 2ψ is
    taken from those projections directly, and a degenerate frame gives ψ = 0 as in nanoBragg.
    """
    cos2theta = ix * dx + iy * dy + iz * dz
    cos2theta_sqr = cos2theta * cos2theta
    bx = axis[1] * iz - axis[2] * iy
    by = axis[2] * ix - axis[0] * iz
    bz = axis[0] * iy - axis[1] * ix
    ex = iy * bz - iz * by
    ey = iz * bx - ix * bz
    ez = ix * by - iy * bx
    b_out = _safe_ratio(dx * bx + dy * by + dz * bz, torch.sqrt(bx * bx + by * by + bz * bz))
    e_out = _safe_ratio(dx * ex + dy * ey + dz * ez, torch.sqrt(ex * ex + ey * ey + ez * ez))
    radius_sqr = e_out * e_out + b_out * b_out
    cos2psi = torch.where(radius_sqr > 0, _safe_ratio(e_out * e_out - b_out * b_out, radius_sqr),
                          torch.ones_like(radius_sqr))
    return 0.5 * (1.0 + cos2theta_sqr - kahn * cos2psi * (1.0 - cos2theta_sqr))


def _safe_ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """numerator/denominator, and 0 where the denominator is 0 (gradient-safe)."""
    nonzero = denominator != 0
    return torch.where(nonzero, numerator / torch.where(nonzero, denominator, torch.ones_like(denominator)),
                       torch.zeros_like(numerator))


class KernelTensors(NamedTuple):
    """Inputs shared by every tile (all on the compute device and dtype).

    frame rows: pix0, fdet, sdet, odet, beam, polarization axis. offsets rows: fast and slow sub-pixel
    offsets and layer depth (m) for each sub-step. scalars: pixel size, distance, close distance,
    scale (r_e²·fluence/steps), I_bg, Kahn factor, μ·layer step, dmin (Å), default_F, fudge.
    """

    frame: torch.Tensor
    offsets: torch.Tensor
    incident: torch.Tensor
    inv_wavelength: torch.Tensor
    cells: torch.Tensor
    grid: torch.Tensor
    grid_min: torch.Tensor
    grid_max: torch.Tensor
    n_cells: torch.Tensor
    reciprocal: torch.Tensor
    scalars: torch.Tensor


class PixelFrame(NamedTuple):
    """Per (pixel, sub-step) directions and per (pixel, sub-step, source) scattering vectors."""

    dx: torch.Tensor
    dy: torch.Tensor
    dz: torch.Tensor
    airpath: torch.Tensor
    sx: torch.Tensor
    sy: torch.Tensor
    sz: torch.Tensor
    valid: torch.Tensor | None


def pixel_frame(rows: torch.Tensor, cols: torch.Tensor, t: KernelTensors, options: KernelOptions) -> PixelFrame:
    """Diffracted directions (R, C, K) and scattering vectors S = (d − i)/λ in Å⁻¹ (R, C, K, S)."""
    pixel_size, distance, dmin = t.scalars[0], t.scalars[1], t.scalars[7]
    dx, dy, dz, airpath = diffracted_directions(rows, cols, t.frame, t.offsets, pixel_size, distance, options)
    ix, iy, iz = (t.incident[:, j].view(1, 1, 1, -1) for j in range(3))
    inv_lam = t.inv_wavelength.view(1, 1, 1, -1)
    sx = (dx.unsqueeze(-1) - ix) * inv_lam
    sy = (dy.unsqueeze(-1) - iy) * inv_lam
    sz = (dz.unsqueeze(-1) - iz) * inv_lam
    valid = _dmin_valid(sx, sy, sz, dmin) if options.use_dmin else None
    return PixelFrame(dx, dy, dz, airpath, sx, sy, sz, valid)


def solid_angle(airpath: torch.Tensor, t: KernelTensors, options: KernelOptions) -> torch.Tensor:
    """Pixel solid angle ω = pixel²/R²·close/R (or 1/R² for -point_pixel)."""
    pixel_size, close_distance = t.scalars[0], t.scalars[2]
    if options.point_pixel:
        return 1.0 / (airpath * airpath)
    return pixel_size * pixel_size / (airpath * airpath) * close_distance / airpath


def capture_fraction(dx, dy, dz, layer: torch.Tensor | float, t: KernelTensors) -> torch.Tensor:
    """Fraction of photons absorbed in sensor layer `layer` along direction d."""
    odet, mu_step = t.frame[3], t.scalars[6]
    parallax = dx * odet[0] + dy * odet[1] + dz * odet[2]
    return torch.exp(-layer * mu_step / parallax) - torch.exp(-(layer + 1.0) * mu_step / parallax)


def pixel_polarization(f: PixelFrame, t: KernelTensors, options: KernelOptions) -> torch.Tensor:
    """Polarization factor of the first evaluated (sub-step, source) of each pixel, (R, C)."""
    kahn = t.scalars[5]
    if options.polarization == "none":
        return torch.ones_like(f.dx[:, :, 0])
    if f.valid is None:
        return polarization_factor(f.dx[:, :, 0], f.dy[:, :, 0], f.dz[:, :, 0], t.incident[0, 0],
                                   t.incident[0, 1], t.incident[0, 2], t.frame[5], kahn)
    ix, iy, iz = (t.incident[:, j].view(1, 1, 1, -1) for j in range(3))
    polar_all = polarization_factor(f.dx.unsqueeze(-1), f.dy.unsqueeze(-1), f.dz.unsqueeze(-1), ix, iy, iz,
                                    t.frame[5], kahn)
    n_sub, n_src = f.valid.shape[2], f.valid.shape[3]
    order = torch.arange(n_sub * n_src, device=f.valid.device).view(1, 1, n_sub, n_src)
    first = torch.where(f.valid, order, n_sub * n_src).amin(dim=(2, 3), keepdim=True)
    return torch.where(order == first, polar_all, torch.zeros_like(polar_all)).sum(dim=(2, 3))


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


def step_terms(f: PixelFrame, t: KernelTensors, grid_shape: tuple[int, int, int], options: KernelOptions,
               lookup: str | None = None) -> StepTerms:
    """Miller indices as explicit component products, lattice factor and structure factor per step."""
    default_F, fudge = t.scalars[8], t.scalars[9]
    sx, sy, sz = f.sx.unsqueeze(-1), f.sy.unsqueeze(-1), f.sz.unsqueeze(-1)
    a, b, c = (t.cells[:, v, :] for v in range(3))
    h = sx * a[:, 0] + sy * a[:, 1] + sz * a[:, 2]
    k = sx * b[:, 0] + sy * b[:, 1] + sz * b[:, 2]
    l = sx * c[:, 0] + sy * c[:, 1] + sz * c[:, 2]
    h0, k0, l0 = torch.ceil(h - 0.5), torch.ceil(k - 0.5), torch.ceil(l - 0.5)
    f_latt = lattice_factor(h - h0, k - k0, l - l0, t.n_cells, t.reciprocal, fudge, options)
    f_cell = structure_factor(h, k, l, h0, k0, l0, t.grid, t.grid_min, t.grid_max, grid_shape, default_F,
                              lookup or options.lookup)
    return StepTerms(h, k, l, h0, k0, l0, f_latt, f_cell)


def pixel_kernel(rows: torch.Tensor, cols: torch.Tensor, t: KernelTensors, grid_shape: tuple[int, int, int],
                 options: KernelOptions) -> torch.Tensor:
    """Final pixel values (R, C) for a tile: r_e²·fluence·(I_bg + ΣF²·F_latt²)/steps·capture·polar·ω."""
    scale, background = t.scalars[3], t.scalars[4]
    f = pixel_frame(rows, cols, t, options)
    omega = solid_angle(f.airpath[:, :, 0], t, options)
    if options.use_sensor:
        k_last = (options.sensor_layers - 1) * options.first_layer_substeps
        capture = capture_fraction(f.dx[:, :, k_last], f.dy[:, :, k_last], f.dz[:, :, k_last],
                                   float(options.sensor_layers - 1), t)
    else:
        capture = torch.ones_like(omega)
    polar = pixel_polarization(f, t, options)
    terms = step_terms(f, t, grid_shape, options)
    intensity = terms.f_cell * terms.f_cell * terms.f_latt * terms.f_latt
    if f.valid is not None:
        intensity = torch.where(f.valid.unsqueeze(-1), intensity, torch.zeros_like(intensity))
    total = intensity.sum(dim=(2, 3, 4))
    return scale * (background + total) * capture * polar * omega


def interpolation_out_of_range(rows: torch.Tensor, cols: torch.Tensor, t: KernelTensors,
                               grid_shape: tuple[int, int, int], options: KernelOptions) -> torch.Tensor:
    """(R, C) flags: does any evaluated step of the pixel fall too close to the HKL grid edge to
    interpolate? (nanoBragg then uses default_F for that step and switches interpolation off.)"""
    f = pixel_frame(rows, cols, t, options)
    terms = step_terms(f, t, grid_shape, options, lookup="default")
    outside = interpolation_outside(terms, t) & evaluated(terms, f, t)
    return outside.any(dim=4).any(dim=3).any(dim=2)


def interpolation_outside(terms: StepTerms, t: KernelTensors) -> torch.Tensor:
    """nanoBragg's test for a 4×4×4 neighbourhood reaching beyond the grid, per step."""
    low = t.grid_min
    high = t.grid_max
    return ((terms.h + 2 > high[0]) | (terms.h - 2 < low[0]) | (terms.k + 2 > high[1]) | (terms.k - 2 < low[1])
            | (terms.l + 2 > high[2]) | (terms.l - 2 < low[2]))


def evaluated(terms: StepTerms, f: PixelFrame, t: KernelTensors) -> torch.Tensor:
    """Steps nanoBragg evaluates fully: not cut by -dmin, and F_latt ≠ 0 unless there is water."""
    mask = (terms.f_latt != 0) | (t.scalars[4] != 0)
    if f.valid is not None:
        mask = mask & f.valid.unsqueeze(-1)
    return mask


def _dmin_valid(sx: torch.Tensor, sy: torch.Tensor, sz: torch.Tensor, dmin: torch.Tensor) -> torch.Tensor:
    """Sources kept by -dmin: those with d = 1/(2·stol) at least dmin (or stol = 0)."""
    stol = 0.5 * torch.sqrt(sx * sx + sy * sy + sz * sz)
    return (stol <= 0) | (dmin <= 0.5 / torch.where(stol > 0, stol, torch.ones_like(stol)))
