"""Configuration to physics: apply nanoBragg's defaults and derive the geometry, lattice, mosaic domains,
sources, structure-factor grid, sensor layers, fluence and background a render needs (`resolve`).

`resolve` is the one stage that reads the large input files (-hkl, -mask): the configuration holds their
paths (and the contents of the small -mat and -sourcefile, read when the arguments are parsed). The rules
that decide a count (oversample, lookup, sensor layers; mosaic domains and sources in model/crystal.py and
model/beam.py) are small pure functions, so that nbsim.kernel.structure learns a render's structure from them
without resolving it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from .config import (
    CRYSTAL_SHAPES,
    PHYSICS_MODELS,
    DetectorConfig,
    Scalar,
    SimulationConfig,
    check_spectrum,
    check_values,
    counts_left_to_advice,
    mosaic_spread_deg,
    scalar_value,
)
from .errors import InputFileError, NbsimError
from .io.inputs import read_input_files
from .io.structure_files import ReflectionTable, model_reflections
from .model import crystal as crystal_mod
from .model.anomalous import Channels, channel_tables, source_channels
from .model.background import BackgroundCurve, background_curve, check_background
from .model.beam import Sources, build_sources
from .model.geometry import DetectorGeometry, build_geometry, panel_geometries
from .model.structure_factors import HKLGrid, build_grid
from .rng import Ran1
from .vectors import norm

R_E_SQR_M2 = 7.94079248018965e-30
AVOGADRO = 6.02214179e23
WATER_F = 2.57
WATER_MW = 18.0

@dataclass
class SensorLayers:
    thickness_m: float
    step_m: float
    layers: int
    mu_per_m: float


def sensor_layers(detector: DetectorConfig) -> SensorLayers:
    """Sensor thickness, layer step and count, and μ, after nanoBragg's rules."""
    absorption_depth_um, layers = detector.sensor_absorption_depth_um, detector.sensor_layers
    thick = detector.sensor_thickness_um * 1e-6
    mu = -1.0 if absorption_depth_um is None else (
        0.0 if math.isinf(absorption_depth_um) or absorption_depth_um == 0 else 1.0 / (absorption_depth_um * 1e-6))
    steps = -1 if layers is None else layers
    step = -1.0
    if steps <= 0:
        if thick >= 0.0:
            steps, step = 2, thick / 2.0
    elif thick >= 0.0:
        steps = max(steps, 2)
        step = thick / (steps - 1)
    if thick > 0.0 and mu < 0.0:
        mu = 1.0 / thick
    if thick <= 0.0 or step <= 0.0 or steps <= 0:
        return SensorLayers(0.0, 0.0, 1, mu)
    return SensorLayers(thick, step, steps, mu)


@dataclass(frozen=True)
class OversampleAdvice:
    """What nanoBragg's automatic -oversample weighs: the crystal's largest extent against the reciprocal
    pixel size λ·distance/pixel."""

    crystal_size_m: float
    reciprocal_pixel_m: float

    @property
    def recommended(self) -> int:
        """Sub-pixels per side that sample the crystal's finest fringes (at least 1; 1 where the distance after
        pivots is 0 or nearly, a beam along the detector, whose ratio past int's range nanoBragg's cast makes
        negative)."""
        ratio = 3.0 * self.crystal_size_m / self.reciprocal_pixel_m if self.reciprocal_pixel_m != 0 else math.inf
        if not math.isfinite(ratio) or math.ceil(ratio) >= 2**31:
            return 1  # nanoBragg's int cast of an out-of-range ceiling is INT_MIN, which it then raises to 1
        return max(math.ceil(ratio), 1)


def oversample_advice(lattice: crystal_mod.Lattice, n_cells: tuple[int, int, int], wavelength_A: Scalar,
                      distance_m: float, pixel_size_m: float) -> OversampleAdvice:
    """The crystal's largest extent and the reciprocal pixel size, from the lattice, cell counts, the
    wavelength and the detector's `sampling_distance_m` and pixel size."""
    crystal_size_m = max(float(length) * n for length, n in
                         zip(norm(lattice.real_A.detach() * 1e-10), n_cells, strict=True))
    return OversampleAdvice(crystal_size_m, scalar_value(wavelength_A) / 1e10 * distance_m / pixel_size_m)


