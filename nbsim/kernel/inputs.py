"""What the kernel takes: its structural options, its input tensors, and which of their sizes vary.

A compiled kernel is specialised only to `KernelOptions` (the code path), the dtype and the device.
Every number is a tensor value and every count is a tensor size that may change from run to run:
tile rows and columns, sub-steps (sub-pixels × sensor layers), sources, crystal orientations
(phi steps × mosaic domains) and the HKL table's length. `INPUT_SHAPES` names those sizes, so the
ahead-of-time and just-in-time back-ends mark the same dimensions dynamic.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..config import CrystalShape, SimulationConfig
from ..resolve import sensor_layers
from ..vectors import cross, unit

if TYPE_CHECKING:
    from ..resolve import Setup

Lookup = Literal["default", "nearest", "interpolate"]
Polarization = Literal["none", "unpolarized", "kahn"]
SUBSTEPS, SOURCES, ORIENTATIONS, TABLE = "substeps", "sources", "orientations", "table"
ROWS, COLS = "rows", "cols"
STEP_DIMS = (SUBSTEPS, SOURCES, ORIENTATIONS)
"""The step counts: dynamic in a many-step kernel; all 1 in a single-step kernel, which is compiled with
them fixed at 1 (a reduction over sizes only known at run time would cost it a factor of ten)."""


@dataclass(frozen=True)
class KernelOptions:
    """Choices that change the code the kernel compiles to: structure only, never a count or value."""

    shape: CrystalShape = "square"
    """Crystal shape model: square, round, gauss or tophat."""
    lookup: Lookup = "default"
    """Structure factors: "default" (no HKL table), "nearest" or "interpolate"."""
    point_pixel: bool = False
    curved: bool = False
    polarization: Polarization = "unpolarized"
    """"none" (-nopolar), "unpolarized" (Kahn factor 0) or "kahn"."""
    use_dmin: bool = False
    use_sensor: bool = False

    def restricted(self, fields: tuple[str, ...]) -> KernelOptions:
        """These options with every field not in `fields` at its default: what a stage reading only
        `fields` is compiled with, so structures that differ elsewhere share its kernel."""
        defaults = KernelOptions()
        return dataclasses.replace(defaults, **{name: getattr(self, name) for name in fields})

    def non_default(self) -> dict[str, object]:
        """The fields that differ from the defaults, by name (in field order)."""
        defaults = KernelOptions()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(defaults, f.name)}


class Projection(NamedTuple):
    """Projections v·p of pixel positions onto V fixed vectors.

    On a flat detector p = P_k + F·f̂ + S·ŝ, so v·p = origin[k, v] + F·fast[v] + S·slow[v];
    `vectors` (V, 3) serve the curved detector, whose positions are not linear in F and S.
    """

    origin: torch.Tensor
    fast: torch.Tensor
    slow: torch.Tensor
    vectors: torch.Tensor


class Scalars(NamedTuple):
    """The kernel's scalar inputs (0-d tensors), by name."""

    pixel_size_m: torch.Tensor
    distance_m: torch.Tensor
    close_distance_m: torch.Tensor
    scale: torch.Tensor
    """r_e² · fluence / steps."""
    background: torch.Tensor
    """Water background intensity I_bg added to every step sum."""
    kahn_factor: torch.Tensor
    mu_layer_step: torch.Tensor
    """Sensor attenuation μ times the layer thickness."""
    dmin_A: torch.Tensor
    default_F: torch.Tensor
    fudge: torch.Tensor


class KernelTensors(NamedTuple):
    """Inputs shared by every tile (all on the compute device and dtype but the integer
    `last_layer_substep` and `grid_extent`).

    origins: sub-step origins P_k (K, 3) in m; layer_of_substep (K,): each sub-step's sensor layer;
    last_layer_substep (1,) int64: the first sub-step of the last layer. frame rows: fdet, sdet, beam.
    cells: projections onto the a, b, c axes of every orientation (O each). beam_terms: (a·i)/λ etc.,
    (3, S, O). incident, odet, polar_e, polar_b: projections onto the source directions, the detector
    normal and the per-source polarization frame. source_weight (S,): each source's weight relative to
    the mean (all 1 but with a -spectrumfile), multiplying its steps' intensity. grid: the padded HKL
    table, flat (G,), or one padded table per channel laid end to end (anomalous scattering); grid_extent:
    one table's (h, k, l) sizes (int32); grid_offset (S,) int32: where each source's table starts in `grid`
    (all 0 with one table); grid_min/grid_max: the file's index range.
    """

    origins: torch.Tensor
    layer_of_substep: torch.Tensor
    last_layer_substep: torch.Tensor
    frame: torch.Tensor
    cells: tuple[Projection, Projection, Projection]
    beam_terms: torch.Tensor
    incident: Projection
    odet: Projection
    polar_e: Projection
    polar_b: Projection
    inv_wavelength: torch.Tensor
    source_weight: torch.Tensor
    grid: torch.Tensor
    grid_extent: torch.Tensor
    grid_offset: torch.Tensor
    grid_min: torch.Tensor
    grid_max: torch.Tensor
    n_cells: torch.Tensor
    reciprocal: torch.Tensor
    scalars: Scalars


