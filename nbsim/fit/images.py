"""An observed frame as a fit reads it: counts in photons and the pixels it may use."""

from __future__ import annotations

import numpy as np

from ..io.observed import read_observed
from ..resolve import Setup
from .objective import FitImage


def read_fit_image(name: str, setup: Setup, adc_offset_adu: float | None = None) -> FitImage:
    """The frame `name` (any format `read_observed` reads) against its starting model: counts over the gain,
    usable where neither the file nor the model's mask leaves a pixel out. A multi-panel detector's frame is
    (panels, slow, fast) (an NXmx frame, a -floatfile's panels one after another, a store's shot), its padding
    beyond each panel's pixels unusable."""
    panels = None if setup.panels is None else [(g.pixels_s, g.pixels_f) for g in setup.panels]
    shape = None if panels is not None else tuple(setup.shape)
    observed = read_observed(name, shape=shape, adc_offset_adu=adc_offset_adu, panels=panels)
    usable = ~observed.unusable()
    if setup.mask is not None:
        usable &= setup.mask.astype(bool)
    if panels is not None:
        usable &= panel_pixels(setup)
    gain = observed.gain_adu_per_photon or 1.0
    return FitImage(name, setup, observed.counts / gain, usable)


def panel_pixels(setup: Setup) -> np.ndarray:
    """(panels, slow, fast): True on each panel's own pixels, False on the padding to the largest panel."""
    inside = np.zeros(setup.shape, dtype=bool)
    for index, g in enumerate(setup.panels or ()):
        inside[index, :g.pixels_s, :g.pixels_f] = True
    return inside
