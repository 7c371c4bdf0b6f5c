"""The fitted pixels of many shots as scattering vectors, for fits that refine the crystal only.

With the detector and the beam's directions fixed, a pixel's sub-pixel positions, sources, polarization, solid
angle and capture never change; only the crystal does, and a spectrum's energies (q = (p̂ − î)·E/hc scales
with its source's energy). `ScatteringPixels` computes once, per shot, each pixel's scattering vectors q (per
sub-pixel and source), step weights and per-pixel factor, and each shot's orientation matrices C_o (phi steps
× mosaic domains), and lays the pixels of every shot end to end, so that one compiled kernel call
(nbsim.fit.compiled) renders every shot's pixels from the shots' real cell vectors R and N, and gives the
derivatives autograd needs to carry on to the refined quantities. A refined spectrum scales each source's q
by its new energy over the old; its derivatives come from the kernel's derivatives in R source by source
(h = R·C_o·q: ∂/∂E_s = Σ R·∂/∂R over source s's steps, divided by E_s), the sources laid out as pixels of
their own for that call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..config import scalar_value
from ..devices import dtype_name
from ..kernel.inputs import TableTensors, kernel_inputs
from ..kernel.physics import pixel_frame, prepare_pixels
from ..model.crystal import Lattice, oriented_cells
from ..modes import Compile
from ..resolve import Setup
from ..sensors import HC_EV_A
from .compiled import LOOKUPS, CrystalKernel, Variant, crystal_kernel

CRYSTAL_QUANTITIES = ("orientation", "cell", "N", "scale", "spectrum", "background")
CHUNK_STEPS = 1 << 15
"""Pixel-steps per call of the compiled kernel on the CPU: the per-step values Inductor keeps between its
loops then stay in the cache (the derivative kernel took 26 ns a step in calls of 1,024 pixels × 40 steps,
112 ns in calls of 64,000 pixels × 40)."""
EAGER_CHUNK_STEPS = 1 << 20
"""Pixel-steps per call of crystal_sums run eagerly: bounds the memory its per-step tensors take."""
"""What a fit may refine for its pixels' scattering vectors to stay fixed."""


def fixed_frame_fittable(setups: Sequence[Setup], refine: Sequence[str]) -> bool:
    """Can these set-ups' fitted pixels be rendered from fixed scattering vectors: only the crystal refined,
    a square crystal (the kernel's lattice factor), one structure-factor table looked up at the nearest node
    (or none), every shot with the same lookup."""
    if not set(refine) <= set(CRYSTAL_QUANTITIES) or not setups:
        return False
    lookups = {setup.lookup for setup in setups}
    return (len(lookups) == 1 and lookups <= set(LOOKUPS)
            and all(setup.config.crystal.shape == "square" and not setup.channel_grids for setup in setups))


def identity_orientations(setup: Setup) -> torch.Tensor:
    """The set-up's orientation matrices C_o (O, 3, 3): oriented_cells is linear in the real cell vectors R,
    and its cells for R are R·C_o (C_o: its cells for R = 1)."""
    identity = torch.eye(3, dtype=torch.float64)
    lattice = Lattice(real_A=identity, reciprocal_per_A=identity, volume_A3=torch.ones((), dtype=torch.float64),
                      misset_rad=None)
    return oriented_cells(lattice, setup.phi, setup.geometry.spindle, setup.mosaic).detach()


@dataclass
class ShotSpectrum:
    """A shot's sources' energies where its q were computed (eV, (S,)), and what gives them for another shift
    and stretch of its spectrum: E′ = given_mean + shift + stretch·offset, `given_mean` the given spectrum's
    weighted mean energy and `offsets` each source's offset from it (nbsim.config.shifted_energies_eV)."""

    energy_eV: torch.Tensor
    given_mean_eV: float
    offsets_eV: torch.Tensor

    def energies_eV(self, spectrum: torch.Tensor) -> torch.Tensor:
        """Each source's energy (S,) for a spectrum's (shift in eV, stretch)."""
        return self.given_mean_eV + spectrum[0] + spectrum[1] * self.offsets_eV


