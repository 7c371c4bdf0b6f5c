"""An observed frame as a fit reads it: counts in photons and the pixels it may use."""

from __future__ import annotations

from ..io.observed import read_observed
from ..resolve import Setup
from .objective import FitImage


def read_fit_image(name: str, setup: Setup, adc_offset_adu: float | None = None) -> FitImage:
    """The frame `name` (any format `read_observed` reads) against its starting model: counts over the gain,
    usable where neither the file nor the model's mask leaves a pixel out."""
    observed = read_observed(name, shape=tuple(setup.shape), adc_offset_adu=adc_offset_adu)
    usable = ~observed.unusable()
    if setup.mask is not None:
        usable &= setup.mask.astype(bool)
    gain = observed.gain_adu_per_photon or 1.0
    return FitImage(name, setup, observed.counts / gain, usable)