def _projection_shapes(count: str | int) -> Projection:
    return Projection(origin=(SUBSTEPS, count), fast=(count,), slow=(count,), vectors=(count, 3))


INPUT_SHAPES = KernelTensors(
    origins=(SUBSTEPS, 3), layer_of_substep=(SUBSTEPS,), last_layer_substep=(1,), frame=(3, 3),
    cells=tuple(_projection_shapes(ORIENTATIONS) for _ in range(3)), beam_terms=(3, SOURCES, ORIENTATIONS),
    incident=_projection_shapes(SOURCES), odet=_projection_shapes(1), polar_e=_projection_shapes(SOURCES),
    polar_b=_projection_shapes(SOURCES), inv_wavelength=(SOURCES,), source_weight=(SOURCES,), grid=(TABLE,),
    grid_extent=(3,), grid_offset=(SOURCES,), grid_min=(3,), grid_max=(3,), n_cells=(3,), reciprocal=(3, 3),
    scalars=Scalars(*([()] * len(Scalars._fields))))
"""Every input's shape: ints are fixed sizes, names are run-time counts."""

EXAMPLE_SIZES = {ROWS: 64, COLS: 1024, SUBSTEPS: 4, SOURCES: 5, ORIENTATIONS: 6, TABLE: 7}
"""Distinct sizes of at least 2 for tracing a kernel: a traced size of 1 (or two equal sizes) would be
specialised, and then serve only inputs of that size. The tile is image-sized because Inductor decides
from these hints whether a loop is worth running on several threads."""


def _is_shape(node) -> bool:
    return isinstance(node, tuple) and all(isinstance(d, (int, str)) for d in node)


def input_dims(single_step: bool) -> list[dict[int, str]]:
    """Per flattened KernelTensors leaf: {dimension: count name} of its run-time sizes."""
    shapes, _ = tree_flatten(INPUT_SHAPES, is_leaf=_is_shape)
    return [{dim: size for dim, size in enumerate(shape)
             if isinstance(size, str) and not (single_step and size in STEP_DIMS)} for shape in shapes]


def example_tensors(dtype: torch.dtype, device: torch.device, single_step: bool) -> KernelTensors:
    """Inputs of EXAMPLE_SIZES (values irrelevant; step counts 1 for a single-step kernel) to trace a
    kernel without a simulation set-up."""

    def make(shape):
        sizes = [1 if single_step and d in STEP_DIMS else EXAMPLE_SIZES[d] if isinstance(d, str) else d
                 for d in shape]
        return torch.ones(sizes, dtype=dtype, device=device)

    tensors = tree_map(make, INPUT_SHAPES, is_leaf=_is_shape)
    return tensors._replace(last_layer_substep=torch.zeros(1, dtype=torch.int64, device=device),
                            grid_extent=torch.ones(3, dtype=torch.int32, device=device),
                            grid_offset=torch.zeros(tensors.grid_offset.shape, dtype=torch.int32, device=device))


@dataclass
class KernelInputs:
    """The setup as kernel inputs on one device and dtype, plus the compile-time choices."""

    tensors: KernelTensors
    options: KernelOptions
    first_evaluation: KernelTensors | None
    """The inputs with the unrotated crystal's orientations (the phi-step quirk), or None."""


class TableTensors(NamedTuple):
    """The structure-factor tables as kernel inputs: the padded grids end to end (flat; one per anomalous
    channel, else one), one grid's (h, k, l) sizes (int32), where each source's grid starts (int32), and the
    file's index range."""

    grid: torch.Tensor
    grid_extent: torch.Tensor
    grid_offset: torch.Tensor
    grid_min: torch.Tensor
    grid_max: torch.Tensor


def table_tensors(setup: Setup, device: str | torch.device, dtype: torch.dtype) -> TableTensors:
    """The setup's HKL grid on the device (a zero table without one): built once, reused by callers that
    make kernel inputs for many values of the same set-up (a fit)."""
    device = torch.device(device)
    source_table = torch.zeros(setup.sources.count, dtype=torch.int64)
    if setup.grid is not None:
        default_F = setup.config.structure.default_F
        padded = np.stack([table.padded(default_F) for table in setup.channel_grids or [setup.grid]])
        grid = torch.as_tensor(padded.reshape(-1), dtype=dtype, device=device)
        grid_min, grid_max, grid_extent = setup.grid.index_min, setup.grid.index_max, padded.shape[1:]
        if setup.channel_grids:
            source_table = torch.as_tensor(setup.source_channel, dtype=torch.int64)
    else:
        grid = torch.zeros(1, dtype=dtype, device=device)
        grid_min, grid_max, grid_extent = (0, 0, 0), (0, 0, 0), (1, 1, 1)
    grid_offset = (source_table * math.prod(grid_extent)).to(device=device, dtype=torch.int32)
    return TableTensors(grid=grid, grid_extent=torch.tensor(grid_extent, dtype=torch.int32, device=device),
                        grid_offset=grid_offset,
                        grid_min=torch.as_tensor(grid_min, dtype=torch.float64).to(device=device, dtype=dtype),
                        grid_max=torch.as_tensor(grid_max, dtype=torch.float64).to(device=device, dtype=dtype))


