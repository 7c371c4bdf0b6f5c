"""The kernel structure a configuration renders with (`structure_of`), from the configuration alone: what
the renderer, the kernel cache, the sweep's planning and `nbsim kernels` all ask.

It reads no file and builds nothing sized by the detector or the HKL table. Each count comes from the same
pure rule `resolve.resolve` follows (cell counts, automatic oversample, lookup, sensor layers, mosaic
domains, sources, phi steps), so the two cannot disagree.
"""

from __future__ import annotations

import dataclasses
import functools

from ..config import DetectorConfig, SimulationConfig
from ..model.beam import source_count
from ..model.crystal import build_lattice, cell_counts, mosaic_domain_count, phi_sampling
from ..resolve import (
    detector_panels,
    finest_sampling,
    lookup_of,
    oversample_advice,
    requested_oversample,
    sampling_distance_m,
    sensor_layers,
)
from ..rng import Ran1
from .inputs import kernel_options
from .stages import Structure


def structure_of(config: SimulationConfig) -> Structure:
    """The kernel options of `config` and whether a pixel has a single step (sources × mosaic domains ×
    phi steps × sensor layers × sub-pixels == 1).

    The cell counts and the automatic oversample need the lattice and the detector distance after pivots:
    they come from `crystal.build_lattice` and the detector's geometry (`setup.detector_panels`, float64 3×3
    CPU tensors, about a millisecond together) rather than from a second copy of their arithmetic, and only
    where a decision needs them: the oversample where it is automatic and every other count is 1."""
    counts = _Counts(config)
    single_step = counts.steps_per_subpixel == 1 and counts.oversample() == 1
    return Structure(kernel_options(config, lookup_of(config, counts.n_cells)), single_step=single_step)


def steps_per_pixel(config: SimulationConfig) -> int:
    """The steps each pixel sums (sources × mosaic domains × phi steps × sensor layers × sub-pixels), from the
    configuration alone by the same rules as `structure_of`: what a render's cost grows with (the sweep's
    cost model sizes batch jobs by it)."""
    counts = _Counts(config)
    return counts.steps_per_subpixel * counts.oversample() ** 2


class _Counts:
    """A configuration's step counts; the lattice and cell counts are built only when a count needs them."""

    def __init__(self, config: SimulationConfig):
        crystal, self.detector, self.wavelength_A = config.crystal, config.detector, config.beam.wavelength_A
        self.lattice = functools.cache(lambda: build_lattice(crystal, self.wavelength_A, Ran1()))
        self.n_cells = functools.cache(lambda: cell_counts(crystal, self.lattice()))
        self.steps_per_subpixel = (source_count(config.beam) * mosaic_domain_count(crystal)
                                   * phi_sampling(crystal).steps * sensor_layers(self.detector).layers)

    def oversample(self) -> int:
        """Sub-pixels per side: the requested -oversample, else nanoBragg's automatic choice."""
        return requested_oversample(self.detector) or oversample_advice(
            self.lattice(), self.n_cells(), self.wavelength_A, *_distance_and_pixel_m(self.detector)).recommended


def _distance_and_pixel_m(detector: DetectorConfig) -> tuple[float, float]:
    """The `sampling_distance_m` and pixel size of the detector's finest-sampled panel: remembered for a
    detector configuration of plain values (the points of a sweep mostly share one, and building its
    geometry would otherwise be most of `structure_of`'s cost), computed afresh for one holding tensors,
    which hash by identity and may change in place (an optimiser's step)."""
    values = [getattr(detector, field.name) for field in dataclasses.fields(detector)]
    if any(hasattr(item, "detach") for value in values for item in (value if isinstance(value, tuple) else (value,))):
        return _geometry_distance_and_pixel_m(detector)
    return _remembered_distance_and_pixel_m(detector)


def _geometry_distance_and_pixel_m(detector: DetectorConfig) -> tuple[float, float]:
    geometry = finest_sampling(detector_panels(detector))
    return sampling_distance_m(geometry), geometry.pixel_size_m


_remembered_distance_and_pixel_m = functools.lru_cache(maxsize=64)(_geometry_distance_and_pixel_m)