def sampling_distance_m(geometry: DetectorGeometry) -> float:
    """The distance (after pivots) the automatic -oversample divides by.

    The ratio `OversampleAdvice.recommended` takes is often an exact integer in theory, so its rounding
    decides a whole sub-pixel. Where the recomputed distance equals the requested one up to rounding (which
    builds of the reference, with or without fused multiply-adds, do not agree on), the requested one is
    used."""
    distance_m = scalar_value(geometry.distance_m)
    return geometry.requested_distance_m if math.isclose(distance_m, geometry.requested_distance_m,
                                                         rel_tol=1e-12) else distance_m


def detector_panels(detector: DetectorConfig) -> tuple[DetectorGeometry, ...]:
    """The detector's panels: those of -panelfile, else the one panel the detector flags place."""
    return panel_geometries(detector) if detector.panels else (build_geometry(detector),)


def finest_sampling(panels: tuple[DetectorGeometry, ...]) -> DetectorGeometry:
    """The panel with the smallest reciprocal pixel (∝ distance / pixel size): the automatic -oversample of
    a multi-panel detector is this panel's, one for all panels (every pixel then has the same steps)."""
    return min(panels, key=lambda g: abs(sampling_distance_m(g)) / g.pixel_size_m)


def requested_oversample(detector: DetectorConfig) -> int | None:
    """The -oversample given, or None where nanoBragg chooses it (not given, or not positive)."""
    return detector.oversample if detector.oversample and detector.oversample > 0 else None


def lookup_of(config: SimulationConfig, n_cells: Callable[[], tuple[int, int, int]]) -> str:
    """How structure factors are looked up: "default" without -hkl or -model; with one, "interpolate" where asked or,
    unless -nointerpolate, automatically for a crystal of at most two cells along an axis, else "nearest".
    nanoBragg counts the cells -N, -Na, -Nb or -Nc give (1 unless given), deciding before a crystal size
    (-xtalsize ...) sets them, so -xtalsize alone interpolates; -physics corrected counts the crystal's own
    (`n_cells`, called only there: it may build the lattice)."""
    structure = config.structure
    if not structure.hkl_file and not structure.model_file:
        return "default"
    interpolate = structure.interpolate
    if interpolate is None:
        interpolate = min(n_cells() if config.corrected else config.crystal.n_cells) <= 2
    return "interpolate" if interpolate else "nearest"


@dataclass
class Setup:
    """Everything resolved from a configuration, before any pixel is rendered."""

    config: SimulationConfig
    geometry: DetectorGeometry
    lattice: crystal_mod.Lattice
    n_cells: tuple[int, int, int]
    phi: crystal_mod.PhiSampling
    mosaic: crystal_mod.MosaicDomains
    cells_A: torch.Tensor
    sources: Sources
    grid: HKLGrid | None
    lookup: str
    oversample: int
    sensor: SensorLayers
    fluence: float
    background: float
    steps: int
    roi: tuple[int, int, int, int]
    mask: np.ndarray | None
    first_evaluation_cells_A: torch.Tensor | None
    warnings: list[str] = field(default_factory=list)
    p1_table: ReflectionTable | None = None
    """The P1 table the grid was built from (None without -hkl or -model)."""
    panels: tuple[DetectorGeometry, ...] | None = None
    """The panels of a multi-panel detector (-panelfile), else None; `geometry` is then the first panel's."""
    gaps: np.ndarray | None = None
    """(slow, fast) booleans, True on the pixels between modules (-module_gap): not rendered (`mask` is False
    there), written as gaps in the int32 files; None without modules."""
    ran1_table: tuple[int, ...] = ()
    """ran1's state after the misset and mosaic draws (Ran1.table): nanoBragg's noise continues it when
    its seed is positive."""
    background_curve: BackgroundCurve | None = None
    """The amorphous background added once per pixel (-background, or -water under -physics corrected)."""
    channels: Channels | None = None
    """With -anomalous: each structure-factor channel's energy and each source's channel."""
    channel_grids: list[HKLGrid] | None = None
    """With -anomalous: one grid per channel (the same index range); `grid` is the first."""

    @property
    def source_channel(self) -> np.ndarray:
        """Each source's structure-factor channel (all 0 with one table)."""
        if self.channels is None:
            return np.zeros(self.sources.count, np.int64)
        return self.channels.source_channel

    @property
    def shape(self) -> tuple[int, ...]:
        """The image's shape: (slow, fast), or (panels, slow, fast) padded to the largest panel."""
        if self.panels is not None:
            return (len(self.panels), max(g.pixels_s for g in self.panels), max(g.pixels_f for g in self.panels))
        return self.geometry.pixels_s, self.geometry.pixels_f

    @property
    def pixel_count(self) -> int:
        """The detector's pixels (every panel's, without the padding)."""
        return sum(g.pixels_s * g.pixels_f for g in self.panels or (self.geometry,))

    @property
    def roi_is_whole_detector(self) -> bool:
        """Whether every pixel is rendered (no -roi short of the detector; always for panels)."""
        return self.panels is not None or self.roi == (0, self.shape[1] - 1, 0, self.shape[0] - 1)

    def panel_setups(self) -> list[Setup]:
        """Each panel of a multi-panel setup as a single-panel setup of its own (the whole panel its ROI)."""
        return [dataclasses.replace(self, geometry=g, panels=None, roi=(0, g.pixels_f - 1, 0, g.pixels_s - 1))
                for g in self.panels or ()]

    @property
    def photon_scale(self) -> float:
        """r_e² · fluence / steps: what every pixel's step sum is multiplied by."""
        return R_E_SQR_M2 * self.fluence / self.steps