def shot_spectrum(setup: Setup, device: torch.device, dtype: torch.dtype) -> ShotSpectrum:
    """The energies of a set-up's sources and the given spectrum's offsets (its shift and stretch undone)."""
    beam = setup.config.beam
    energy = HC_EV_A / setup.sources.wavelength_A.detach().to(torch.float64)
    weights = setup.sources.relative_weights.detach().to(torch.float64)
    mean = float((energy * weights).sum() / weights.sum())
    shift, stretch = scalar_value(beam.spectrum_shift_eV), scalar_value(beam.spectrum_stretch)
    return ShotSpectrum(energy_eV=energy.to(device=device, dtype=dtype), given_mean_eV=mean - shift,
                        offsets_eV=((energy - mean) / stretch).to(device=device, dtype=dtype))


@dataclass
class ShotPixels:
    """One shot's fixed inputs on the model's device and dtype: q (3, K, P) Å⁻¹ for its K sub-pixel × source
    steps (the source fastest), step weights (K, P), the per-pixel factor (P), the constant background
    intensity, its orientation matrices C_o (O, 3, 3), its default_F and, where its spectrum is refined, its
    sources' energies."""

    q: torch.Tensor
    weight: torch.Tensor
    factor: torch.Tensor
    background: torch.Tensor
    orientations: torch.Tensor
    default_F: float
    spectrum: ShotSpectrum | None = None

    @property
    def count(self) -> int:
        """The shot's pixels."""
        return self.q.shape[-1]

    def chunks(self, pixels: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The shot's q and weights in contiguous runs of at most `pixels` pixels (kept once made)."""
        kept = self.__dict__.setdefault("_chunks", {})
        if pixels not in kept:
            kept[pixels] = [(self.q[..., start:start + pixels].contiguous(),
                             self.weight[..., start:start + pixels].contiguous())
                            for start in range(0, self.count, pixels)]
        return kept[pixels]


def shot_pixels(setup: Setup, rows: torch.Tensor, cols: torch.Tensor, table: TableTensors,
                device: torch.device, dtype: torch.dtype, runs: list[tuple[int, int, int]] | None = None,
                spectral: bool = False) -> ShotPixels:
    """A shot's fixed inputs for its pixels (rows (P,), cols (P, 1)) as the set-up renders them; on a multi-panel
    detector, `runs` (panel, start, stop) say which panel renders which run of them (nbsim.fit.model.panel_runs);
    `spectral`: with its sources' energies, for a refined spectrum."""
    if runs is not None:
        panels = setup.panel_setups()
        parts = [shot_pixels(panels[panel], rows[start:stop], cols[start:stop], table, device, dtype)
                 for panel, start, stop in runs]
        return ShotPixels(q=torch.cat([part.q for part in parts], dim=-1),
                          weight=torch.cat([part.weight for part in parts], dim=-1),
                          factor=torch.cat([part.factor for part in parts]), background=parts[0].background,
                          orientations=parts[0].orientations, default_F=parts[0].default_F,
                          spectrum=shot_spectrum(setup, device, dtype) if spectral else None)
    with torch.no_grad():
        inputs = kernel_inputs(setup, device, dtype, table=table)
        tensors, options = inputs.tensors, inputs.options
        frame = pixel_frame(rows, cols, tensors, options)
        factor = prepare_pixels(rows, cols, tensors, options).factor.reshape(-1)
        inverse_path = frame.inverse_path[:, 0, :]
        incident = setup.sources.incident.detach().to(device=device, dtype=dtype)
        inverse_wavelength = tensors.inv_wavelength
        q = torch.stack([((position[:, 0, :] * inverse_path).T.unsqueeze(1) - incident[:, axis].view(1, -1, 1))
                         * inverse_wavelength.view(1, -1, 1)
                         for axis, position in enumerate((frame.x, frame.y, frame.z))])
        weight = tensors.source_weight.view(1, -1, 1).expand(q.shape[1], -1, q.shape[3])
        if frame.valid is not None:
            weight = weight * frame.valid[:, 0].permute(1, 2, 0).to(dtype)
        pixels = q.shape[-1]
        return ShotPixels(q=q.reshape(3, -1, pixels).contiguous(), weight=weight.reshape(-1, pixels).contiguous(),
                          factor=factor.contiguous(), background=tensors.scalars.background,
                          orientations=identity_orientations(setup).to(device=device, dtype=dtype),
                          default_F=float(setup.config.structure.default_F),
                          spectrum=shot_spectrum(setup, device, dtype) if spectral else None)


class CrystalSums(torch.autograd.Function):
    """Σ w·F²·F_latt² at the pixels of a call's shots (P,) from each shot's R (shots, 9), N (shots, 3) and, where
    refined, its spectrum's shift and stretch (shots, 2; else None), with the kernel's derivatives as its
    backward (first derivatives only: a fit on this path takes its Hessian by differences of gradients).
    `kernel(real, n_cells, spectrum, derivatives)` runs the kernel; `counts`: each shot's pixels, in order."""

    @staticmethod
    def forward(ctx, real: torch.Tensor, n_cells: torch.Tensor, spectrum: torch.Tensor | None, kernel: Callable,
                counts: list[int]) -> torch.Tensor:
        """The sums (P,), keeping the kernel's derivatives for backward when an input needs a gradient."""
        if not (real.requires_grad or n_cells.requires_grad or (spectrum is not None and spectrum.requires_grad)):
            return kernel(real, n_cells, spectrum, False)[0]
        total, by_n, by_real, *by_spectrum = kernel(real, n_cells, spectrum, True)
        ctx.save_for_backward(by_real, by_n, *by_spectrum)
        ctx.counts = counts
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total: torch.Tensor):
        """The gradients in each shot's R, N and spectrum: the kept derivatives weighted by grad_total, summed per
        shot."""
        by_real, by_n, *by_spectrum = ctx.saved_tensors
        spectrum = per_shot(by_spectrum[0] * grad_total, ctx.counts) if by_spectrum else None
        return (per_shot(by_real * grad_total, ctx.counts), per_shot(by_n * grad_total, ctx.counts), spectrum,
                None, None)


