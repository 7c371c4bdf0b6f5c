"""The kernel structure a configuration renders with (`structure_of`), from the configuration alone: what
the renderer, the kernel cache, the sweep's planning and `nbsim kernels` all ask.

It reads no file and builds nothing sized by the detector or the HKL table. Each count comes from the same
pure rule `setup.resolve` follows (cell counts, automatic oversample, lookup, sensor layers, mosaic
domains, sources, phi steps), so the two cannot disagree.
"""

from __future__ import annotations

import dataclasses
import functools

from ..beam import source_count
from ..config import DetectorConfig, SimulationConfig
from ..crystal import build_lattice, cell_counts, mosaic_domain_count, phi_sampling
from ..rng import Ran1
from ..setup import (
    detector_panels,
    finest_sampling,
    lookup_of,
    oversample_advice,
    requested_oversample,
    sampling_distance_m,
    sensor_layers,
)
from .inputs import kernel_options
from .stages import Structure


def structure_of(config: SimulationConfig) -> Structure:
    """The kernel options of `config` and whether a pixel has a single step (sources × mosaic domains ×
    phi steps × sensor layers × sub-pixels == 1).

    The cell counts and the automatic oversample need the lattice and the detector distance after pivots:
    they come from `crystal.build_lattice` and the detector's geometry (`setup.detector_panels`, float64 3×3
    CPU tensors, about a millisecond together) rather than from a second copy of their arithmetic, and only
    where a decision needs them: the lookup with -hkl and neither -interpolate nor -nointerpolate, the
    oversample where it is automatic and every other count is 1."""
    crystal, detector, wavelength_A = config.crystal, config.detector, config.beam.wavelength_A
    lattice = functools.cache(lambda: build_lattice(crystal, wavelength_A, Ran1()))
    n_cells = functools.cache(lambda: cell_counts(crystal, lattice()))
    steps_per_subpixel = (source_count(config.beam) * mosaic_domain_count(crystal) * phi_sampling(crystal).steps
                          * sensor_layers(detector).layers)
    single_step = steps_per_subpixel == 1 and (requested_oversample(detector) or oversample_advice(
        lattice(), n_cells(), wavelength_A, *_distance_and_pixel_m(detector)).recommended) == 1
    return Structure(kernel_options(config, lookup_of(config.structure, n_cells)), single_step=single_step)


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