def resolve(config: SimulationConfig) -> Setup:
    """Apply nanoBragg's defaults (or, under -sampling advised, the sampling advice's counts) and derive
    geometry, lattice, sources and the structure-factor grid."""
    _validate(config)
    files = read_input_files(config)
    generator = Ran1()
    warnings: list[str] = []
    panels = detector_panels(config.detector)
    geometry = panels[0]
    corrected = config.corrected
    lattice = crystal_mod.build_lattice(config.crystal, config.beam.wavelength_A, generator, corrected)
    n_cells = crystal_mod.cell_counts(config.crystal, lattice)
    sources = build_sources(config.beam, geometry.beam, geometry.polar, geometry.vertical)
    sampling_need = sampling_advice(lattice, n_cells, detector_d_min_A(panels, config.detector, sources),
                                    math.degrees(crystal_mod.phi_sampling(config.crystal).osc_rad),
                                    mosaic_spread_deg(config))
    config = _with_advice(config, sampling_need, *counts_left_to_advice(config))
    phi = crystal_mod.phi_sampling(config.crystal)
    mosaic = crystal_mod.mosaic_domains(config.crystal, generator)
    cells = crystal_mod.oriented_cells(lattice, phi, geometry.spindle, mosaic, corrected)
    first_cells = None
    if crystal_mod.effective_phi_rad(phi, corrected)[0] != phi.angles_rad()[0]:
        unrotated = crystal_mod.PhiSampling(start_rad=0.0, step_rad=0.0, steps=1, osc_rad=0.0)
        first_cells = crystal_mod.oriented_cells(lattice, unrotated, geometry.spindle, mosaic)

    sampling = finest_sampling(panels)
    advice = oversample_advice(lattice, n_cells, config.beam.wavelength_A, sampling_distance_m(sampling),
                               sampling.pixel_size_m)
    oversample = requested_oversample(config.detector) or advice.recommended
    if oversample < advice.recommended:
        warnings.append(f"maximum dimension of sample is {advice.crystal_size_m * 1e10:g} A but reciprocal pixel "
                        f"size is {advice.reciprocal_pixel_m * 1e10:g} A: recommend -oversample {advice.recommended}")

    warnings += crystal_mod.default_warnings(config.crystal)
    warnings += sampling_warnings(sampling_need, phi.steps, mosaic.count)
    p1_table = files.hkl
    channels = channel_grids = None
    if config.structure.model_file:
        d_min_A = min(model_d_min_A(panel, config.detector, sources, lattice) for panel in panels)
        if config.structure.anomalous:
            channels = source_channels(sources.wavelength_A.detach().double().numpy(), config.structure.energy_bins)
            tables = channel_tables(config.structure.model_file, d_min_A, channels, config.structure.anomalous_table)
            channel_grids = [build_grid(table.reflections, config.structure.default_F) for table in tables]
            _check_channel_memory(channel_grids)
            p1_table = tables[0]
        else:
            p1_table = model_reflections(config.structure.model_file, d_min_A)
    warnings += structure_factor_warnings(config, p1_table)
    grid = None if p1_table is None else (channel_grids[0] if channel_grids else
                                          build_grid(p1_table.reflections, config.structure.default_F))
    lookup = lookup_of(config, lambda: n_cells)
    beam = config.beam
    fluence = beam.fluence_photons_per_m2
    if beam.flux_photons_per_s != 0.0 and beam.exposure_s > 0.0:
        beamsize_m = beam.beamsize_mm * 1e-3
        beam_area_m2 = beamsize_m * beamsize_m  # not ** 2: a float power raises where this overflows to inf
        fluence = beam.flux_photons_per_s * beam.exposure_s / beam_area_m2 if beam_area_m2 > 0 else math.inf
        if not math.isfinite(scalar_value(fluence)):
            raise NbsimError(f"-flux {beam.flux_photons_per_s:g} over -beamsize {beam.beamsize_mm:g} mm for "
                             f"-exposure {beam.exposure_s:g} s gives a fluence beyond any number")
    water_m = beam.water_thickness_um * 1e-6
    background = 0.0 if corrected else (WATER_F ** 2 * R_E_SQR_M2 * fluence * water_m * water_m * water_m * 1e6
                                        * AVOGADRO / WATER_MW)
    if not math.isfinite(scalar_value(background)):
        raise NbsimError(f"-water {beam.water_thickness_um:g} um gives a water background beyond any number")
    if not corrected:
        counted_as_given = lookup != lookup_of(config.with_options(physics="corrected"), lambda: n_cells)
        warnings += nanobragg_defects(config, first_cells is not None, counted_as_given)
    steps = sources.count * mosaic.count * phi.steps * oversample * oversample
    roi = _roi(config.detector.roi, geometry)
    mask = files.mask
    if mask is not None and mask.shape != (geometry.pixels_s, geometry.pixels_f):
        raise InputFileError(config.detector.mask_file, f"mask is {mask.shape[1]}x{mask.shape[0]} pixels but the "
                                                        f"detector is {geometry.pixels_f}x{geometry.pixels_s}")
    gaps = module_gaps(config.detector, geometry.pixels_f, geometry.pixels_s)
    if gaps is not None:
        mask = ~gaps if mask is None else mask & ~gaps
    return Setup(config=config, geometry=geometry, lattice=lattice, n_cells=n_cells, phi=phi, mosaic=mosaic,
                 cells_A=cells, sources=sources, grid=grid, lookup=lookup, oversample=oversample,
                 sensor=sensor_layers(config.detector),
                 fluence=fluence, background=background, steps=steps, roi=roi, mask=mask, gaps=gaps,
                 first_evaluation_cells_A=first_cells, warnings=warnings, p1_table=p1_table,
                 ran1_table=generator.table(), panels=panels if config.detector.panels else None,
                 background_curve=background_curve(beam, fluence, corrected), channels=channels,
                 channel_grids=channel_grids)