def kernel_inputs(setup: Setup, device: str | torch.device, dtype: torch.dtype,
                  table: TableTensors | None = None) -> KernelInputs:
    """Precompute (in float64, keeping gradients) everything that does not depend on the pixel, and cast
    it to the compute device and dtype. `table`: the setup's table_tensors, where the caller holds them."""
    device = torch.device(device)
    g = setup.geometry
    config = setup.config

    def to(value) -> torch.Tensor:
        return torch.as_tensor(value, dtype=torch.float64).to(device=device, dtype=dtype)

    subpixel = g.pixel_size_m / setup.oversample
    sub_index = torch.arange(setup.oversample, dtype=torch.float64)
    sub_s, sub_f = torch.meshgrid(sub_index, sub_index, indexing="ij")
    layers = setup.sensor.layers
    substeps_per_layer = setup.oversample ** 2
    fast_offset = (subpixel * (sub_f.reshape(-1) + 0.5)).repeat(layers)
    slow_offset = (subpixel * (sub_s.reshape(-1) + 0.5)).repeat(layers)
    layer_of_substep = torch.arange(layers, dtype=torch.float64).repeat_interleave(substeps_per_layer)
    origins = (g.pix0_m + fast_offset.unsqueeze(-1) * g.fdet + slow_offset.unsqueeze(-1) * g.sdet
               + (layer_of_substep * setup.sensor.step_m).unsqueeze(-1) * g.odet)

    def projection(vectors: torch.Tensor) -> Projection:
        return Projection(origin=to(origins @ vectors.T), fast=to(vectors @ g.fdet), slow=to(vectors @ g.sdet),
                          vectors=to(vectors))

    incident = setup.sources.incident
    inv_wavelength = 1.0 / setup.sources.wavelength_A
    polar_b = unit(cross(g.polar.expand_as(incident), incident))
    polar_e = unit(cross(incident, polar_b))

    def orientation(cells_A: torch.Tensor) -> dict:
        """The crystal-orientation fields of the kernel inputs, for one set of (a, b, c) vectors."""
        return dict(cells=tuple(projection(cells_A[:, v, :]) for v in range(3)),
                    beam_terms=to(torch.stack([(incident @ cells_A[:, v, :].T) * inv_wavelength.unsqueeze(-1)
                                               for v in range(3)])))

    table = table or table_tensors(setup, device, dtype)
    beam = config.beam
    scalars = Scalars(
        pixel_size_m=to(g.pixel_size_m), distance_m=to(g.distance_m), close_distance_m=to(g.close_distance_m),
        scale=to(setup.photon_scale), background=to(setup.background), kahn_factor=to(beam.kahn_polarization),
        mu_layer_step=to(setup.sensor.mu_per_m * setup.sensor.step_m), dmin_A=to(beam.dmin_A),
        default_F=to(config.structure.default_F), fudge=to(config.crystal.fudge))
    tensors = KernelTensors(
        origins=to(origins), layer_of_substep=to(layer_of_substep),
        last_layer_substep=torch.tensor([(layers - 1) * substeps_per_layer], dtype=torch.int64, device=device),
        frame=to(torch.stack([g.fdet, g.sdet, g.beam])), **orientation(setup.cells_A), incident=projection(incident),
        odet=projection(g.odet.unsqueeze(0)), polar_e=projection(polar_e), polar_b=projection(polar_b),
        inv_wavelength=to(inv_wavelength), source_weight=to(setup.sources.relative_weights), **table._asdict(),
        n_cells=to(setup.n_cells), reciprocal=to(setup.lattice.reciprocal_per_A),
        scalars=scalars)
    first = None
    if setup.first_evaluation_cells_A is not None:
        first = tensors._replace(**orientation(setup.first_evaluation_cells_A))
    return KernelInputs(tensors=tensors, options=kernel_options(config, setup.lookup), first_evaluation=first)


def kernel_options(config: SimulationConfig, lookup: Lookup) -> KernelOptions:
    """The code path `config` renders with, given its structure-factor lookup (`setup.lookup_of`): the
    one place options are derived, for kernel_inputs and nbsim.kernel.structure alike."""
    beam, detector = config.beam, config.detector
    return KernelOptions(
        shape=config.crystal.shape, lookup=lookup, point_pixel=detector.point_pixel, curved=detector.curved,
        polarization=("none" if polarization_off(config) else "kahn" if beam.kahn_polarization != 0 else "unpolarized"),
        use_dmin=beam.dmin_A > 0, use_sensor=sensor_layers(detector).thickness_m > 0)


def polarization_off(config: SimulationConfig) -> bool:
    """Whether -nopolar holds: nanoBragg recomputes the Kahn factor for every sub-pixel under -oversample_polar
    whatever -nopolar says (only its first, per-pixel evaluation checks it); -physics corrected keeps -nopolar."""
    return config.beam.no_polarization and not (config.detector.oversample_polar and not config.corrected)
