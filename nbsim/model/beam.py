"""Incident beam: the list of sources (directions, wavelengths and weights) from divergence, dispersion, a
weighted spectrum or a file."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..config import BeamConfig, shifted_spectrum
from ..errors import NbsimError
from ..vectors import rotate_about_axis, unit

SOURCE_DISTANCE_M = 10.0


@dataclass
class StepRange:
    """A sampled range (divergence in rad, dispersion as a fraction) after nanoBragg's auto rules."""

    range: float
    step: float
    steps: int


def auto_steps(range_: float | None, step: float | None, steps: int | None) -> StepRange:
    """nanoBragg's rules for whichever of range, step and count were left out."""
    r = -1.0 if range_ is None else range_
    s = -1.0 if step is None else step
    n = -1 if steps is None else steps
    if n <= 0:
        if r < 0.0:
            r, s, n = (0.0, 0.0, 1) if s <= 0.0 else (s, s, 2)
        elif s <= 0.0:
            s, n = r, 2
        else:
            n = math.ceil(r / s)
    elif r < 0.0:
        r, s, n = (1.0, 1.0 / n, n) if s <= 0.0 else (s, s, 2)
    elif s <= 0.0:
        n = max(n, 2)
        s = r / (n - 1)
    if r <= 0.0 or s <= 0.0 or n <= 0:
        return StepRange(0.0, 0.0, 1)
    return StepRange(r, s, n)


@dataclass
class Sources:
    """Incident unit vectors (N, 3), wavelengths in Å (N,), each source's intensity weight relative to the
    mean (N,): 1 but with a spectrum, and what nanoBragg prints about them (`weights`: the -sourcefile
    column, which nanoBragg ignores, else each source's share of the intensity)."""

    incident: torch.Tensor
    wavelength_A: torch.Tensor
    positions_m: np.ndarray
    weights: np.ndarray
    divergence_points: int
    dispersion: StepRange
    relative_weights: torch.Tensor

    @property
    def count(self) -> int:
        """How many sources."""
        return len(self.positions_m)


def build_sources(config: BeamConfig, beam_vector: torch.Tensor, polar_vector: torch.Tensor,
                  vertical_vector: torch.Tensor) -> Sources:
    """Sources from an explicit list (the -sourcefile rows), or the divergence × dispersion grid culled to
    an ellipse."""
    wavelength0_A = torch.as_tensor(config.wavelength_A, dtype=torch.float64)
    hdiv, vdiv, dispersion = _step_ranges(config)
    beam = beam_vector.detach().numpy()
    if config.sources is not None:
        table = np.array([[math.nan if value is None else value for value in row] for row in config.sources],
                         dtype=np.float64)
        for column in range(3):
            table[np.isnan(table[:, column]), column] = -SOURCE_DISTANCE_M * beam[column]
        table[np.isnan(table[:, 3]), 3] = 1.0
        positions = torch.as_tensor(table[:, :3])
        wavelengths = [wavelength0_A if math.isnan(lam) else torch.as_tensor(lam * 1e10, dtype=torch.float64)
                       for lam in table[:, 4]]
        wavelength_A = torch.stack(wavelengths)
        weights = table[:, 3]
        divergence_points = hdiv.steps * vdiv.steps
        relative = torch.ones(len(table), dtype=torch.float64)
    else:
        angles = _divergence_grid(hdiv, vdiv, config.round_divergence)
        if not angles:
            raise NbsimError(f"the round divergence cut keeps none of the {hdiv.steps}x{vdiv.steps} divergence "
                             "points (nanoBragg would render 0 sources); use more -hdivsteps/-vdivsteps or "
                             "-square_div")
        divergence_points = len(angles)
        start = -SOURCE_DISTANCE_M * beam_vector
        channels = _channels(config, wavelength0_A, dispersion)
        positions_list, wavelength_list = [], []
        for h_angle, v_angle in angles:
            tilted = rotate_about_axis(start, polar_vector, torch.tensor(v_angle, dtype=torch.float64))
            position = rotate_about_axis(tilted, vertical_vector, torch.tensor(h_angle, dtype=torch.float64))
            for wavelength, _ in channels:
                positions_list.append(position)
                wavelength_list.append(wavelength)
        positions = torch.stack(positions_list)
        wavelength_A = torch.stack(wavelength_list)
        channel_weights = torch.tensor([weight for _, weight in channels], dtype=torch.float64)
        relative = (channel_weights * (len(channels) / channel_weights.sum())).repeat(divergence_points)
        weights = (relative / len(relative)).numpy()
    incident = -unit(positions)
    return Sources(incident=incident, wavelength_A=wavelength_A, positions_m=positions.detach().numpy(),
                   weights=weights, divergence_points=divergence_points, dispersion=dispersion,
                   relative_weights=relative)


def source_count(config: BeamConfig) -> int:
    """How many sources `build_sources` makes, from the configuration alone (no vector is built)."""
    if config.sources is not None:
        return len(config.sources)
    hdiv, vdiv, dispersion = _step_ranges(config)
    channels = len(config.spectrum) if config.spectrum is not None else dispersion.steps
    return len(_divergence_grid(hdiv, vdiv, config.round_divergence)) * channels


def _channels(config: BeamConfig, wavelength0_A: torch.Tensor,
              dispersion: StepRange) -> list[tuple[torch.Tensor, float]]:
    """(wavelength in Å, weight) of each channel along a divergence direction: the spectrum's (shifted and
    stretched as the configuration says, differentiably), or nanoBragg's dispersion steps (equal weights)."""
    if config.spectrum is not None:
        return [(torch.as_tensor(wavelength, dtype=torch.float64), weight) for wavelength, weight
                in shifted_spectrum(config.spectrum, config.spectrum_shift_eV, config.spectrum_stretch)]
    return [(wavelength0_A * (1.0 + dispersion.step * j - dispersion.range / 2.0), 1.0)
            for j in range(dispersion.steps)]


def _step_ranges(config: BeamConfig) -> tuple[StepRange, StepRange, StepRange]:
    """Horizontal and vertical divergence (rad) and dispersion (fraction) after nanoBragg's rules."""
    hdiv = auto_steps(_mrad(config.hdiv_range_mrad), _mrad(config.hdiv_step_mrad), config.hdiv_steps)
    vdiv = auto_steps(_mrad(config.vdiv_range_mrad), _mrad(config.vdiv_step_mrad), config.vdiv_steps)
    dispersion = auto_steps(config.dispersion_percent / 100.0, None, config.dispersion_steps)
    return hdiv, vdiv, dispersion


def _mrad(value: float | None) -> float | None:
    return None if value is None else value / 1000.0


def _divergence_grid(hdiv: StepRange, vdiv: StepRange, round_divergence: bool) -> list[tuple[float, float]]:
    """(horizontal, vertical) divergence angles kept by nanoBragg's elliptical cut."""
    kept = []
    with np.errstate(divide="ignore", invalid="ignore"):
        for i in range(hdiv.steps):
            for j in range(vdiv.steps):
                h_angle = hdiv.step * i - hdiv.range / 2.0
                v_angle = vdiv.step * j - vdiv.range / 2.0
                test = (np.float64(h_angle * h_angle - hdiv.step * hdiv.step / 4.0 * (1 - hdiv.steps % 2))
                        / hdiv.range / hdiv.range)
                test += (np.float64(v_angle * v_angle - vdiv.step * vdiv.step / 4.0 * (1 - vdiv.steps % 2))
                         / vdiv.range / vdiv.range)
                if round_divergence and test * 4.0 > 1.1:
                    continue
                kept.append((h_angle, v_angle))
    return kept