MAX_CHANNEL_TABLE_ENTRIES = 2**31 - 1
"""The per-channel tables are indexed in int32, end to end."""


def _check_channel_memory(grids: list[HKLGrid]) -> None:
    """The channels' padded tables together must stay within int32 indexing."""
    entries = sum(int(np.prod(np.array(grid.shape) + 2)) for grid in grids)
    if entries > MAX_CHANNEL_TABLE_ENTRIES:
        raise NbsimError(f"{len(grids)} anomalous tables of {entries // len(grids)} entries each exceed "
                         f"{MAX_CHANNEL_TABLE_ENTRIES} entries: give -energy_bins N to share tables between channels")


def noise_image_wraps(config: SimulationConfig) -> bool:
    """Whether the -noisefile's negative ADU (a negative -adc) wrap as nanoBragg's 16-bit cast wraps them (-5
    reads 65531): only on nanoBragg's own path (its physics, one panel, no readout noise, which nanoBragg has
    not); elsewhere they are clamped at 0."""
    return not config.corrected and not config.detector.panels and config.response.readout_noise_adu == 0


def nanobragg_defects(config: SimulationConfig, stale_phi: bool, counted_as_given: bool) -> list[str]:
    """One warning naming the known defects of nanoBragg's physics this configuration meets (none: no line),
    and -physics corrected, which fixes them (docs/physics.md, The physics switch). `stale_phi`: a phi step at 0
    replays the previous pixel's orientation; `counted_as_given`: the automatic interpolation differs from the
    one the crystal's own cell counts give."""
    detector, crystal, beam = config.detector, config.crystal, config.beam
    met = []
    if beam.water_thickness_um > 0:
        met.append("-water background scales with fluence squared and shrinks with the step count")
    if stale_phi:
        met.append("a phi step at 0 reuses the previous pixel's crystal orientation (depends on the threads)")
    flags = [flag for flag, on in (("-oversample_thick", detector.oversample_thick),
                                   ("-oversample_polar", detector.oversample_polar),
                                   ("-oversample_omega", detector.oversample_omega)) if on]
    if flags:
        met.append(f"{'/'.join(flags)} multiply the running sum, not each contribution")
    if beam.no_polarization and detector.oversample_polar:
        met.append("-oversample_polar recomputes the polarization that -nopolar turns off")
    if counted_as_given:
        met.append("the automatic interpolation counts the cells -N gives, not those of the crystal's size")
    if crystal.misset_random:
        met.append("-misset random draws from a cap of 90 radians, not degrees")
    if config.response.adc_offset_adu < 0 and noise_image_wraps(config):
        met.append("a negative -adc wraps the noise image's negative counts to 65536 less them")
    if not met:
        return []
    return [f"nanoBragg's physics (-physics nanobragg, the default): {'; '.join(met)}. -physics corrected fixes "
            f"{'this' if len(met) == 1 else 'these'} (docs/physics.md)"]