def per_shot(values: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """(C, P) per-pixel values summed over each shot's pixels: (shots, C)."""
    return torch.stack([part.sum(dim=-1) for part in torch.split(values, counts, dim=-1)])


class ScatteringPixels:
    """Every shot's fitted pixels end to end, rendered by the fit's kernel from the shots' R and N.

    `groups` lists shots a compiled kernel off the CPU renders in one call (same steps per pixel,
    orientations, table and default_F; a shot's pixels are `spans[shot]` of the group's arrays); on the CPU,
    and eagerly, each shot's pixels go in runs of a bounded number of pixel-steps (`kernel_for`)."""

    def __init__(self, setups: Sequence[Setup], rows: Sequence[torch.Tensor], cols: Sequence[torch.Tensor],
                 tables: Sequence[TableTensors], device: torch.device, dtype: torch.dtype,
                 value: CrystalKernel, gradient: CrystalKernel,
                 runs: Sequence[list[tuple[int, int, int]] | None] | None = None, spectral: bool = False):
        self.value, self.gradient = value, gradient
        self.device, self.dtype = device, dtype
        self.spectral = spectral
        """Are the shots' spectra refined (their shift and stretch inputs of every call)?"""
        shots = [shot_pixels(setup, r, c, table, device, dtype, panel_runs, spectral)
                 for setup, r, c, table, panel_runs in zip(setups, rows, cols, tables, runs or [None] * len(setups),
                                                           strict=True)]
        self.shots = shots
        keys: dict[tuple, list[int]] = {}
        for index, shot in enumerate(shots):
            key = (shot.q.shape[1], shot.orientations.shape[0], id(tables[index].grid), shot.default_F)
            keys.setdefault(key, []).append(index)
        self.groups = list(keys.values())
        self.spans: dict[int, tuple[int, int]] = {}
        for members in self.groups:
            start = 0
            for shot in members:
                self.spans[shot] = (start, start + shots[shot].count)
                start += shots[shot].count
        self._groups_inputs: dict[int, tuple[torch.Tensor, ...]] = {}

    def _group_inputs(self, number: int) -> tuple[torch.Tensor, ...]:
        """A group's shots end to end: q, weights, each pixel's shot in the group, and the shots' C_o."""
        if number not in self._groups_inputs:
            members, shots, device = self.groups[number], self.shots, self.device
            owner = torch.cat([torch.full((shots[shot].count,), local, dtype=torch.int64, device=device)
                               for local, shot in enumerate(members)])
            self._groups_inputs[number] = (torch.cat([shots[s].q for s in members], dim=-1),
                                           torch.cat([shots[s].weight for s in members], dim=-1), owner,
                                           torch.stack([shots[s].orientations for s in members]))
        return self._groups_inputs[number]

    @property
    def compiled(self) -> bool:
        """Does a compiled kernel render the pixels (else crystal_sums eagerly, shot by shot)?"""
        return self.value.compiled

    def calls(self, shots: Sequence[int], tables: Sequence[TableTensors]) -> list[tuple[int, list[int], TableTensors]]:
        """The kernel calls that render `shots` with the tables the model holds now (a caller may have replaced
        one): (group, its shots among them, table)."""
        wanted = set(shots)
        calls = []
        for number, members in enumerate(self.groups):
            chosen = [shot for shot in members if shot in wanted]
            if not chosen:
                continue
            if all(tables[shot].grid is tables[chosen[0]].grid for shot in chosen):
                calls.append((number, chosen, tables[chosen[0]]))
            else:
                calls += [(number, [shot], tables[shot]) for shot in chosen]
        return calls

    def kernel_for(self, number: int, chosen: list[int], table: TableTensors) -> Callable:
        """kernel(real (shots, 9), n_cells (shots, 3), spectrum (shots, 2) or None, derivatives) → crystal_sums's
        outputs at the pixels of `chosen` (shots of group `number`, in its order), and with a spectrum and
        derivatives, the derivatives in its shift and stretch (2, P): the compiled kernel on the CPU (and for
        refined spectra) in runs of about CHUNK_STEPS pixel-steps of one shot each, elsewhere one call for the
        group's shots."""
        grid = (table.grid, table.grid_min, table.grid_max, table.grid_extent,
                torch.tensor(self.shots[chosen[0]].default_F, dtype=self.dtype, device=self.device))
        if not self.compiled or self.device.type == "cpu" or self.spectral:
            return self._chunked(chosen, grid, CHUNK_STEPS if self.compiled else EAGER_CHUNK_STEPS)
        q, weight, owner, orientations = self._group_inputs(number)
        members = self.groups[number]
        if len(chosen) < len(members):
            pieces = [self.spans[shot] for shot in chosen]
            q = torch.cat([q[..., a:b] for a, b in pieces], dim=-1)
            weight = torch.cat([weight[..., a:b] for a, b in pieces], dim=-1)
            owner = torch.cat([torch.full((b - a,), local, dtype=torch.int64, device=self.device)
                               for local, (a, b) in enumerate(pieces)])
            orientations = torch.stack([orientations[members.index(shot)] for shot in chosen])

        def kernel(real: torch.Tensor, n_cells: torch.Tensor, spectrum: torch.Tensor | None,
                   derivatives: bool) -> tuple[torch.Tensor, ...]:
            with torch.no_grad():
                run = self.gradient if derivatives else self.value
                return run(q, weight, owner, real.detach(), n_cells.detach(), orientations, *grid)

        return kernel

    def _chunked(self, chosen: list[int], grid: tuple, steps: int) -> Callable:
        """kernel_for in runs of about `steps` pixel-steps of one shot each: the compiled kernel's per-step values
        then stay in the cache; the eager kernel's per-step tensors stay small."""
        def kernel(real: torch.Tensor, n_cells: torch.Tensor, spectrum: torch.Tensor | None,
                   derivatives: bool) -> tuple[torch.Tensor, ...]:
            run = self.gradient if derivatives else self.value
            parts = []
            with torch.no_grad():
                for local, shot in enumerate(chosen):
                    fixed = self.shots[shot]
                    pixels = max(2, steps // (fixed.q.shape[1] * fixed.orientations.shape[0]))
                    inputs = (real[local:local + 1].detach(), n_cells[local:local + 1].detach(),
                              fixed.orientations.unsqueeze(0))
                    if spectrum is None:
                        parts += [run(q, weight, self._owner(q.shape[-1]), *inputs, *grid)
                                  for q, weight in fixed.chunks(pixels)]
                    else:
                        parts += self._spectral_runs(run, fixed, spectrum[local].detach(), inputs, grid, pixels,
                                                     derivatives)
            return tuple(torch.cat(outputs, dim=-1) for outputs in zip(*parts, strict=True))

        return kernel

    def _spectral_runs(self, run: Callable, fixed: ShotPixels, spectrum: torch.Tensor, inputs: tuple, grid: tuple,
                       pixels: int, derivatives: bool) -> list[tuple[torch.Tensor, ...]]:
        """One shot's runs with its spectrum moved to (shift, stretch): each source's q scaled by its new energy over
        its old. With derivatives, each source's steps are pixels of their own in the call (its derivatives in R
        apart), and the outputs are summed back per pixel, with the derivatives in the shift and stretch. A spectrum
        with a stretch or an energy that is not positive has no photons (NaN: a rejected step), and is not given
        to the kernel, whose table lookups assume finite indices."""
        energies = fixed.spectrum.energies_eV(spectrum.to(self.dtype))
        sources = energies.numel()
        factor = (energies / fixed.spectrum.energy_eV).view(1, 1, sources, 1)
        real = inputs[0][0]
        if not bool(spectrum[1] > 0 and torch.isfinite(energies).all() and (energies > 0).all()):
            nothing = torch.full((fixed.count,), math.nan, dtype=self.dtype, device=self.device)
            return [(nothing, *(nothing.expand(rows, -1) for rows in ((3, 9, 2) if derivatives else ())))]
        parts = []
        for q, weight in fixed.chunks(pixels):
            count = q.shape[-1]
            substeps = q.shape[1] // sources
            scaled = q.view(3, substeps, sources, count) * factor
            if not derivatives:
                parts.append(run(scaled.reshape(3, -1, count), weight, self._owner(count), *inputs, *grid))
                continue
            total, by_n, by_real = run(scaled.reshape(3, substeps, sources * count),
                                       weight.reshape(substeps, sources * count), self._owner(sources * count),
                                       *inputs, *grid)
            by_real = by_real.view(9, sources, count)
            by_energy = torch.einsum("i,isp->sp", real, by_real) / energies.view(-1, 1)
            by_spectrum = torch.stack([by_energy.sum(dim=0),
                                       (by_energy * fixed.spectrum.offsets_eV.view(-1, 1)).sum(dim=0)])
            parts.append((total.view(sources, count).sum(dim=0), by_n.view(3, sources, count).sum(dim=1),
                          by_real.sum(dim=1), by_spectrum))
        return parts

    def _owner(self, pixels: int) -> torch.Tensor:
        """Zeros (pixels,): the shot index of a one-shot call."""
        kept = self.__dict__.setdefault("_owners", {})
        if pixels not in kept:
            kept[pixels] = torch.zeros(pixels, dtype=torch.int64, device=self.device)
        return kept[pixels]

    def render(self, shots: Sequence[int], real: Sequence[torch.Tensor], n_cells: Sequence[torch.Tensor],
               tables: Sequence[TableTensors], spectra: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Photons (before the shot's scale) at the pixels of each of `shots`, given each one's R (3, 3) and
        N (3), and with refined spectra its spectrum's (shift, stretch), differentiable in all."""
        given = {shot: (r, n) for shot, r, n in zip(shots, real, n_cells, strict=True)}
        spectrum_of = dict(zip(shots, spectra, strict=True)) if self.spectral else {}
        photons: dict[int, torch.Tensor] = {}
        for number, chosen, table in self.calls(shots, tables):
            counts = [self.shots[shot].count for shot in chosen]
            stacked_real = torch.stack([given[shot][0].reshape(9) for shot in chosen]).to(self.device, self.dtype)
            stacked_n = torch.stack([given[shot][1].reshape(3) for shot in chosen]).to(self.device, self.dtype)
            stacked_spectra = (torch.stack([spectrum_of[shot] for shot in chosen]).to(self.device, self.dtype)
                               if self.spectral else None)
            total = CrystalSums.apply(stacked_real, stacked_n, stacked_spectra, self.kernel_for(number, chosen, table),
                                      counts)
            for shot, part in zip(chosen, torch.split(total, counts), strict=True):
                photons[shot] = self.shots[shot].factor * (self.shots[shot].background + part)
        return [photons[shot] for shot in shots]


def scattering_pixels(setups: Sequence[Setup], rows: Sequence[torch.Tensor], cols: Sequence[torch.Tensor],
                      tables: Sequence[TableTensors], device: torch.device, dtype: torch.dtype, compile: Compile,
                      runs: Sequence[list[tuple[int, int, int]] | None] | None = None,
                      spectral: bool = False) -> ScatteringPixels:
    """The set-ups' pixels on the fit's kernel: compiled where `compile` and the cache allow
    (nbsim.fit.compiled.crystal_kernel), else eager; `runs`: each multi-panel shot's panel runs; `spectral`: with
    their spectra's shift and stretch as inputs."""
    lookup = setups[0].lookup
    value, gradient = (crystal_kernel(Variant(lookup, gradients, dtype_name(dtype), device.type), compile)
                       for gradients in (False, True))
    if value.compiled != gradient.compiled:
        value, gradient = CrystalKernel(value.variant), CrystalKernel(gradient.variant)
    return ScatteringPixels(setups, rows, cols, tables, device, dtype, value, gradient, runs, spectral)
