"""Rendering a resolved setup: the image in row tiles on one device and dtype, the region of interest
and mask, and the per-pixel replays that reproduce nanoBragg's OpenMP-order effects (`Renderer`,
`simulate`)."""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import torch
from torch.utils._pytree import tree_flatten

from .config import SimulationConfig
from .errors import NbsimError
from .kernel.backends import OUT_OF_RANGE_STAGES, PIXEL_STAGES, SINGLE_STEP_STAGES, kernel_callable
from .kernel.inputs import kernel_inputs
from .kernel.ordered import OrderedOptions, Trace, render_ordered
from .kernel.physics import PixelTerms
from .kernel.policy import PROBE_PIXEL_STEPS, plan_compile, start_background_build
from .kernel.structure import structure_of
from .setup import Setup, resolve
from .structure_factors import HKLGrid

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
    """Renders a resolved setup on one device and dtype; reusable for repeated (timed) calls."""

    def __init__(self, setup: Setup, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 compile: bool | str = True, tile_elements: int | None = None, reference_threads: int = 2):
        self.setup = setup
        self.device = torch.device(device)
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
        """Values a tile holds per pixel besides the image: every pixel-step when eager, none for the
        compiled single-step kernel (it writes the image directly), else the per-pixel terms handed
        from the first compiled stage to the fused step sum."""
        if self.mode == "eager" or self.step_ordered:
            return self.steps_per_pixel
        if self.steps_per_pixel == 1:
            return 0
        return PixelTerms.values_per_pixel(*self.counts)

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


def simulate(config: SimulationConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
             compile: bool | str = "auto") -> torch.Tensor:
    """Render the image nanoBragg would produce for `config`, as a (slow, fast) tensor.

    `compile`: "auto" (compiled when the kernel is cached or building it pays, see nbsim.kernel.policy),
    True/"on" or False/"off".
    """
    return Renderer(resolve(config), device=device, dtype=dtype, compile=compile)()