def module_gaps(detector: DetectorConfig, pixels_f: int, pixels_s: int) -> np.ndarray | None:
    """(slow, fast) booleans, True on the pixels between modules: modules of `module_size_px` tile the detector
    from its first pixel, `module_gap_px` apart (a detector cut to fewer pixels keeps the pattern from its first
    pixel). None without modules or gaps."""
    if detector.module_size_px is None or detector.module_gap_px == (0, 0):
        return None
    (module_f, module_s), (gap_f, gap_s) = detector.module_size_px, detector.module_gap_px
    in_gap_f = np.arange(pixels_f) % (module_f + gap_f) >= module_f
    in_gap_s = np.arange(pixels_s) % (module_s + gap_s) >= module_s
    return in_gap_s[:, np.newaxis] | in_gap_f[np.newaxis, :]


def p1_reflections(config: SimulationConfig) -> np.ndarray | None:
    """The (reflections, 4) h k l F table over the full P1 sphere that a render of `config` looks up (from
    -hkl, or from -model to the detector's resolution); None when only -default_F is given."""
    table = resolve(config).p1_table
    return None if table is None else table.reflections


CELL_TOLERANCE = 1e-3
"""The relative difference between the -cell given and a structure file's cell that is warned about."""


def structure_factor_warnings(config: SimulationConfig, table: ReflectionTable | None) -> list[str]:
    """Warnings about structure factors from an MTZ, mmCIF or model: intensities used as amplitudes, a
    -cell unlike the file's, and a non-zero -default_F (spots beyond the data)."""
    if table is None or table.source is None:
        return []
    path = config.structure.model_file or config.structure.hkl_file
    warnings = [f"{path} {table.source}"] if table.from_intensities else []
    cell = config.crystal.cell_A_deg
    if cell is not None and table.cell_A_deg is not None and config.crystal.mosflm_matrix is None and any(
            abs(scalar_value(given) - own) > CELL_TOLERANCE * abs(own)
            for given, own in zip(cell, table.cell_A_deg, strict=True)):
        warnings.append(f"-cell {' '.join(f'{scalar_value(v):g}' for v in cell)} differs from the cell of {path} "
                        f"({' '.join(f'{v:g}' for v in table.cell_A_deg)}) by more than {CELL_TOLERANCE:.1%}")
    if config.structure.default_F != 0.0:
        warnings.append(f"-default_F {config.structure.default_F:g} with structure factors from {path}: every "
                        "reflection beyond the data gets it (stray spots); -default_F 0 leaves them dark")
    return warnings


