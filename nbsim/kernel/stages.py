"""What a kernel is made of: its stages, the pipelines they form, the structure that picks them, and the
stage variants (one compiled package each).

A kernel is a short pipeline of stages (per-pixel preparation, then the fused step sum). Each stage is
compiled on its own, with the Inductor options it needs, for one *structure* only: the KernelOptions
fields the stage reads, the dtype and the device. Every count (tile rows and columns, sub-steps,
sources, orientations, HKL table length) is a dynamic size and every number a tensor value, so one
compiled stage serves every detector, step count, HKL file and physics value of its structure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..devices import dtype_name
from .inputs import COLS, ORIENTATIONS, ROWS, SOURCES, SUBSTEPS, KernelOptions
from .physics import PixelTerms, pixel_kernel, prepare_pixels, steps_out_of_range, sum_steps

ALL_OPTIONS = tuple(field.name for field in dataclasses.fields(KernelOptions))


@dataclass(frozen=True)
class Stage:
    """One compiled kernel of a pipeline: its function, the KernelOptions fields it reads, the stage
    whose output it takes (None: it takes the tile's rows and columns), the Inductor options it
    needs, and the NamedTuple its outputs form (None: a single tensor)."""

    function: Callable
    reads: tuple[str, ...]
    after: Stage | None = None
    inductor_options: tuple[tuple[str, object], ...] = ()
    output: type | None = None
    single_step: bool = False
    """Compiled for one step per pixel (step counts fixed at 1) rather than any number."""
    vectors_per_iteration: int = 1
    """SIMD vectors an ahead-of-time CPU loop iteration computes side by side
    (inductor_patches.vectors_per_iteration) when the variant looks nothing up in the HKL table."""
    one_loop: bool = False
    """Built ahead of time with ONE_LOOP's Inductor options instead of inductor_options, and with every
    loop over the tile's rows and columns (inductor_patches.tile_shaped_loops)."""

    @property
    def name(self) -> str:
        """The stage's name: its function's."""
        return self.function.__name__

    def vectors_for(self, options: KernelOptions, device: torch.device) -> int:
        """vectors_per_iteration for a variant: 1 off the CPU, and 1 with a table lookup, whose per-pixel
        gathers ran 25–45 % slower four or two vectors wide (measured side by side on the heavy and
        triclinic workloads)."""
        return self.vectors_per_iteration if device.type == "cpu" and options.lookup == "default" else 1

    def leading_dims(self, options: KernelOptions) -> list[dict[int, str]]:
        """{dimension: size name} of each flattened leading input (PixelTerms are pixels-last)."""
        if self.after is None:
            return [{0: ROWS}, {0: COLS}]
        return [{1: SUBSTEPS, 2: ORIENTATIONS, 3: ROWS, 4: COLS}, {0: SUBSTEPS, 1: ROWS, 2: COLS},
                {0: ROWS, 1: COLS}, {0: SUBSTEPS, 1: SOURCES, 2: ROWS, 3: COLS} if options.use_dmin else {}]


@contextlib.contextmanager
def dynamic_shape_config() -> Iterator[None]:
    """How a stage is traced, just-in-time or ahead of time: symbolic sizes that may be 1 without a
    guard, and no duck shaping (equal counts are not tied together)."""
    with torch.fx.experimental._config.patch(use_duck_shape=False, backed_size_oblivious=True):
        yield


# The step sum is a single reduction whose per-step intermediates should stay in registers, not be
# written out, so Inductor is told not to materialise them (and that the clamped table index needs
# no bounds check), and, without a table lookup, its loops compute several pixel vectors at once. The
# per-pixel stage keeps Inductor's defaults.
FUSED_STEPS = (("realize_reads_threshold", 1 << 20), ("realize_opcount_threshold", 1 << 20),
               ("realize_acc_reads_threshold", 1 << 20), ("assert_indirect_indexing", False))
FUSED_VECTORS = 4
# Inlined whole, the single-step kernel is slow to build: Inductor re-derives a value's expression at
# each of its uses (x² in every term of a sine polynomial, the fractional Miller index). Built ahead of
# time, it lets Inductor materialise reused values as usual and fuses them all back into one loop
# (inductor_patches.tile_shaped_loops), where they stay in registers: the same loop and image, in about
# half the build.
ONE_LOOP = (("max_fusion_size", 1 << 20), ("assert_indirect_indexing", False))
PREPARE_PIXELS = Stage(prepare_pixels, ("curved", "point_pixel", "polarization", "use_dmin", "use_sensor"),
                       output=PixelTerms)
PIXEL_STAGES = (PREPARE_PIXELS, Stage(sum_steps, ("shape", "lookup", "use_dmin"), PREPARE_PIXELS, FUSED_STEPS,
                                      vectors_per_iteration=FUSED_VECTORS))
# With a single step per pixel there is nothing to share between steps: one kernel, no hand-over, and
# no per-pixel intermediates written out.
SINGLE_STEP_STAGES = (Stage(pixel_kernel, ALL_OPTIONS, None, FUSED_STEPS, single_step=True,
                            vectors_per_iteration=FUSED_VECTORS, one_loop=True),)
OUT_OF_RANGE_STAGES = (PREPARE_PIXELS, Stage(steps_out_of_range, ("shape", "use_dmin"), PREPARE_PIXELS, FUSED_STEPS))


@dataclass(frozen=True)
class Structure:
    """What decides which compiled kernels a render needs: its options and whether a pixel has one step."""

    options: KernelOptions
    single_step: bool

    @property
    def stages(self) -> tuple[Stage, ...]:
        """The pipeline that renders the image."""
        return SINGLE_STEP_STAGES if self.single_step else PIXEL_STAGES

    def pipelines(self) -> list[tuple[tuple[Stage, ...], KernelOptions]]:
        """The stage pipelines a render of this structure may run (tricubic interpolation also runs the
        out-of-range test and, past the grid's edge, the nearest-node lookup)."""
        pipelines = [(self.stages, self.options)]
        if self.options.lookup == "interpolate":
            pipelines += [(OUT_OF_RANGE_STAGES, self.options),
                          (self.stages, dataclasses.replace(self.options, lookup="nearest"))]
        return pipelines

    def stage_variants(self) -> list[StageVariant]:
        """Each distinct compiled stage of those pipelines (stages that read the same options share one)."""
        variants: dict[tuple, StageVariant] = {}
        for stages, options in self.pipelines():
            for variant in StageVariant.of_pipeline(stages, options):
                variants.setdefault((variant.stage.name, variant.options, variant.writes_out), variant)
        return list(variants.values())

    @property
    def name(self) -> str:
        """A short readable name: steps per pixel, shape, lookup and every other non-default option."""
        flags = [f"{name}_{value}" for name, value in self.options.non_default().items()
                 if name not in ("shape", "lookup")]
        return "-".join(["single" if self.single_step else "steps", self.options.shape, self.options.lookup, *flags])

    def to_json(self) -> str:
        """The structure as JSON (its kernel options and whether it is single-step)."""
        return json.dumps({"options": dataclasses.asdict(self.options), "single_step": self.single_step})

    @staticmethod
    def from_json(text: str) -> Structure:
        """The structure `to_json` wrote."""
        data = json.loads(text)
        return Structure(KernelOptions(**data["options"]), bool(data["single_step"]))


@dataclass(frozen=True)
class StageVariant:
    """One compiled stage: a stage, the options it reads, and whether it writes into the image."""

    stage: Stage
    options: KernelOptions
    writes_out: bool

    @staticmethod
    def of_pipeline(stages: tuple[Stage, ...], options: KernelOptions) -> list[StageVariant]:
        """The variants a pipeline runs with `options`, in order (the last one writes into the image)."""
        return [StageVariant(stage, options.restricted(stage.reads), writes_out=index == len(stages) - 1)
                for index, stage in enumerate(stages)]

    def identity(self, dtype: torch.dtype, device: torch.device) -> dict:
        """What this variant's compiled code depends on besides the installation (no count, shape or value)."""
        return {"stage": self.stage.name, "options": {name: getattr(self.options, name) for name in self.stage.reads},
                "writes_out": self.writes_out, "dtype": dtype_name(dtype), "device": device.type}
