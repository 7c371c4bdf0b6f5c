"""Assemble the setup (geometry, crystal, sources, structure factors) and render the image in tiles."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils._pytree import tree_flatten

from . import crystal as crystal_mod
from .beam import Sources, build_sources
from .config import CRYSTAL_SHAPES, SimulationConfig, scalar_value
from .errors import NbsimError
from .geometry import DetectorGeometry, build_geometry
from .kernel.backends import OUT_OF_RANGE_STAGES, PIXEL_STAGES, SINGLE_STEP_STAGES, Structure, kernel_callable
from .kernel.inputs import kernel_inputs
from .kernel.ordered import OrderedOptions, Trace, render_ordered
from .kernel.policy import PROBE_PIXEL_STEPS, plan_compile, start_background_build
from .random import Ran1
from .structure_factors import HKLGrid, build_grid, read_hkl
from .vectors import norm

R_E_SQR_M2 = 7.94079248018965e-30
AVOGADRO = 6.02214179e23
WATER_F = 2.57
WATER_MW = 18.0
# Values held per tile: an eager tile materialises every pixel-step, a compiled tile only the per-pixel
# terms handed from the first kernel stage to the fused step sum (a single-step kernel writes the image
# directly and holds nothing else). Either way the bound keeps memory flat whatever the number of steps.
TILE_ELEMENTS = 1 << 22


@dataclass
class SensorLayers:
    thickness_m: float
    step_m: float
    layers: int
    mu_per_m: float


def sensor_layers(thickness_um: float, absorption_depth_um: float | None, layers: int | None) -> SensorLayers:
    """Sensor thickness, layer step and count, and μ, after nanoBragg's rules."""
    thick = thickness_um * 1e-6
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

    @property
    def shape(self) -> tuple[int, int]:
        return self.geometry.pixels_s, self.geometry.pixels_f

    @property
    def roi_is_whole_detector(self) -> bool:
        return self.roi == (0, self.shape[1] - 1, 0, self.shape[0] - 1)

    @property
    def photon_scale(self) -> float:
        """r_e² · fluence / steps: what every pixel's step sum is multiplied by."""
        return R_E_SQR_M2 * self.fluence / self.steps


def resolve(config: SimulationConfig) -> Setup:
    """Apply nanoBragg's defaults and derive geometry, lattice, sources and the structure-factor grid."""
    _validate(config)
    generator = Ran1()
    warnings: list[str] = []
    geometry = build_geometry(config.detector)
    lattice = crystal_mod.build_lattice(config.crystal, config.beam.wavelength_A, generator)
    n_cells = crystal_mod.cell_counts(config.crystal, lattice)
    phi = crystal_mod.phi_sampling(config.crystal)
    mosaic = crystal_mod.mosaic_domains(config.crystal, generator)
    cells = crystal_mod.oriented_cells(lattice, phi, geometry.spindle, mosaic)
    first_cells = None
    if crystal_mod.effective_phi_rad(phi)[0] != phi.angles_rad()[0]:
        unrotated = crystal_mod.PhiSampling(start_rad=0.0, step_rad=0.0, steps=1, osc_rad=0.0)
        first_cells = crystal_mod.oriented_cells(lattice, unrotated, geometry.spindle, mosaic)
    sources = build_sources(config.beam, geometry.beam, geometry.polar, geometry.vertical)

    crystal_size_m = max(float(length) * n for length, n in
                         zip(norm(lattice.real_A.detach() * 1e-10), n_cells, strict=True))
    # The ratio below is often an exact integer in theory, so its rounding decides a whole sub-pixel.
    # Where the recomputed distance equals the requested one up to rounding (which builds of the
    # reference, with or without fused multiply-adds, do not agree on), the requested one is used.
    distance_m = scalar_value(geometry.distance_m)
    if math.isclose(distance_m, geometry.requested_distance_m, rel_tol=1e-12):
        distance_m = geometry.requested_distance_m
    reciprocal_pixel_m = scalar_value(config.beam.wavelength_A) / 1e10 * distance_m / geometry.pixel_size_m
    recommended = max(math.ceil(3.0 * crystal_size_m / reciprocal_pixel_m), 1)
    oversample = config.detector.oversample if config.detector.oversample and config.detector.oversample > 0 \
        else recommended
    if oversample < recommended:
        warnings.append(f"maximum dimension of sample is {crystal_size_m * 1e10:g} A but reciprocal pixel size is "
                        f"{reciprocal_pixel_m * 1e10:g} A: recommend -oversample {recommended}")

    warnings += crystal_mod.default_warnings(config.crystal)
    grid, lookup = _structure_factors(config, n_cells)
    beam = config.beam
    fluence = beam.fluence_photons_per_m2
    if beam.flux_photons_per_s != 0.0 and beam.exposure_s > 0.0:
        fluence = beam.flux_photons_per_s * beam.exposure_s / (beam.beamsize_mm * 1e-3) ** 2
    water_m = beam.water_thickness_um * 1e-6
    background = WATER_F ** 2 * R_E_SQR_M2 * fluence * water_m ** 3 * 1e6 * AVOGADRO / WATER_MW
    steps = sources.count * mosaic.count * phi.steps * oversample * oversample
    roi = _roi(config.detector.roi, geometry)
    mask = _read_mask(config.detector.mask_file, geometry) if config.detector.mask_file else None
    return Setup(config=config, geometry=geometry, lattice=lattice, n_cells=n_cells, phi=phi, mosaic=mosaic,
                 cells_A=cells, sources=sources, grid=grid, lookup=lookup, oversample=oversample,
                 sensor=sensor_layers(config.detector.sensor_thickness_um,
                                      config.detector.sensor_absorption_depth_um, config.detector.sensor_layers),
                 fluence=fluence, background=background, steps=steps, roi=roi, mask=mask,
                 first_evaluation_cells_A=first_cells, warnings=warnings)


