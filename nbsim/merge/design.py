"""The F step's linear model: every fitted pixel's expected count as a sparse linear function of the |F|².

Under the nearest-node lookup a step of a pixel reads one node of the table, so with the shots fixed a
pixel's expected count is λ_p = b_p + s_p·(c_p + Σ_j A_pj·|F_j|²): b_p the shot step's fixed background,
s_p the scale of the pixel's shot, c_p what the pixel has from nodes no refined parameter holds (and the
kernel's constant background), and A_pj the factor (solid angle, polarization, r_e²·fluence/steps...) times
Σ w·F_latt² over the pixel's steps (sub-pixels, sources, orientations) whose nearest node holds parameter j
(an F(+) or an F(−): the table's nodes map to parameters, `reflections.node_parameters`).

`shot_design` computes A and c once per F step, by the render kernel's own stages (nbsim.kernel.physics:
`prepare_pixels`, then the per-step Miller indices and lattice factor of `terms_from_projections`), so every
crystal shape, sampling, spectrum, sensor and -dmin the kernel renders is modelled alike; the entries are
coalesced per (pixel, parameter). `Design` lays every shot of a worker's end to end: each evaluation of the
likelihood, its gradients, the EM steps and the Fisher information is then a few sparse products over all the
worker's pixels at once (one gather, one scatter-add each), with no kernel call and no loop over shots.

Memory: 24 bytes an entry (int64 pixel and parameter, float64 weight) and 40 bytes a pixel (counts,
background, constant, shot index, its expected count); a pixel of a still sees one to three parameters
(one node per sub-pixel and source near a spot, its neighbour's where two spots' tails meet), so a shot of
200 shoeboxes of 9² pixels takes about 1 MB.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import NbsimError
from ..fit.likelihood import negative_log_likelihood
from ..fit.newton import fisher_weights
from ..kernel.inputs import kernel_inputs
from ..kernel.physics import prepare_pixels, terms_from_projections
from ..resolve import Setup

CHUNK_STEPS = 1 << 20
"""Pixel-steps per pass of `shot_design`: bounds its per-step tensors (a few of 8 MB in float64)."""


@dataclass
class ShotDesign:
    """One shot's A (entries: local pixel, parameter, weight; each (pixel, parameter) once) and c per pixel,
    in photons per unit |F|² before the shot's scale."""

    pixel: torch.Tensor
    parameter: torch.Tensor
    weight: torch.Tensor
    constant: torch.Tensor


