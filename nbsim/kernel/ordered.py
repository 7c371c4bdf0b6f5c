"""Step-ordered evaluation for nanoBragg behaviour that depends on the order of its loops.

The fused kernel sums all steps at once. A few reference behaviours need the C's loop order
(sensor layer → sub-pixel → source → phi → mosaic domain) instead:

* `-oversample_thick/_polar/_omega` multiply the *running* sum by the factor after every step (under
  `-physics corrected`, each contribution instead);
* the first evaluation of each OpenMP thread uses the unrotated crystal at a phi step of exactly 0
  (later ones reuse the previous orientation);
* tricubic interpolation stops for the rest of the run at the first step too close to the HKL grid
  edge: that step and every later one (the rest of the pixel included) take the nearest node.

This module evaluates tiles in that order: a Python loop over (sub-step, source) blocks, vectorised
over pixels and crystal orientations. It is slower than the kernel and only used where needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .inputs import KernelOptions, KernelTensors, Lookup
from .physics import (
    StepTerms,
    capture_fraction,
    evaluated,
    frame_slice,
    interpolation_outside,
    pixel_frame,
    pixel_polarization,
    polarization_factor,
    restrict,
    solid_angle,
    source_offsets,
    step_terms,
    structure_factor,
)


@dataclass(frozen=True)
class OrderedOptions:
    """What the step-ordered evaluation must reproduce for a tile."""

    oversample_thick: bool = False
    oversample_polar: bool = False
    oversample_omega: bool = False
    first_evaluation: KernelTensors | None = None
    """Inputs whose first phi step holds the unrotated crystal: used for the tile's pixel (0, 0) at its first
    sub-step and source that -dmin keeps (nanoBragg's first evaluation in a thread)."""
    interpolation_switch: bool = False
    """Interpolate until the first out-of-range step of the tile's pixel (0, 0), then look up nearest."""
    lookup: Lookup | None = None
    """The lookup of every step where it is not the options' (None): "nearest" for a pixel after the
    interpolation switch that is rendered here for another reason (a thread's first pixel)."""
    corrected: bool = False
    """-physics corrected: the -oversample_* factors multiply each contribution, not the running sum (and
    -oversample_thick without a sensor thickness captures everything instead of nothing)."""


@dataclass
class Trace:
    """The last evaluated step of a pixel, as nanoBragg's -printout_pixel shows it."""

    hkl: tuple[float, float, float]
    hkl0: tuple[int, int, int]
    f_cell: float
    f_latt: float
    intensity: float
    polar: float
    omega: float
    capture: float


def render_ordered(rows: torch.Tensor, cols: torch.Tensor, t: KernelTensors, options: KernelOptions,
                   ordered: OrderedOptions) -> tuple[torch.Tensor, Trace]:
    """Pixel values (R, C) evaluated in nanoBragg's loop order, and the trace of pixel (0, 0)."""
    scale, background = t.scalars.scale, t.scalars.background
    f = pixel_frame(rows, cols, t, options)
    n_sub, n_src = f.cos2theta.shape[2], f.cos2theta.shape[3]
    omega_each = solid_angle(f.inverse_path, t, options)
    # With -oversample_thick the fraction is evaluated even without a sensor thickness, as in
    # nanoBragg (where it is then exp(0) − exp(0) = 0 and the image is blank).
    capture_each = (capture_fraction(f, t.layer_of_substep, t, options)
                    if options.use_sensor or (ordered.oversample_thick and not ordered.corrected)
                    else torch.ones_like(omega_each))
    polar_each = (torch.ones_like(f.cos2theta) if options.polarization == "none"
                  else polarization_factor(f, t, options))
    running = torch.full_like(omega_each[:, :, 0], float(background))
    interpolating = ordered.interpolation_switch
    lookup = ordered.lookup
    last = None
    first_pending = ordered.first_evaluation is not None
    for k in range(n_sub):
        for s in range(n_src):
            block_inputs = restrict(t, k, s)
            block = frame_slice(f, k, s)
            terms = step_terms(block, block_inputs, options, lookup)
            if first_pending and (block.valid is None or bool(block.valid[0, 0].any())):
                first_inputs = restrict(ordered.first_evaluation, k, s)
                terms = _with_first_evaluation(terms, step_terms(block, first_inputs, options, lookup))
                first_pending = False
            mask = evaluated(terms, None if block.valid is None else block.valid.unsqueeze(-1), t)[:, :, 0, 0, :]
            f_cell = terms.f_cell[:, :, 0, 0, :]
            if interpolating:
                f_cell, interpolating = _switching_lookup(terms, mask, block_inputs)
                if not interpolating:
                    # Interpolation is off for the rest of the run: this pixel's later steps look up nearest.
                    lookup = "nearest"
            term = f_cell * f_cell * terms.f_latt[:, :, 0, 0, :] ** 2 * block_inputs.source_weight
            factor = torch.ones_like(running)
            if ordered.oversample_thick:
                factor = factor * capture_each[:, :, k]
            if ordered.oversample_polar:
                factor = factor * polar_each[:, :, k, s]
            if ordered.oversample_omega:
                factor = factor * omega_each[:, :, k]
            if ordered.corrected:
                running = running + (term * mask.to(term.dtype) * factor.unsqueeze(-1)).sum(-1)
            else:
                running = _accumulate(running, term, mask, factor)
            last = (terms, f_cell)
    capture = capture_each[:, :, -1] if ordered.oversample_thick else _last_layer_capture(capture_each, t, options)
    polar = polar_each[:, :, -1, -1] if ordered.oversample_polar else pixel_polarization(f, t, options)
    omega = omega_each[:, :, -1] if ordered.oversample_omega else omega_each[:, :, 0]
    result = running
    for applied_per_step, value in ((ordered.oversample_thick, capture), (ordered.oversample_polar, polar),
                                    (ordered.oversample_omega, omega)):
        if not applied_per_step:
            result = result * value
    return scale * result, _trace(*last, running, polar, omega, capture)


def _accumulate(running: torch.Tensor, term: torch.Tensor, mask: torch.Tensor, factor: torch.Tensor):
    """I ← (I + term)·factor for each evaluated step in order, in closed form over the block."""
    weights = mask.to(term.dtype)
    remaining = torch.flip(torch.cumsum(torch.flip(weights, [-1]), -1), [-1])
    factor = factor.unsqueeze(-1)
    return running * factor[..., 0] ** weights.sum(-1) + (term * weights * factor ** remaining).sum(-1)


def _with_first_evaluation(terms: StepTerms, first: StepTerms) -> StepTerms:
    """For pixel (0, 0) only, the first phi step's orientations come from `first`."""
    domains = first.h.shape[-1]
    fields = []
    for current, replacement in zip(terms, first, strict=True):
        patched = current.clone()
        patched[0, 0, :, :, :domains] = replacement[0, 0]
        fields.append(patched)
    return StepTerms(*fields)


def _switching_lookup(terms: StepTerms, mask: torch.Tensor, t: KernelTensors) -> tuple[torch.Tensor, bool]:
    """Interpolated F before the first out-of-range evaluated step, nearest from it on (nanoBragg sets
    F_cell = default_F there but, interpolation now off, overwrites it with the nearest lookup)."""
    interpolated = terms.f_cell[:, :, 0, 0, :]
    nearest = structure_factor(terms.h, terms.k, terms.l, terms.h0, terms.k0, terms.l0, t.grid, t.grid_min,
                               t.grid_max, t.grid_extent, t.scalars.default_F, "nearest",
                               source_offsets(t))[:, :, 0, 0, :]
    outside = interpolation_outside(terms, t)[:, :, 0, 0, :] & mask
    if not bool(outside.any()):
        return interpolated, True
    position = torch.arange(outside.shape[-1], device=outside.device)
    first = torch.where(outside, position, outside.shape[-1]).amin(-1, keepdim=True)
    f_cell = torch.where(position < first, interpolated, nearest)
    return f_cell, False


def _last_layer_capture(capture_each: torch.Tensor, t: KernelTensors, options: KernelOptions) -> torch.Tensor:
    if not options.use_sensor:
        return torch.ones_like(capture_each[:, :, 0])
    return capture_each.index_select(2, t.last_layer_substep)[:, :, 0]


def _trace(terms: StepTerms, f_cell: torch.Tensor, running: torch.Tensor, polar: torch.Tensor,
           omega: torch.Tensor, capture: torch.Tensor) -> Trace:
    def value(v: torch.Tensor) -> float:
        return float(v.detach())

    def index(v: torch.Tensor) -> int:
        """nanoBragg's int h0: x86's conversion gives INT_MIN for NaN and out-of-range values."""
        number = value(v)
        return int(number) if math.isfinite(number) and abs(number) < 2**31 else -2**31

    return Trace(hkl=tuple(value(v[0, 0, 0, 0, -1]) for v in (terms.h, terms.k, terms.l)),
                 hkl0=tuple(index(v[0, 0, 0, 0, -1]) for v in (terms.h0, terms.k0, terms.l0)),
                 f_cell=value(f_cell[0, 0, -1]), f_latt=value(terms.f_latt[0, 0, 0, 0, -1]),
                 intensity=value(running[0, 0]), polar=value(polar[0, 0]), omega=value(omega[0, 0]),
                 capture=value(capture[0, 0]))