def _largest_scattering_per_A(geometry: DetectorGeometry, detector: DetectorConfig, sources: Sources) -> float:
    """The largest |s| = |d̂ − î|/λ a pixel of this panel sees: at its corners (front and back of the
    sensor), for every source (the whole sphere 2/λ for a curved detector, or a flat one reaching past 90°,
    where |s| can peak inside the panel)."""
    inverse_wavelength = 1.0 / sources.wavelength_A.detach().double()
    thickness_m = sensor_layers(detector).thickness_m
    if detector.curved:
        return 2.0 * float(inverse_wavelength.max())
    extents = [(0.0, geometry.pixels_f * geometry.pixel_size_m), (0.0, geometry.pixels_s * geometry.pixel_size_m)]
    corners = torch.stack([geometry.pix0_m.detach() + f * geometry.fdet + s * geometry.sdet + depth * geometry.odet
                           for f in extents[0] for s in extents[1] for depth in (0.0, thickness_m)])
    directions = corners / torch.linalg.vector_norm(corners, dim=1, keepdim=True)
    s = torch.linalg.vector_norm(directions[:, None, :] - sources.incident.detach()[None], dim=2)
    if bool((directions @ sources.incident.detach().T < 0).any()):
        return 2.0 * float(inverse_wavelength.max())  # past 90°, |s| peaks inside the panel: whole sphere
    return float((s * inverse_wavelength[None]).max())


def detector_d_min_A(panels: tuple[DetectorGeometry, ...], detector: DetectorConfig, sources: Sources) -> float:
    """The finest resolution any pixel of the detector records, Å."""
    return 1.0 / max(_largest_scattering_per_A(panel, detector, sources) for panel in panels)


def model_d_min_A(geometry: DetectorGeometry, detector: DetectorConfig, sources: Sources,
                  lattice: crystal_mod.Lattice) -> float:
    """The resolution a model's |F| are computed to: the panel's largest |s| plus two reciprocal-cell
    diagonals, so that every node a pixel's lookup reads (nearest, or the 4×4×4 of interpolation) is present."""
    margin = 2.0 * float(torch.linalg.vector_norm(lattice.reciprocal_per_A.detach(), dim=1).sum())
    return 1.0 / (_largest_scattering_per_A(geometry, detector, sources) + margin)


SAMPLES_PER_SPOT_WIDTH = 3
"""φ steps (and mosaic domains across the spread) per spot width that the sampling advice asks for."""
SINC_FWHM = 0.886
"""Full width at half maximum of sinc²(πNx), in units of 1/N: a spot's reciprocal width times N·cell."""


@dataclass(frozen=True)
class SamplingAdvice:
    """How finely a rotation (φ steps per frame) and a mosaic spread (domains) must be sampled so that every
    spot is rendered, not hit or missed between samples. The narrowest spot is at the detector's finest
    resolution d_min: its reciprocal width 0.886/(N·cell) along the crystal's longest extent sweeps through
    the Ewald sphere in about 0.886·d_min/(N·cell) radians of rotation."""

    spot_width_deg: float
    """The narrowest spot's rotation width (FWHM), degrees."""
    d_min_A: float
    osc_deg: float
    mosaic_spread_deg: float

    @property
    def phi_steps(self) -> int:
        """φ steps over the oscillation: SAMPLES_PER_SPOT_WIDTH per spot width (1 for a still)."""
        if self.osc_deg <= 0:
            return 1
        return max(math.ceil(SAMPLES_PER_SPOT_WIDTH * self.osc_deg / self.spot_width_deg), 1)

    @property
    def mosaic_domains(self) -> int:
        """Domains that fill the mosaic cap with a domain every 1/SAMPLES_PER_SPOT_WIDTH spot width across
        (the cap is two-dimensional: the square of the count across it); 1 without a spread."""
        if self.mosaic_spread_deg <= 0:
            return 1
        return max(math.ceil((SAMPLES_PER_SPOT_WIDTH * self.mosaic_spread_deg / self.spot_width_deg) ** 2), 1)