def shot_design(setup: Setup, rows: np.ndarray, cols: np.ndarray, nodes: torch.Tensor, base: torch.Tensor,
                device: str | torch.device) -> ShotDesign:
    """A shot's design at its pixels (rows, cols) as its set-up renders them: `nodes` maps every node of the
    padded table (flat) to its parameter (−1: none), `base` holds the table's values there (what unmapped
    nodes contribute, squared). In float64 on `device`."""
    device = torch.device(device)
    dtype = torch.float64
    with torch.no_grad():
        inputs = kernel_inputs(setup, device, dtype)
        t, options = inputs.tensors, inputs.options
        extent = t.grid_extent.to(torch.int64)
        row_values = torch.as_tensor(np.asarray(rows), dtype=dtype, device=device)
        col_values = torch.as_tensor(np.asarray(cols), dtype=dtype, device=device).view(-1, 1)
        count = len(row_values)
        per_chunk = max(1, CHUNK_STEPS // max(setup.steps, 1))
        size = int(nodes.max()) + 1 if len(nodes) else 1
        pixels, parameters, weights, constants = [], [], [], []
        for first in range(0, count, per_chunk):
            chunk = slice(first, min(first + per_chunk, count))
            terms = prepare_pixels(row_values[chunk], col_values[chunk], t, options)
            steps_of = terms_from_projections(terms.projections, terms.inverse_path, t, options, lookup="default",
                                              pixels_last=True)
            weight = torch.square(steps_of.f_latt) * t.source_weight.view(1, -1, 1, 1, 1)
            if options.use_dmin:
                weight = weight * terms.valid.unsqueeze(2)
            indices = [torch.clamp(x, t.grid_min[v] - 1.0, t.grid_max[v] + 1.0)
                       for v, x in enumerate((steps_of.h0, steps_of.k0, steps_of.l0))]
            if not all(bool(torch.isfinite(index).all()) for index in indices):
                raise NbsimError(f"a shot's model at the F step is not finite (cell {setup.lattice.cell_parameters()})")
            node = [(index - t.grid_min[v] + 1.0).to(torch.int64) for v, index in enumerate(indices)]
            flat, weight = torch.broadcast_tensors((node[0] * extent[1] + node[1]) * extent[2] + node[2], weight)
            pixels_here = chunk.stop - chunk.start
            flat, weight = flat.reshape(-1, pixels_here), weight.reshape(-1, pixels_here)
            parameter = nodes[flat]
            factor = terms.factor.reshape(-1)
            unmapped = torch.where(parameter < 0, weight * torch.square(base[flat]), torch.zeros_like(weight))
            constants.append(factor * (t.scalars.background + unmapped.sum(dim=0)))
            local = torch.arange(pixels_here, dtype=torch.int64, device=device).expand_as(parameter)
            seen = (parameter >= 0) & (weight != 0)
            keys = local[seen] * size + parameter[seen]
            unique, inverse = torch.unique(keys, return_inverse=True)
            summed = torch.zeros(len(unique), dtype=dtype, device=device).index_add_(0, inverse, weight[seen])
            pixel = unique // size
            pixels.append(pixel + chunk.start)
            parameters.append(unique % size)
            weights.append(summed * factor[pixel])
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return ShotDesign(pixel=torch.cat(pixels) if pixels else empty,
                          parameter=torch.cat(parameters) if parameters else empty,
                          weight=torch.cat(weights) if weights else empty.to(dtype),
                          constant=torch.cat(constants) if constants else empty.to(dtype))


class Design:
    """A worker's shots as one sparse system: λ_p = b_p + s_p·(c_p + Σ_j A_pj·|F_j|²) over every fitted pixel
    of every shot (shot k's pixels after shot k − 1's), `scales` the shots' scales (kept here: the F step
    refines them), the likelihood of `counts` as nbsim.fit defines it (`kind`, `readout_photons`)."""

    def __init__(self, shots: Sequence[ShotDesign], counts: Sequence[torch.Tensor], backgrounds: Sequence[torch.Tensor],
                 scales: Sequence[float], size: int, readout_photons: float, kind: str, device: str | torch.device):
        device = torch.device(device)
        self.size, self.readout, self.kind, self.device = size, readout_photons, kind, device
        lengths = [len(design.constant) for design in shots]
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])

        def joined(parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
            return torch.cat([part.to(device, dtype) for part in parts]) if parts else \
                torch.zeros(0, dtype=dtype, device=device)

        self.pixel = joined([design.pixel + int(offset) for design, offset in zip(shots, offsets, strict=False)],
                            torch.int64)
        self.parameter = joined([design.parameter for design in shots], torch.int64)
        self.weight = joined([design.weight for design in shots], torch.float64)
        self.constant = joined([design.constant for design in shots], torch.float64)
        self.counts = joined(counts, torch.float64)
        self.background = joined(backgrounds, torch.float64)
        self.shot = torch.repeat_interleave(torch.arange(len(shots), device=device),
                                            torch.as_tensor(lengths, dtype=torch.int64, device=device))
        self.scales = torch.as_tensor(list(scales), dtype=torch.float64, device=device)
        self.shots = len(shots)

    def unscaled(self, intensities: torch.Tensor) -> torch.Tensor:
        """c_p + Σ_j A_pj·I_j at every pixel, I = |F|² (on the design's device)."""
        contributions = self.weight * intensities[self.parameter]
        return self.constant.clone().index_add_(0, self.pixel, contributions)

    def transposed(self, per_pixel: torch.Tensor, squared: bool = False) -> torch.Tensor:
        """Σ_p A_pj·v_p (or Σ_p A_pj²·v_p with `squared`) for every parameter j."""
        weight = self.weight * self.weight if squared else self.weight
        return torch.zeros(self.size, dtype=torch.float64, device=self.device).index_add_(
            0, self.parameter, weight * per_pixel[self.pixel])

    def per_shot(self, per_pixel: torch.Tensor) -> torch.Tensor:
        """Σ over each shot's pixels."""
        return torch.zeros(self.shots, dtype=torch.float64, device=self.device).index_add_(0, self.shot, per_pixel)

    def state(self, log_F: torch.Tensor, log_scale_change: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """|F|², each pixel's scale and its signal s_p·(c_p + Σ_j A_pj·|F_j|²) at these log|F| and changes of the
        shots' log scales (None: none)."""
        intensities = torch.exp(2.0 * log_F.to(self.device, torch.float64))
        scales = self.scales if log_scale_change is None else \
            self.scales * torch.exp(log_scale_change.to(self.device, torch.float64))
        pixel_scale = scales[self.shot]
        return intensities, pixel_scale, pixel_scale * self.unscaled(intensities)

    def expected(self, signal: torch.Tensor) -> torch.Tensor:
        """λ_p: the signal plus the fixed background."""
        return signal + self.background

    def likelihood(self, log_F: torch.Tensor, log_scale_change: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The negative log-likelihood of every pixel, its gradient in log|F| and in each shot's log-scale change
        (on the CPU)."""
        intensities, pixel_scale, signal = self.state(log_F, log_scale_change)
        expected = self.expected(signal).requires_grad_(True)
        with torch.enable_grad():
            nll = negative_log_likelihood(expected, self.counts, self.readout, self.kind)
            by_pixel = torch.autograd.grad(nll, expected)[0]
        gradient = 2.0 * intensities * self.transposed(by_pixel * pixel_scale)
        return nll.detach().cpu(), gradient.cpu(), self.per_shot(by_pixel * signal).cpu()

    def signal_gradient(self, log_F: torch.Tensor) -> torch.Tensor:
        """∂/∂log|F_j| of the total signal Σ_p s_p·A_pj·|F_j|²: 2|F_j|²·Σ_p s_p·A_pj (the EM steps' scale)."""
        intensities, pixel_scale, _ = self.state(log_F)
        return (2.0 * intensities * self.transposed(pixel_scale)).cpu()

    def fisher_diagonal(self, log_F: torch.Tensor) -> torch.Tensor:
        """The diagonal of the Fisher information of log|F|: Σ_p (∂λ_p/∂log|F_j|)²·w_p, ∂λ_p/∂log|F_j| =
        2·s_p·A_pj·|F_j|², w_p the likelihood's information per photon² at λ_p (nbsim.fit.newton.fisher_weights)."""
        intensities, pixel_scale, signal = self.state(log_F)
        weights = fisher_weights(self.expected(signal), self.readout, self.kind)
        return (4.0 * intensities * intensities * self.transposed(pixel_scale * pixel_scale * weights,
                                                                  squared=True)).cpu()

    def information_at(self, log_F: torch.Tensor, log_F_at: torch.Tensor) -> torch.Tensor:
        """What the pixels would tell of each |F_j| had it the value `log_F_at[j]` (the others at `log_F`): the
        Fisher diagonal with each pixel's derivative and expected count (so its variance) taken there."""
        intensities, pixel_scale, signal = self.state(log_F)
        at = torch.exp(2.0 * log_F_at.to(self.device, torch.float64))
        scale = pixel_scale[self.pixel] * self.weight
        derivative = 2.0 * scale * at[self.parameter]
        expected = self.expected(signal)[self.pixel] + scale * (at - intensities)[self.parameter]
        weights = fisher_weights(expected, self.readout, self.kind)
        return torch.zeros(self.size, dtype=torch.float64, device=self.device).index_add_(
            0, self.parameter, derivative * derivative * weights).cpu()

    def scale_information(self, log_F: torch.Tensor) -> torch.Tensor:
        """The Fisher information of each shot's log scale, Σ_p signal_p²·w_p."""
        _, _, signal = self.state(log_F)
        weights = fisher_weights(self.expected(signal), self.readout, self.kind)
        return self.per_shot(signal * signal * weights).cpu()