def _validate(config: SimulationConfig) -> None:
    wavelength = scalar_value(config.beam.wavelength_A)
    if not (wavelength > 0 and math.isfinite(wavelength)):
        raise NbsimError(f"wavelength must be positive (got {wavelength:g} A)")
    if config.crystal.shape not in CRYSTAL_SHAPES:
        raise NbsimError(f"unknown crystal shape '{config.crystal.shape}'")
    if config.structure.hkl_file is None and config.structure.default_F == 0.0:
        raise NbsimError("no structure factors: give -hkl FILE or a non-zero -default_F")
    if config.detector.oversample is not None and config.detector.oversample < 0:
        raise NbsimError("-oversample must not be negative")
    if any(n < 0 for n in config.crystal.n_cells):
        raise NbsimError("cell counts (-N, -Na, -Nb, -Nc) must not be negative")
    if config.beam.flux_photons_per_s != 0.0 and config.beam.beamsize_mm <= 0:
        raise NbsimError("-beamsize must be positive when -flux is given")


def _structure_factors(config: SimulationConfig, n_cells: tuple[int, int, int]) -> tuple[HKLGrid | None, str]:
    structure = config.structure
    if structure.hkl_file is None:
        return None, "default"
    grid = build_grid(read_hkl(structure.hkl_file), structure.default_F)
    interpolate = structure.interpolate
    if interpolate is None:
        interpolate = min(n_cells) <= 2
    return grid, ("interpolate" if interpolate else "nearest")


def _roi(roi: tuple[int, int, int, int] | None, geometry: DetectorGeometry) -> tuple[int, int, int, int]:
    """Inclusive pixel bounds (xmin, xmax, ymin, ymax) clipped to the detector."""
    xmin, xmax, ymin, ymax = roi if roi is not None else (0, geometry.pixels_f, 0, geometry.pixels_s)
    xmin, ymin = max(xmin, 0), max(ymin, 0)
    xmax, ymax = min(xmax, geometry.pixels_f - 1), min(ymax, geometry.pixels_s - 1)
    if xmin > xmax or ymin > ymax:
        raise NbsimError(f"the region of interest {roi} contains no pixel of the "
                         f"{geometry.pixels_f}x{geometry.pixels_s} detector")
    return xmin, xmax, ymin, ymax


def _read_mask(path: str, geometry: DetectorGeometry) -> np.ndarray:
    from .io import read_smv

    header, data = read_smv(Path(path))
    if data.shape != (geometry.pixels_s, geometry.pixels_f):
        raise NbsimError(f"{path}: mask is {data.shape[1]}x{data.shape[0]} pixels but the detector is "
                         f"{geometry.pixels_f}x{geometry.pixels_s}")
    return data != 0