def sampling_advice(lattice: crystal_mod.Lattice, n_cells: tuple[int, int, int], d_min_A: float, osc_deg: float,
                    mosaic_spread_deg: float) -> SamplingAdvice:
    """The φ steps and mosaic domains a crystal of `n_cells` needs on a detector reaching `d_min_A`."""
    return _advice(_longest_extent_A(lattice, n_cells), d_min_A, osc_deg, mosaic_spread_deg)


def _longest_extent_A(lattice: crystal_mod.Lattice, n_cells: tuple[int, int, int]) -> float:
    return max(float(length) * n for length, n in zip(norm(lattice.real_A.detach()), n_cells, strict=True))


def _advice(extent_A: float, d_min_A: float, osc_deg: float, mosaic_spread_deg: float) -> SamplingAdvice:
    width_deg = math.degrees(SINC_FWHM * d_min_A / extent_A)
    return SamplingAdvice(width_deg, d_min_A, osc_deg, max(mosaic_spread_deg, 0.0))


class SamplingAdvisor:
    """`config_sampling_advice` for many configurations that share detectors and crystals (a dataset's
    shots, planned together): each detector's panels and each crystal's longest extent are built once (about
    0.7 and 0.3 ms of the advice's 1.5 ms); the sources and d_min, which a drawn wavelength changes, each time."""

    def __init__(self) -> None:
        self._panels: dict[str, tuple[DetectorGeometry, ...]] = {}
        self._extents_A: dict[str, float] = {}

    def __call__(self, config: SimulationConfig) -> SamplingAdvice:
        """The sampling advice for `config`."""
        detector_key = repr(config.detector)
        if detector_key not in self._panels:
            self._panels[detector_key] = detector_panels(config.detector)
        panels = self._panels[detector_key]
        crystal = config.crystal
        # The extent is the cell's lengths times the counts: the misset turns the cell, it does not stretch it.
        crystal_key = repr((crystal.cell_A_deg, crystal.mosflm_matrix, crystal.n_cells, crystal.crystal_size_mm,
                            config.beam.wavelength_A if crystal.mosflm_matrix is not None else None))
        if crystal_key not in self._extents_A:
            lattice = crystal_mod.build_lattice(crystal, config.beam.wavelength_A, Ran1())
            self._extents_A[crystal_key] = _longest_extent_A(lattice, crystal_mod.cell_counts(crystal, lattice))
        sources = build_sources(config.beam, panels[0].beam, panels[0].polar, panels[0].vertical)
        phi = crystal_mod.phi_sampling(crystal)
        return _advice(self._extents_A[crystal_key], detector_d_min_A(panels, config.detector, sources),
                       math.degrees(phi.osc_rad), mosaic_spread_deg(config))


def config_sampling_advice(config: SimulationConfig) -> SamplingAdvice:
    """`sampling_advice` for a configuration (its lattice, sources and detector built, no input file read):
    for -sampling advised, the fit's defaults and `nbsim show`."""
    return SamplingAdvisor()(config)


def with_advised_sampling(config: SimulationConfig, advisor: SamplingAdvisor | None = None) -> SimulationConfig:
    """Under -sampling advised, `config` with the φ steps of a rotation and the mosaic domains of a spread that
    its flags leave out set to what `config_sampling_advice` asks, so that no spot is hit or missed between
    samples, and never fewer than nanoBragg's defaults (2 φ steps, 10 domains: an image is never sampled more
    coarsely than the C's, and a kernel's structure never turns single-step); counts the flags give are kept.
    `config` itself otherwise, without building anything. `advisor` keeps what many calls share. (`resolve`
    applies the same rule with the advice it computes from its own lattice and detector.)"""
    rotation_open, domains_open = counts_left_to_advice(config)
    if not (rotation_open or domains_open):
        return config
    return _with_advice(config, (advisor or SamplingAdvisor())(config), rotation_open, domains_open)


