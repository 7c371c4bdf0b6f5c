"""Rendering a resolved setup: the image in row tiles on one device and dtype, the region of interest
and mask, and the per-pixel replays that reproduce nanoBragg's OpenMP-order effects (`Renderer`,
`simulate`).

A renderer's compile setting becomes a plan when it is made (`Renderer.plan`, nbsim.kernel.policy) and a
decision once settled (`Renderer.settle`: at once unless `auto` finds the kernel uncached, then on the
first render or an explicit call); `Renderer.loads` counts the compiled kernels it opened from the cache,
built, or found open. Nothing is built in the background unless asked (`build_missing_in_background`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import warnings

import numpy as np
import torch
from torch.utils._pytree import tree_flatten

from .config import SimulationConfig
from .devices import concrete_device
from .errors import NbsimError
from .kernel.background import background_inputs, background_rows, pixel_centre_m
from .kernel.build import start_background_build
from .kernel.cache import KernelCache, KernelLoads
from .kernel.dispatch import kernel_callable
from .kernel.inputs import Lookup, kernel_inputs
from .kernel.ordered import OrderedOptions, Trace, render_ordered
from .kernel.physics import PixelTerms, pixel_frame
from .kernel.policy import PROBE_PIXEL_STEPS, CompileDecision, plan_compile
from .kernel.stages import OUT_OF_RANGE_STAGES, Structure
from .kernel.structure import structure_of
from .model.structure_factors import HKLGrid
from .modes import Compile, Mode
from .resolve import Setup, resolve

log = logging.getLogger(__name__)

# Values held per tile: an eager tile materialises every pixel-step, a compiled tile only the per-pixel
# terms handed from the first kernel stage to the fused step sum (a single-step kernel writes the image
# directly and holds nothing else). Either way the bound keeps memory flat whatever the number of steps.
TILE_ELEMENTS = 1 << 22


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
    """Renders a resolved setup on one device and dtype; reusable for repeated (timed) calls.

    `compile`: Compile.AUTO, ON or OFF, or a spelling Compile.of reads (True/False, "auto", "on", "off").
    `cache`: where compiled kernels are found and built (default: KernelCache.default(), NBSIM_CACHE_DIR).
    """

    def __init__(self, setup: Setup, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 compile: Compile | bool | str = True, tile_elements: int | None = None, reference_threads: int = 2,
                 cache: KernelCache | None = None):
        self.setup = setup
        self.device = concrete_device(device)
        self.dtype = dtype
        self.reference_threads = reference_threads
        self.inputs = kernel_inputs(setup, self.device, dtype)
        needs_grad = any(t.requires_grad for t in tree_flatten(self.inputs.tensors)[0])
        self.tile_elements = tile_elements
        """Values per tile (None: TILE_ELEMENTS, or one tile where the kernel holds nothing per pixel)."""
        detector = setup.config.detector
        self.step_ordered = detector.oversample_thick or detector.oversample_polar or detector.oversample_omega
        tensors = self.inputs.tensors
        self.counts = (tensors.origins.shape[0], tensors.inv_wavelength.shape[0], tensors.beam_terms.shape[2])
        self.steps_per_pixel = math.prod(self.counts)
        self.structure = structure_of(setup.config)
        rendered = Structure(self.inputs.options, single_step=self.steps_per_pixel == 1)
        if self.structure != rendered:
            raise RuntimeError(f"structure_of gives {self.structure.name}, but the resolved set-up renders "
                               f"{rendered.name}: their count rules disagree (please report this)")
        self.cache = cache if cache is not None else KernelCache.default()
        self.loads = KernelLoads()
        """The compiled kernels this renderer's renders opened from the cache, built, or found open."""
        setting = Compile.of(compile)
        # Step-ordered renders run eagerly whatever the mode: in `auto` there is nothing worth building.
        if self.step_ordered and setting is Compile.AUTO:
            setting = Compile.OFF
        self.plan = plan_compile(setting, self.device, dtype, needs_grad, self.structure, self.cache)
        self.decision: CompileDecision | None = None if self.plan.pending else self.plan.decide()
        """The settled mode and why (None until `settle` has timed the eager probe of a pending plan)."""
        if setting is Compile.ON and self.mode is Mode.EAGER:
            warnings.warn(f"compile on: {self.plan.note}", stacklevel=2)
        xmin, xmax, ymin, ymax = setup.roi
        self.cols = torch.arange(xmin, xmax + 1, device=self.device, dtype=dtype)
        self.mask = None if setup.mask is None else setup.mask[ymin:ymax + 1, xmin:xmax + 1]
        self.background = None
        """The amorphous background's inputs (nbsim.kernel.background), or None without one."""
        self.background_options = (dataclasses.replace(self.inputs.options, polarization="none")
                                    if setup.config.beam.no_polarization else self.inputs.options)
        """The background's kernel options: nbsim's own background keeps -nopolar (only nanoBragg's sub-pixel loop
        recomputes the polarization under -oversample_polar)."""
        if setup.background_curve is not None and not setup.panels:
            g = setup.geometry
            self.background = background_inputs(
                self.inputs.tensors, pixel_centre_m(g.pix0_m, g.fdet, g.sdet, g.pixel_size_m), setup.background_curve,
                setup.sensor.mu_per_m * setup.sensor.thickness_m if setup.sensor.thickness_m > 0 else 0.0)
        self.warnings: list[str] = []
        """What the renders found that nanoBragg warns about (each once)."""
        self.panels = [Renderer(panel, self.device, dtype, compile, tile_elements, reference_threads, self.cache)
                       for panel in setup.panel_setups()]
        """A multi-panel setup's panels, each rendered as a single-panel setup of its own with the same
        kernel (one structure: no compile per panel or per number of panels), sharing this renderer's
        decision and `loads`."""
        for panel in self.panels:
            panel.loads = self.loads

    @property
    def mode(self) -> Mode:
        """How the kernel runs now (eager while a pending plan is not settled)."""
        return (self.decision or self.plan).mode

    @property
    def kernel_path(self) -> str:
        """What its renders ran: the mode's value, or, where this machine refused the ahead-of-time packages
        and their stages ran just in time, 'jit (aot refused)' (nbsim.kernel.cache.KernelLoads.path)."""
        return self.loads.path(self.mode)

    def settle(self) -> CompileDecision:
        """The mode this renderer renders in, settled once: a plan pending in `auto` mode is settled by
        timing the eager kernel on a probe of the image (at most PROBE_PIXEL_STEPS pixel-steps) and
        asking the plan whether compiling first pays (nbsim.kernel.policy). The first render settles it
        when no caller has."""
        if self.decision is None:
            self.decision = self.plan.decide(self.eager_estimate_s())
        for panel in self.panels:
            panel.decision = self.decision
        return self.decision

    def build_missing_in_background(self) -> bool:
        """Start a detached build of the ahead-of-time kernels the settled decision left unbuilt
        (nbsim.kernel.build; one per structure at a time); True when one was started."""
        if not self.settle().unbuilt:
            return False
        return start_background_build(self.cache, self.structure, self.dtype, self.device)

    @property
    def values_per_pixel(self) -> int:
        """Values a tile holds per pixel besides the image: every pixel-step when eager, none for the
        compiled single-step kernel (it writes the image directly), else the per-pixel terms handed
        from the first compiled stage to the fused step sum."""
        if self.mode is Mode.EAGER or self.step_ordered:
            return self.steps_per_pixel
        if self.steps_per_pixel == 1:
            return 0
        return PixelTerms.values_per_pixel(*self.counts)

    def __call__(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The (slow, fast) image: zero outside the ROI and on masked pixels. A multi-panel setup's image is
        (panels, slow, fast): panel i's pixels in [i, :its slow, :its fast], zero-padded to the largest.

        `out`, a tensor of that shape and the renderer's device and dtype, is filled and returned instead
        of a new tensor (repeated renders then reuse one buffer).
        """
        setup = self.setup
        xmin, xmax, ymin, ymax = setup.roi
        if out is not None and (tuple(out.shape) != setup.shape or out.dtype != self.dtype
                                or out.device != self.device):
            raise NbsimError(f"out must be a {setup.shape[0]}x{setup.shape[1]} {self.dtype} tensor on {self.device}, "
                             f"not {'x'.join(map(str, out.shape))} {out.dtype} on {out.device}")
        image = out if out is not None else torch.empty(setup.shape, device=self.device, dtype=self.dtype)
        self.settle()
        if self.panels:
            return self._render_panels(image)
        if not setup.roi_is_whole_detector:
            image.zero_()
        region = image[ymin:ymax + 1, xmin:xmax + 1]
        lookup = self.inputs.options.lookup
        switch = self._interpolation_switch()
        self._render_rows(ymin, ymax + 1, "nearest" if switch is not None else lookup, region)
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
            self._warn_once(_interpolation_warning(trigger, setup.grid))
        for (row, col), ordered in self._loop_ordered_pixels(switch).items():
            value, _ = self._ordered(row, col, ordered)
            region[row - ymin, col - xmin] = value
        if self.background is not None:
            self._add_background(ymin, ymax + 1, region)
        if self.mask is not None:
            region.mul_(torch.as_tensor(self.mask, device=self.device, dtype=self.dtype))
        return image

    def _render_panels(self, image: torch.Tensor) -> torch.Tensor:
        """Each panel into its slice of the (panels, slow, fast) image, the padding zeroed."""
        if any(panel.setup.shape != image.shape[1:] for panel in self.panels):
            image.zero_()
        for panel, config, view in zip(self.panels, self.setup.config.detector.panels, image, strict=True):
            region = view[:panel.setup.shape[0], :panel.setup.shape[1]]
            if region.is_contiguous():
                panel(out=region)
            else:
                region.copy_(panel())
            for line in panel.warnings:  # the panels share `loads`: a kernel's warning is said once
                self._warn_once(line if line in self.loads.unusable else f"panel {config.name}: {line}")
        return image

    def eager_estimate_s(self) -> float:
        """Seconds an eager render of the image would take, extrapolated from an eager probe of its first rows."""
        if self.panels:
            return sum(panel.eager_estimate_s() for panel in self.panels)
        _, _, ymin, ymax = self.setup.roi
        rows = ymax + 1 - ymin
        probe_rows = max(1, min(rows, PROBE_PIXEL_STEPS // max(1, len(self.cols) * self.steps_per_pixel)))
        lookup = self.inputs.options.lookup
        started = time.perf_counter()
        self._render_rows(ymin, ymin + probe_rows, lookup, torch.empty((probe_rows, len(self.cols)),
                                                                        device=self.device, dtype=self.dtype))
        passes = 2 if lookup == "interpolate" else 1
        return (time.perf_counter() - started) * rows / probe_rows * passes

    def trace(self, row: int, col: int) -> tuple[float, Trace]:
        """Value and last-step trace of one pixel (for -printout_pixel); of a multi-panel setup, trace a
        panel's pixel with `renderer.panels[i].trace`."""
        if self.panels:
            raise NbsimError("a multi-panel renderer traces a pixel of one panel: use renderer.panels[i].trace")
        switch = self._interpolation_switch()
        ordered = self._loop_ordered_pixels(switch).get(
            (row, col), OrderedOptions(lookup=self._lookup_at(row, col, switch), **self._ordered_flags()))
        return self._ordered(row, col, ordered)

    def _loop_ordered_pixels(self, switch) -> dict[tuple[int, int], OrderedOptions]:
        """The pixels a render evaluates alone, in nanoBragg's loop order, and what each must reproduce: the
        step that switches interpolation off (`switch`, from `_interpolation_switch`), and each reference
        thread's first evaluation, which sees the unrotated crystal (the lookup of its pixel's steps is the
        one the switch leaves there)."""
        fixed: dict[tuple[int, int], OrderedOptions] = {}
        if switch is not None:
            fixed[switch[1]] = OrderedOptions(interpolation_switch=True)
        if self.inputs.first_evaluation is not None:
            for row, col in self._thread_first_pixels():
                base = fixed.get((row, col), OrderedOptions(lookup=self._lookup_at(row, col, switch)))
                fixed[row, col] = dataclasses.replace(base, first_evaluation=self.inputs.first_evaluation)
        return {pixel: dataclasses.replace(ordered, **self._ordered_flags()) for pixel, ordered in fixed.items()}

    def _lookup_at(self, row: int, col: int, switch) -> Lookup | None:
        """The lookup of a pixel's steps other than the switching one's: "interpolate" before the switch in
        its reference thread, "nearest" after it; None (the options') without a switch."""
        if switch is None:
            return None
        for (first, count), (_, stop) in zip(switch[0], self._thread_chunks(), strict=True):
            if first <= row < stop:
                position = (row - first) * len(self.cols) + col - self.setup.roi[0]
                return "interpolate" if position in self._unmasked_positions(first, stop - first)[:count] else "nearest"
        return None

    def _ordered_flags(self) -> dict[str, bool]:
        detector = self.setup.config.detector
        return dict(oversample_thick=detector.oversample_thick, oversample_polar=detector.oversample_polar,
                    oversample_omega=detector.oversample_omega, corrected=self.setup.config.corrected)

    def _add_background(self, start: int, stop: int, out: torch.Tensor) -> None:
        """Add the amorphous background of ROI rows [start, stop) to `out`, in tiles of about TILE_ELEMENTS
        values (one per pixel and incident direction)."""
        directions = len(self.background.weight)
        rows_per_tile = max(1, TILE_ELEMENTS // (len(self.cols) * directions))
        for first in range(start, stop, rows_per_tile):
            rows = torch.arange(first, min(first + rows_per_tile, stop), device=self.device, dtype=self.dtype)
            out[first - start:first - start + len(rows)] += background_rows(rows, self.cols, self.background,
                                                                            self.background_options)

    def _ordered(self, row: int, col: int, ordered: OrderedOptions) -> tuple[torch.Tensor, Trace]:
        rows = torch.tensor([row], device=self.device, dtype=self.dtype)
        cols = torch.tensor([col], device=self.device, dtype=self.dtype)
        value, trace = render_ordered(rows, cols, self.inputs.tensors, self.inputs.options, ordered)
        return value[0, 0], trace

    def _row_tiles(self, start: int, stop: int):
        """(first row, row-index tensor) of tiles covering [start, stop), each holding about tile_elements
        values (TILE_ELEMENTS by default); the first row comes as an int so that placing a tile never reads
        the device. By default a kernel that holds nothing per pixel renders [start, stop) as one tile:
        every tile is a parallel region whose start and join cost a few per cent of a 4096² seed image."""
        held = self.values_per_pixel
        if self.tile_elements is None and held == 0:
            rows_per_tile = stop - start
        else:
            rows_per_tile = (self.tile_elements or TILE_ELEMENTS) // (len(self.cols) * max(1, held))
        rows_per_tile = max(1, rows_per_tile)
        for first in range(start, stop, rows_per_tile):
            yield first, torch.arange(first, min(first + rows_per_tile, stop), device=self.device, dtype=self.dtype)

    def _render_rows(self, start: int, stop: int, lookup: str, out: torch.Tensor) -> None:
        """Render ROI rows [start, stop) into `out` (rows × ROI columns), tile by tile."""
        options = dataclasses.replace(self.inputs.options, lookup=lookup)
        kernel = kernel_callable(self.structure.stages, options, self.mode, self.cache, self.loads)
        ordered = OrderedOptions(**self._ordered_flags())
        for first, rows in self._row_tiles(start, stop):
            block = out[first - start:first - start + len(rows)]
            if self.step_ordered:
                block.copy_(render_ordered(rows, self.cols, self.inputs.tensors, options, ordered)[0])
            else:
                kernel(rows, self.cols, self.inputs.tensors, block)
        for line in self.loads.unusable:  # a package this machine cannot open: its stage ran just in time
            self._warn_once(line)

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
        """The pixel of each reference OpenMP thread's first evaluation (where the phi-step quirk bites): its
        first rendered pixel with a step that -dmin keeps (nanoBragg skips a cut source before the phi loop)."""
        xmin = self.setup.roi[0]
        pixels = []
        for first, stop in self._thread_chunks():
            for row in range(first, stop):  # a row at a time: the first row mostly holds one
                kept = self._mask_rows(row, row + 1)[0]
                if self.inputs.options.use_dmin:
                    rows = torch.tensor([row], device=self.device, dtype=self.dtype)
                    valid = pixel_frame(rows, self.cols, self.inputs.tensors, self.inputs.options).valid
                    kept = kept & valid[0].flatten(1).any(-1).cpu().numpy()
                if kept.any():
                    pixels.append((row, xmin + int(np.argmax(kept))))
                    break
        return pixels

    def _interpolation_switch(self):
        """Where nanoBragg stops interpolating, modelling its threads as advancing in step.

        Returns None when the lookup does not interpolate or no step leaves the grid; otherwise, per thread,
        (first row, number of pixels still interpolated) and the pixel whose step triggers the switch.
        """
        if self.inputs.options.lookup != "interpolate":
            return None
        _, _, ymin, ymax = self.setup.roi
        kernel = kernel_callable(OUT_OF_RANGE_STAGES, self.inputs.options, self.mode, self.cache, self.loads)
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


def simulate(config: SimulationConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
             compile: Compile | bool | str = "auto", background_build: bool = False) -> torch.Tensor:
    """Render the image nanoBragg would produce for `config`, as a (slow, fast) tensor.

    `compile`: "auto" (compiled when the kernel is cached or building it pays, see nbsim.kernel.policy),
    True/"on" or False/"off". `background_build`: when `auto` rendered eagerly for want of a kernel,
    start building it in a detached process for later runs (nbsim.kernel.build). Why `auto` chose the
    mode it did (e.g. eager for gradients) is logged at INFO on `nbsim.render`; a Renderer keeps it as
    `settle().note`.
    """
    renderer = Renderer(resolve(config), device=device, dtype=dtype, compile=compile)
    image = renderer()
    if renderer.decision.note:
        log.info("%s", renderer.decision.note)
    if background_build:
        renderer.build_missing_in_background()
    return image