def openmp_row_chunks(rows: int, threads: int) -> list[tuple[int, int]]:
    """Row ranges of each thread under OpenMP's static schedule (libgomp's split)."""
    base, extra = divmod(rows, threads)
    chunks, start = [], 0
    for thread in range(threads):
        size = base + (1 if thread < extra else 0)
        chunks.append((start, start + size))
        start += size
    return [c for c in chunks if c[1] > c[0]]


class Renderer:
    """Renders a resolved setup on one device and dtype; reusable for repeated (timed) calls."""

    def __init__(self, setup: Setup, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 compile: bool | str = True, tile_elements: int = TILE_ELEMENTS, reference_threads: int = 2):
        self.setup = setup
        self.device = torch.device(device)
        self.dtype = dtype
        self.reference_threads = reference_threads
        self.inputs = kernel_inputs(setup, self.device, dtype)
        needs_grad = any(t.requires_grad for t in tree_flatten(self.inputs.tensors)[0])
        self.tile_elements = tile_elements
        detector = setup.config.detector
        self.step_ordered = detector.oversample_thick or detector.oversample_polar or detector.oversample_omega
        tensors = self.inputs.tensors
        self.counts = (tensors.origins.shape[0], tensors.inv_wavelength.shape[0], tensors.beam_terms.shape[2])
        self.steps_per_pixel = math.prod(self.counts)
        self.structure = Structure(self.inputs.options, single_step=self.steps_per_pixel == 1)
        # Step-ordered renders run eagerly whatever the mode: in `auto` there is nothing worth building.
        self.plan = plan_compile("off" if self.step_ordered and compile == "auto" else compile, self.device, dtype,
                                 needs_grad, self.structure)
        xmin, xmax, ymin, ymax = setup.roi
        self.cols = torch.arange(xmin, xmax + 1, device=self.device, dtype=dtype)
        self.mask = None if setup.mask is None else setup.mask[ymin:ymax + 1, xmin:xmax + 1]
        self.warnings: list[str] = []
        """What the renders found that nanoBragg warns about (each once)."""

    @property
    def mode(self) -> str:
        """How the kernel runs now: 'eager', 'jit' or 'aot' (`auto` may switch from eager on the first call)."""
        return self.plan.mode

    @property
    def values_per_pixel(self) -> int:
        """Values a tile holds per pixel: every pixel-step when eager, else the per-pixel terms handed
        from the first compiled stage to the fused step sum."""
        if self.mode == "eager" or self.step_ordered or self.steps_per_pixel == 1:
            return self.steps_per_pixel
        substeps, sources, orientations = self.counts
        return 3 * substeps * orientations + substeps * sources + substeps + 1

    def __call__(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The (slow, fast) image: zero outside the ROI and on masked pixels.

        `out`, a (slow, fast) tensor of the renderer's device and dtype, is filled and returned instead
        of a new tensor (repeated renders then reuse one buffer).
        """
        setup = self.setup
        xmin, xmax, ymin, ymax = setup.roi
        if out is not None and (tuple(out.shape) != setup.shape or out.dtype != self.dtype
                                or out.device != self.device):
            raise NbsimError(f"out must be a {setup.shape[0]}x{setup.shape[1]} {self.dtype} tensor on {self.device}, "
                             f"not {'x'.join(map(str, out.shape))} {out.dtype} on {out.device}")
        image = out if out is not None else torch.empty(setup.shape, device=self.device, dtype=self.dtype)
        build_later = self.plan.pending is not None and not self._compile_now()
        if not setup.roi_is_whole_detector:
            image.zero_()
        region = image[ymin:ymax + 1, xmin:xmax + 1]
        lookup = self.inputs.options.lookup
        switch = self._interpolation_switch() if lookup == "interpolate" else None
        self._render_rows(ymin, ymax + 1, "nearest" if switch is not None else lookup, region)
        fixed: dict[tuple[int, int], OrderedOptions] = {}
        if switch is not None:
            interpolated_until, trigger = switch
            for start, count in interpolated_until:
                if count:
                    positions = self._unmasked_positions(start, ymax + 1 - start)[:count]
                    rows, cols = np.divmod(positions, len(self.cols))
                    block = torch.empty_like(region[:int(rows[-1]) + 1])
                    self._render_rows(start, start + len(block), "interpolate", block)
                    rows, cols = torch.as_tensor(rows, device=self.device), torch.as_tensor(cols, device=self.device)
                    region[start - ymin + rows, cols] = block[rows, cols]
            fixed[trigger] = OrderedOptions(interpolation_switch=True)
            self._warn_once(_interpolation_warning(trigger, setup.grid))
        if self.inputs.first_evaluation is not None:
            for pixel in self._thread_first_pixels():
                base = fixed.get(pixel, OrderedOptions())
                fixed[pixel] = dataclasses.replace(base, first_evaluation=self.inputs.first_evaluation)
        for (row, col), ordered in fixed.items():
            ordered = dataclasses.replace(ordered, **self._ordered_flags())
            value, _ = self._ordered(row, col, ordered)
            region[row - ymin, col - xmin] = value
        if self.mask is not None:
            region.mul_(torch.as_tensor(self.mask, device=self.device, dtype=self.dtype))
        if build_later:
            started = start_background_build(self.plan)
            self.plan.note += ("; building it in the background for the next run" if started
                               else "; not built now (background builds off, or one is running)")
            self.plan.pending = None
        return image

    def _compile_now(self) -> bool:
        """Settle `auto` mode on the first call: time the eager kernel on a probe of the image, and switch
        to the compiled kernel when building it costs less than the eager render it saves
        (nbsim.kernel.policy). True when it switched."""
        _, _, ymin, ymax = self.setup.roi
        rows = ymax + 1 - ymin
        probe_rows = max(1, min(rows, PROBE_PIXEL_STEPS // max(1, len(self.cols) * self.steps_per_pixel)))
        lookup = self.inputs.options.lookup
        started = time.perf_counter()
        self._render_rows(ymin, ymin + probe_rows, lookup, torch.empty((probe_rows, len(self.cols)),
                                                                        device=self.device, dtype=self.dtype))
        passes = 2 if lookup == "interpolate" else 1
        eager_estimate_s = (time.perf_counter() - started) * rows / probe_rows * passes
        build_s = self.plan.estimated_build_s
        if not self.plan.compile_pays(eager_estimate_s):
            self.plan.note = (f"kernel not compiled yet: eager render (about {eager_estimate_s:.1f} s) is quicker "
                              f"than compiling first (about {build_s:.0f} s)")
            return False
        self.plan = dataclasses.replace(self.plan, mode=self.plan.pending, pending=None,
                                        note=f"compiling the kernel first (about {build_s:.0f} s) is quicker than "
                                             f"an eager render (about {eager_estimate_s:.0f} s)")
        return True

    def trace(self, row: int, col: int) -> tuple[float, Trace]:
        """Value and last-step trace of one pixel (for -printout_pixel)."""
        return self._ordered(row, col, OrderedOptions(**self._ordered_flags()))

    def _ordered_flags(self) -> dict[str, bool]:
        detector = self.setup.config.detector
        return dict(oversample_thick=detector.oversample_thick, oversample_polar=detector.oversample_polar,
                    oversample_omega=detector.oversample_omega)

    def _ordered(self, row: int, col: int, ordered: OrderedOptions) -> tuple[torch.Tensor, Trace]:
        rows = torch.tensor([row], device=self.device, dtype=self.dtype)
        cols = torch.tensor([col], device=self.device, dtype=self.dtype)
        value, trace = render_ordered(rows, cols, self.inputs.tensors, self.inputs.options, ordered)
        return value[0, 0], trace

    def _row_tiles(self, start: int, stop: int):
        """(first row, row-index tensor) of tiles covering [start, stop), each holding about tile_elements
        values; the first row comes as an int so that placing a tile never reads the device."""
        per_row = len(self.cols) * self.values_per_pixel
        rows_per_tile = max(1, self.tile_elements // max(1, per_row))
        for first in range(start, stop, rows_per_tile):
            yield first, torch.arange(first, min(first + rows_per_tile, stop), device=self.device, dtype=self.dtype)

    def _render_rows(self, start: int, stop: int, lookup: str, out: torch.Tensor) -> None:
        """Render ROI rows [start, stop) into `out` (rows × ROI columns), tile by tile."""
        options = dataclasses.replace(self.inputs.options, lookup=lookup)
        stages = SINGLE_STEP_STAGES if self.steps_per_pixel == 1 else PIXEL_STAGES
        kernel = kernel_callable(stages, options, self.mode)
        ordered = OrderedOptions(**self._ordered_flags())
        for first, rows in self._row_tiles(start, stop):
            block = out[first - start:first - start + len(rows)]
            if self.step_ordered:
                block.copy_(render_ordered(rows, self.cols, self.inputs.tensors, options, ordered)[0])
            else:
                kernel(rows, self.cols, self.inputs.tensors, block)

    def _unmasked_positions(self, start: int, rows: int) -> np.ndarray:
        """Flat ROI positions (row-major) of the unmasked pixels in `rows` rows from `start`."""
        ymin = self.setup.roi[2]
        if self.mask is None:
            return np.arange(rows * len(self.cols))
        return np.flatnonzero(self.mask[start - ymin:start - ymin + rows])

    def _thread_chunks(self) -> list[tuple[int, int]]:
        """Each reference thread's rows, intersected with the ROI."""
        _, _, ymin, ymax = self.setup.roi
        chunks = []
        for first, stop in openmp_row_chunks(self.setup.geometry.pixels_s, self.reference_threads):
            first, stop = max(first, ymin), min(stop, ymax + 1)
            if first < stop:
                chunks.append((first, stop))
        return chunks

    def _thread_first_pixels(self) -> list[tuple[int, int]]:
        """The first pixel each reference OpenMP thread renders (where the phi-step quirk bites)."""
        xmin = self.setup.roi[0]
        pixels = []
        for first, stop in self._thread_chunks():
            positions = self._unmasked_positions(first, stop - first)
            if len(positions):
                row, col = divmod(int(positions[0]), len(self.cols))
                pixels.append((first + row, xmin + col))
        return pixels

    def _interpolation_switch(self):
        """Where nanoBragg stops interpolating, modelling its threads as advancing in step.

        Returns None when no step leaves the grid; otherwise, per thread, (first row, number of
        pixels still interpolated) and the pixel whose step triggers the switch.
        """
        _, _, ymin, ymax = self.setup.roi
        kernel = kernel_callable(OUT_OF_RANGE_STAGES, self.inputs.options, self.mode)
        flags = torch.empty((ymax + 1 - ymin, len(self.cols)), dtype=torch.bool, device=self.device)
        for first, rows in self._row_tiles(ymin, ymax + 1):
            kernel(rows, self.cols, self.inputs.tensors, flags[first - ymin:first - ymin + len(rows)])
        outside = flags.cpu().numpy()
        if self.mask is not None:
            outside &= self.mask
        if not outside.any():
            return None
        chunks = self._thread_chunks()
        firsts = []
        for first, stop in chunks:
            sequence = outside[first - ymin:stop - ymin][self._mask_rows(first, stop)]
            firsts.append(int(np.argmax(sequence)) if sequence.any() else None)
        switch_at = min(v for v in firsts if v is not None)
        trigger_thread = firsts.index(switch_at)
        first, stop = chunks[trigger_thread]
        position = self._unmasked_positions(first, stop - first)[switch_at]
        row, col = divmod(int(position), len(self.cols))
        trigger = (first + row, self.setup.roi[0] + col)
        return [(first, switch_at) for first, _ in chunks], trigger

    def _warn_once(self, line: str) -> None:
        if line not in self.warnings:
            self.warnings.append(line)

    def _mask_rows(self, first: int, stop: int) -> np.ndarray:
        ymin = self.setup.roi[2]
        if self.mask is None:
            return np.ones((stop - first, len(self.cols)), dtype=bool)
        return self.mask[first - ymin:stop - ymin]


def _interpolation_warning(trigger: tuple[int, int], grid: HKLGrid) -> str:
    slow, fast = trigger
    low, high = grid.index_min, grid.index_max
    return (f"out of range for tricubic interpolation at pixel {fast} {slow} (fast slow): its Miller indices "
            f"come within two of the edge of the table (h {low[0]}..{high[0]}, k {low[1]}..{high[1]}, "
            f"l {low[2]}..{high[2]}) or leave it; as in nanoBragg, interpolation is off from there on")


def structure_for(config: SimulationConfig) -> Structure:
    """The kernel structure `config` renders with (what decides which compiled kernels it loads)."""
    return Renderer(resolve(config), compile="off").structure


def simulate(config: SimulationConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
             compile: bool | str = "auto") -> torch.Tensor:
    """Render the image nanoBragg would produce for `config`, as a (slow, fast) tensor.

    `compile`: "auto" (compiled when the kernel is cached or building it pays, see nbsim.kernel.policy),
    True/"on" or False/"off".
    """
    return Renderer(resolve(config), device=device, dtype=dtype, compile=compile)()
