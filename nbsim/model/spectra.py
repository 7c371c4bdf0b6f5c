"""Seeded SASE-like spectra: a smooth Gaussian envelope times random spikes, as (wavelength_A, weight) channels
for `BeamConfig.spectrum`. Torch-free and pure (the sweep's draws, which the Snakefile imports, call it)."""

from __future__ import annotations

import math

import numpy as np

from ..errors import NbsimError

GRID_HALF_WIDTHS = 1.5
"""The channels span the envelope's centre ± 1.5 FWHM (± 3.5 σ: the envelope falls to 2e-3 at the edges)."""


def sase_spectrum(centre_A: float, bandwidth_percent: float, channels: int, seed: int,
                  spikes: int = 10) -> tuple[tuple[float, float], ...]:
    """`channels` evenly spaced wavelengths about `centre_A` and their weights (summing to 1): a Gaussian
    envelope of FWHM `bandwidth_percent` of the centre, times `spikes` Gaussian spikes, each of FWHM
    bandwidth/spikes, placed uniformly over the channels with exponentially distributed heights (the
    statistics of SASE modes). The same arguments give the same spectrum (numpy's Philox keyed by `seed`)."""
    if not (centre_A > 0 and math.isfinite(centre_A)):
        raise NbsimError(f"centre {centre_A!r} A must be positive")
    if not (bandwidth_percent > 0 and math.isfinite(bandwidth_percent)):
        raise NbsimError(f"bandwidth {bandwidth_percent!r} % must be positive")
    if channels < 1 or spikes < 1:
        raise NbsimError(f"channels ({channels}) and spikes ({spikes}) must be at least 1")
    fwhm_A = centre_A * bandwidth_percent / 100.0
    if channels == 1:
        return ((float(centre_A), 1.0),)
    wavelengths = np.linspace(centre_A - GRID_HALF_WIDTHS * fwhm_A, centre_A + GRID_HALF_WIDTHS * fwhm_A, channels)
    generator = np.random.Generator(np.random.Philox(seed))
    positions = generator.uniform(wavelengths[0], wavelengths[-1], spikes)
    heights = generator.exponential(1.0, spikes)
    sigma_per_fwhm = 1.0 / (2.0 * math.sqrt(2.0 * math.log(2.0)))
    spike_sigma = fwhm_A / spikes * sigma_per_fwhm
    envelope = np.exp(-0.5 * ((wavelengths - centre_A) / (fwhm_A * sigma_per_fwhm)) ** 2)
    spiky = (heights * np.exp(-0.5 * ((wavelengths[:, None] - positions) / spike_sigma) ** 2)).sum(axis=1)
    weights = envelope * spiky
    if not weights.sum() > 0:
        weights = envelope
    weights = weights / weights.sum()
    return tuple((float(wavelength), float(weight)) for wavelength, weight in zip(wavelengths, weights, strict=True))