def _with_advice(config: SimulationConfig, advice: SamplingAdvice, rotation_open: bool,
                 domains_open: bool) -> SimulationConfig:
    """`config` with the open counts set to the advice's, never below nanoBragg's defaults."""
    if not (rotation_open or domains_open):
        return config
    crystal = config.crystal
    phi_steps = max(advice.phi_steps, crystal_mod.phi_sampling(crystal).steps)
    domains = max(advice.mosaic_domains, crystal_mod.mosaic_domain_count(crystal))
    return config.with_options(**({"phi_steps": phi_steps} if rotation_open else {}),
                               **({"mosaic_domains": domains} if domains_open else {}))


def advised_sampling_flags(config: SimulationConfig) -> tuple[SimulationConfig, list[str]]:
    """`with_advised_sampling(config)` and the nanoBragg flags that give the counts it set (-phisteps,
    -mosaic_dom): for the C, which has no -sampling, and for flags that re-render the same image."""
    advised = with_advised_sampling(config)
    flags = []
    if advised.crystal.phi_steps != config.crystal.phi_steps:
        flags += ["-phisteps", str(advised.crystal.phi_steps)]
    if advised.crystal.mosaic_domains != config.crystal.mosaic_domains:
        flags += ["-mosaic_dom", str(advised.crystal.mosaic_domains)]
    return advised, flags


def sampling_warnings(advice: SamplingAdvice, phi_steps: int, mosaic_domains: int) -> list[str]:
    """Warnings where the φ steps or mosaic domains are coarser than `advice` asks, like the oversample one."""
    warnings = []
    if phi_steps < advice.phi_steps:
        warnings.append(f"phi steps of {advice.osc_deg / phi_steps:g} deg are coarser than a third of the narrowest "
                        f"spot ({advice.spot_width_deg:.3g} deg wide at {advice.d_min_A:.3g} A): recommend -phisteps "
                        f"{advice.phi_steps} (or -sampling advised)")
    if mosaic_domains < advice.mosaic_domains:
        warnings.append(f"{mosaic_domains} mosaic domain(s) over a {advice.mosaic_spread_deg:g} deg spread leave gaps "
                        f"between spots {advice.spot_width_deg:.3g} deg wide: recommend -mosaic_domains "
                        f"{advice.mosaic_domains} (or -sampling advised)")
    return warnings


def _validate(config: SimulationConfig) -> None:
    check_values(config)
    check_spectrum(config.beam)
    if config.physics.physics not in PHYSICS_MODELS:
        raise NbsimError(f"physics must be one of {', '.join(PHYSICS_MODELS)} (got {config.physics.physics!r})")
    structure = config.structure
    if (structure.anomalous or structure.anomalous_table or structure.energy_bins) and not structure.model_file:
        raise NbsimError("anomalous scattering (-anomalous, -fp_fdp, -energy_bins) needs a -model FILE")
    if config.beam.background is not None:
        check_background(config.beam)
    if structure.energy_bins is not None and structure.energy_bins < 1:
        raise NbsimError(f"-energy_bins must be at least 1 (got {structure.energy_bins})")
    if config.crystal.shape not in CRYSTAL_SHAPES:
        raise NbsimError(f"unknown crystal shape '{config.crystal.shape}'")
    if config.structure.hkl_file is None and config.structure.model_file is None and config.structure.default_F == 0.0:
        raise NbsimError("no structure factors: give -hkl FILE, -model FILE or a non-zero -default_F")
    if config.beam.flux_photons_per_s != 0.0 and config.beam.beamsize_mm <= 0:
        raise NbsimError("-beamsize must be positive when -flux is given")


def _roi(roi: tuple[int, int, int, int] | None, geometry: DetectorGeometry) -> tuple[int, int, int, int]:
    """Inclusive pixel bounds (xmin, xmax, ymin, ymax) clipped to the detector."""
    xmin, xmax, ymin, ymax = roi if roi is not None else (0, geometry.pixels_f, 0, geometry.pixels_s)
    xmin, ymin = max(xmin, 0), max(ymin, 0)
    xmax, ymax = min(xmax, geometry.pixels_f - 1), min(ymax, geometry.pixels_s - 1)
    if xmin > xmax or ymin > ymax:
        raise NbsimError(f"the region of interest {roi} contains no pixel of the "
                         f"{geometry.pixels_f}x{geometry.pixels_s} detector")
    return xmin, xmax, ymin, ymax

