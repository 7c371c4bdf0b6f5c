"""Where the kernel runs: eagerly, just-in-time or ahead-of-time, and the on-disk kernel cache.

A kernel is a short pipeline of stages (per-pixel preparation, then the fused step sum). Each stage is
compiled on its own, with the Inductor options it needs, for one *structure* only: the KernelOptions
fields the stage reads, the dtype and the device. Every count (tile rows and columns, sub-steps,
sources, orientations, HKL table length) is a dynamic size and every number a tensor value, so one
compiled stage serves every detector, step count, HKL file and physics value of its structure.

* ``jit``: ``torch.compile``. Differentiable and device-agnostic; a new process pays Dynamo tracing
  and a cache lookup (seconds) before the first call.
* ``aot``: ``torch.export`` + AOTInductor, packaged once per stage variant into the persistent cache
  (``NBSIM_CACHE_DIR``/kernels, with a JSON description beside each package) and loaded by PyTorch's
  C++ runner, so a new process starts the kernel in a fraction of a second. Inference only; used on
  the CPU when no input needs gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import platform
import time
import unittest.mock
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..cache import cache_dir
from ..cpu import cpu_flags
from ..devices import dtype_name
from .inputs import (
    COLS,
    EXAMPLE_SIZES,
    ORIENTATIONS,
    ROWS,
    SOURCES,
    SUBSTEPS,
    KernelOptions,
    example_tensors,
    input_dims,
)
from .physics import PixelTerms, pixel_kernel, prepare_pixels, steps_out_of_range, sum_steps

CACHE_EVENTS: Counter = Counter()
"""'aot_hit' / 'aot_miss' (a package compiled now) counts for this process."""

_SOURCES = ("physics.py", "inputs.py", "backends.py", "../structure_factors.py")
MAX_PIXELS_PER_SIDE = 1 << 20
MAX_COUNT = 1 << 24
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
    """SIMD vectors an ahead-of-time CPU loop iteration computes side by side (see _vectors_per_iteration)
    when the variant looks nothing up in the HKL table."""
    one_loop: bool = False
    """Built ahead of time with ONE_LOOP's Inductor options instead of inductor_options, and with every
    loop over the tile's rows and columns (see _tile_shaped_loops)."""

    def vectors_for(self, options: KernelOptions, device: torch.device) -> int:
        """vectors_per_iteration for a variant: 1 off the CPU, and 1 with a table lookup, whose per-pixel
        gathers ran 25–45 % slower four or two vectors wide (measured side by side on the heavy and
        triclinic workloads)."""
        return self.vectors_per_iteration if device.type == "cpu" and options.lookup == "default" else 1


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
# (_tile_shaped_loops), where they stay in registers: the same loop and image, in about half the build.
ONE_LOOP = (("max_fusion_size", 1 << 20), ("assert_indirect_indexing", False))
# Every ahead-of-time build lets the C++ compiler contract a multiply and an add into one fused
# multiply-add (Inductor's default forbids it): the fused kernels are chains of Horner steps and dot
# products, and with several vectors per loop iteration their time is the count of instructions
# (seed float64 21 % and float32 10 % faster, measured side by side; docs/benchmarks.md). The C
# reference, built with -O3 -march=native, contracts them too.
CONTRACTED = (("cpp.enable_floating_point_contract_flag", "fast"),)
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

    def pipelines(self) -> list[tuple[tuple[Stage, ...], KernelOptions]]:
        """The stage pipelines a render of this structure may run (tricubic interpolation also runs the
        out-of-range test and, past the grid's edge, the nearest-node lookup)."""
        stages = SINGLE_STEP_STAGES if self.single_step else PIXEL_STAGES
        pipelines = [(stages, self.options)]
        if self.options.lookup == "interpolate":
            pipelines += [(OUT_OF_RANGE_STAGES, self.options),
                          (stages, dataclasses.replace(self.options, lookup="nearest"))]
        return pipelines

    def stage_variants(self) -> list[StageVariant]:
        """Each distinct compiled stage of those pipelines (stages that read the same options share one)."""
        variants: dict[tuple, StageVariant] = {}
        for stages, options in self.pipelines():
            for index, stage in enumerate(stages):
                variant = StageVariant(stage, options.restricted(stage.reads), writes_out=index == len(stages) - 1)
                variants.setdefault((stage.function.__name__, variant.options, variant.writes_out), variant)
        return list(variants.values())

    @property
    def name(self) -> str:
        """A short readable name: steps per pixel, shape, lookup and every other non-default option."""
        flags = [f"{name}_{value}" for name, value in self.options.non_default().items()
                 if name not in ("shape", "lookup")]
        return "-".join(["single" if self.single_step else "steps", self.options.shape, self.options.lookup, *flags])

    def to_json(self) -> str:
        return json.dumps({"options": dataclasses.asdict(self.options), "single_step": self.single_step})

    @staticmethod
    def from_json(text: str) -> Structure:
        data = json.loads(text)
        return Structure(KernelOptions(**data["options"]), bool(data["single_step"]))


@dataclass(frozen=True)
class StageVariant:
    """One ahead-of-time package: a stage, the options it reads, and whether it writes into the image."""

    stage: Stage
    options: KernelOptions
    writes_out: bool

    def description(self, dtype: torch.dtype, device: torch.device) -> dict:
        """Everything the compiled code depends on, and nothing else (no count, shape or value)."""
        return {**_build_environment(), "stage": self.stage.function.__name__,
                "options": {name: getattr(self.options, name) for name in self.stage.reads},
                "writes_out": self.writes_out, "dtype": dtype_name(dtype), "device": device.type}

    def key(self, dtype: torch.dtype, device: torch.device) -> str:
        text = json.dumps(self.description(dtype, device), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def package(self, dtype: torch.dtype, device: torch.device) -> Path:
        return kernels_dir() / f"{self.key(dtype, device)}.pt2"


def kernels_dir() -> Path:
    return cache_dir() / "kernels"


def missing_packages(structure: Structure, dtype: torch.dtype, device: torch.device) -> list[StageVariant]:
    """The ahead-of-time packages of a structure that are not in the cache yet."""
    return [v for v in structure.stage_variants() if not v.package(dtype, device).is_file()]


def kernel_callable(stages: tuple[Stage, ...], options: KernelOptions,
                    mode: str) -> Callable[[torch.Tensor, torch.Tensor, object, torch.Tensor], None]:
    """A callable (rows, cols, tensors, out) that runs the stages in the requested mode and writes
    the last stage's (rows, cols) values into `out`.

    An ahead-of-time CPU kernel writes straight into `out` when it is a contiguous block of image
    rows, so a tile needs no freshly allocated result and no copy; otherwise (and in the other modes)
    the tile is computed apart and copied in.
    """
    writes_out = mode == "aot"
    runners = [_runner(StageVariant(stage, options.restricted(stage.reads), index == len(stages) - 1), mode)
               for index, stage in enumerate(stages)]

    def call(rows: torch.Tensor, cols: torch.Tensor, tensors, out: torch.Tensor) -> None:
        n_rows, n_cols = len(rows), len(cols)
        if mode != "eager":
            rows, cols = _at_least_two(rows), _at_least_two(cols)
        leading = (rows, cols)
        for runner in runners[:-1]:
            leading = (runner(leading, tensors),)
        if not writes_out:
            out.copy_(runners[-1](leading, tensors)[:n_rows, :n_cols])
            return
        direct = out.device.type == "cpu" and out.is_contiguous() and (len(rows), len(cols)) == (n_rows, n_cols)
        target = out if direct else out.new_empty((len(rows), len(cols)))
        runners[-1]((target, *leading), tensors)
        if target is not out:
            out.copy_(target[:n_rows, :n_cols])

    return call


def _runner(variant: StageVariant, mode: str):
    if mode == "eager":
        return lambda leading, tensors: variant.stage.function(*leading, tensors, options=variant.options)
    if mode == "jit":
        return _jit(variant.stage, variant.options)
    return _aot(variant)


def _at_least_two(index: torch.Tensor) -> torch.Tensor:
    """Compiled kernels take at least two rows/columns (a traced size of 1 would be specialised); a
    single one is repeated and the extra output cut off again."""
    return index if len(index) >= 2 else index.repeat(2)


def _leading_dims(stage: Stage, options: KernelOptions) -> list[dict[int, str]]:
    """{dimension: size name} of each flattened leading input of a stage (PixelTerms are pixels-last)."""
    if stage.after is None:
        return [{0: ROWS}, {0: COLS}]
    return [{1: SUBSTEPS, 2: ORIENTATIONS, 3: ROWS, 4: COLS}, {0: SUBSTEPS, 1: ROWS, 2: COLS}, {0: ROWS, 1: COLS},
            {0: SUBSTEPS, 1: SOURCES, 2: ROWS, 3: COLS} if options.use_dmin else {}]


@functools.cache
def _jit(stage: Stage, options: KernelOptions):
    """torch.compile of one stage with every count dynamic (tile rows and columns, sub-steps, sources,
    orientations, table length).

    Python floats in the kernel are constants (physics parameters arrive as tensors), so Dynamo
    specialises on them instead of re-tracing to turn them into tensors; duck shaping is off so equal
    counts are not tied together, and sizes are size-oblivious so a count of 1 is not specialised.
    """
    compiled = torch.compile(functools.partial(stage.function, options=options), dynamic=False,
                             options=dict(stage.inductor_options))
    dims = _leading_dims(stage, options) + input_dims(stage.single_step)

    def call(leading: tuple, tensors):
        flat = tree_flatten(leading)[0] + tree_flatten(tensors)[0]
        for tensor, named in zip(flat, dims, strict=True):
            for dim in named:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        with _dynamic_shape_config(), torch._dynamo.config.patch(specialize_float=True):
            return compiled(*leading, tensors)

    return call


@contextlib.contextmanager
def _dynamic_shape_config() -> Iterator[None]:
    """Symbolic sizes that may be 1 without a guard, and no duck shaping."""
    with torch.fx.experimental._config.patch(use_duck_shape=False, backed_size_oblivious=True):
        yield


@functools.cache
def _aot(variant: StageVariant) -> AotStage:
    return AotStage(variant)


class _Exported(torch.nn.Module):
    """A stage with flat tensor inputs, as torch.export needs."""

    def __init__(self, function: Callable, options: KernelOptions, leading_spec, tensors_spec):
        super().__init__()
        self.function, self.options = function, options
        self.leading_spec, self.tensors_spec = leading_spec, tensors_spec
        self.leading_count = leading_spec.num_leaves

    def forward(self, *flat):
        leading = tree_unflatten(list(flat[:self.leading_count]), self.leading_spec)
        tensors = tree_unflatten(list(flat[self.leading_count:]), self.tensors_spec)
        result = self.function(*leading, tensors, options=self.options)
        return () if result is None else tuple(result) if isinstance(result, tuple) else result


def _write_into(function: Callable, out: torch.Tensor, *arguments, **keywords) -> None:
    """The stage function writing its value into `out` (what an ahead-of-time package runs)."""
    out.copy_(function(*arguments, **keywords))


class AotStage:
    """Runs one stage variant's AOTInductor package, loaded (or built once, under a file lock) per
    dtype and device on first use."""

    def __init__(self, variant: StageVariant):
        self.variant = variant
        self._runners: dict[tuple, object] = {}

    def __call__(self, leading: tuple, tensors):
        flat_leading = tree_flatten(leading)[0]
        flat_tensors = tree_flatten(tensors)[0]
        device = flat_tensors[0].device
        dtype = tensors.origins.dtype
        runner = self._runners.get((dtype, device))
        if runner is None:
            runner = self._runners[dtype, device] = load_package(self.variant, dtype, device)
        outputs = runner.run([*flat_leading, *flat_tensors])
        if self.variant.writes_out:
            return None
        output = self.variant.stage.output
        return output(*outputs) if output is not None else outputs[0]


def load_package(variant: StageVariant, dtype: torch.dtype, device: torch.device):
    """The variant's package runner, built first if the cache does not hold it."""
    ensure_package(variant, dtype, device)
    return open_package(variant.package(dtype, device), device)


@functools.cache
def open_package(package: Path, device: torch.device):
    """The runner of an ahead-of-time package file on `device` (its `run` takes the flat inputs), opened
    once per process (a package's name is its content's key), and kept: the resident worker opens the
    cached ones before it forks a command's process (nbsim.cli.worker)."""
    device_index = device.index if device.type == "cuda" and device.index is not None else -1
    return torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, device_index)


def ensure_package(variant: StageVariant, dtype: torch.dtype, device: torch.device) -> bool:
    """Build the variant's package unless it is cached (one process builds, others wait on its lock);
    True when this call built it."""
    package = variant.package(dtype, device)
    package.parent.mkdir(parents=True, exist_ok=True)
    with locked(package.with_suffix(".lock")):
        if package.is_file():
            CACHE_EVENTS["aot_hit"] += 1
            return False
        CACHE_EVENTS["aot_miss"] += 1
        started = time.perf_counter()
        _build(variant, dtype, device, package)
        description = {**variant.description(dtype, device), "build_s": round(time.perf_counter() - started, 2),
                       "built": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        _write_atomically(package.with_suffix(".json"), json.dumps(description, indent=1))
        return True


def ensure_packages(variants: list[StageVariant], dtype: torch.dtype,
                    device: torch.device) -> Iterator[tuple[StageVariant, bool, float]]:
    """ensure_package for each variant in turn: (variant, whether it was built now, seconds taken)."""
    for variant in variants:
        started = time.perf_counter()
        built = ensure_package(variant, dtype, device)
        yield variant, built, time.perf_counter() - started


def _example_leading(stage: Stage, options: KernelOptions, tensors) -> tuple:
    """Leading inputs of EXAMPLE_SIZES for tracing a stage: rows and columns, or what the stage before
    it returns for them (run eagerly)."""
    dtype, device = tensors.origins.dtype, tensors.origins.device
    rows = torch.arange(EXAMPLE_SIZES[ROWS], dtype=dtype, device=device)
    cols = torch.arange(EXAMPLE_SIZES[COLS], dtype=dtype, device=device)
    if stage.after is None:
        return rows, cols
    return (stage.after.function(rows, cols, tensors, options=options),)


def _build(variant: StageVariant, dtype: torch.dtype, device: torch.device, package: Path) -> None:
    from torch._inductor import aoti_compile_and_package

    stage, options = variant.stage, variant.options
    tensors = example_tensors(dtype, device, stage.single_step)
    leading = _example_leading(stage, options, tensors)
    dims = _leading_dims(stage, options)
    function = stage.function
    if variant.writes_out:
        out = stage.function(*leading, tensors, options=options)
        leading, dims = (torch.empty_like(out), *leading), [{0: ROWS, 1: COLS}, *dims]
        function = functools.partial(_write_into, stage.function)
    flat_leading, leading_spec = tree_flatten(leading)
    flat_tensors, tensors_spec = tree_flatten(tensors)
    named = {name: torch.export.Dim(name, min=2, max=MAX_PIXELS_PER_SIDE) for name in (ROWS, COLS)}
    named |= {name: torch.export.Dim(name, min=1, max=MAX_COUNT) for name in EXAMPLE_SIZES if name not in named}
    dynamic = tuple({dim: named[name] for dim, name in d.items()} or None for d in dims + input_dims(stage.single_step))
    module = _Exported(function, options, leading_spec, tensors_spec)
    with _dynamic_shape_config():
        exported = torch.export.export(module, (*flat_leading, *flat_tensors), dynamic_shapes=(dynamic,),
                                       strict=False)
    partial = package.with_name(f"{package.stem}.partial-{os.getpid()}.pt2")
    inductor_options = (ONE_LOOP if stage.one_loop else stage.inductor_options) + CONTRACTED
    with warnings.catch_warnings(), _vectors_per_iteration(stage.vectors_for(options, device), dtype), \
            _tile_shaped_loops(stage.one_loop):
        # PyTorch's own packaging code trips its LeafSpec deprecation; nothing for a user to act on.
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        aoti_compile_and_package(exported, package_path=str(partial), inductor_configs=dict(inductor_options))
    os.replace(partial, package)


@contextlib.contextmanager
def _vectors_per_iteration(vectors: int, dtype: torch.dtype) -> Iterator[None]:
    """Inductor's CPU loops step over `vectors` SIMD vectors of `dtype` per iteration instead of one.

    A fused stage computes one long chain of dependent operations per pixel. With one vector per loop
    iteration an out-of-order core finds too little independent work in its window and waits on
    latencies; with several, Inductor emits each operation for all of them side by side (its
    VectorizedN), which fills those waits. Inductor has no option for this: its loops step by the
    vector ISA's float lane count, so that count is scaled while the stage compiles, with Inductor's own
    graph cache off (its key does not see the scaled count). No vector ISA, no change.
    """
    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa

    isa = cpu_vec_isa.pick_vec_isa()
    if vectors <= 1 or not isa:
        yield
        return
    lanes = isa.bit_width() // (8 * dtype.itemsize)
    scale = max(1, vectors * lanes // isa.nelements(torch.float))
    unscaled = cpu_vec_isa.VecISA.nelements

    def scaled(self, dtype: torch.dtype = torch.float) -> int:
        return unscaled(self, dtype) * scale

    with unittest.mock.patch.object(cpu_vec_isa.VecISA, "nelements", scaled), \
            inductor_config.patch(fx_graph_cache=False):
        yield


@contextlib.contextmanager
def _tile_shaped_loops(enabled: bool) -> Iterator[None]:
    """While enabled, Inductor keeps each loop's dimensions (dropping only those of size 1) instead of
    merging contiguous ones.

    A materialised value computed only from other per-pixel values would otherwise loop over
    rows × columns as one dimension, and Inductor's CPU backend cannot fuse such a loop into the
    two-dimensional ones around it once it has joined another: the kernel then writes those values to
    memory and reads them back in separate loops. Inductor has no option for this, so its loop
    simplification is replaced while the stage compiles, with its graph cache off (its key does not see
    the replacement).
    """
    if not enabled:
        yield
        return
    import sympy
    from torch._inductor import config as inductor_config
    from torch._inductor.sizevars import SizeVarAllocator

    def unmerged(self, index_vars, sizes, index_formulas):
        sizes = [self.simplify(size) for size in sizes]
        kept = [size != 1 for size in sizes]

        def reindex(index):
            remaining = iter(index)
            return [next(remaining) if keep else sympy.S.Zero for keep in kept]

        def prune(index):
            return [var for var, keep in zip(index, kept, strict=True) if keep]

        return [size for size, keep in zip(sizes, kept, strict=True) if keep], reindex, prune

    with unittest.mock.patch.object(SizeVarAllocator, "_simplify_loops_impl", unmerged), \
            inductor_config.patch(fx_graph_cache=False):
        yield


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)


@contextlib.contextmanager
def locked(path: Path, blocking: bool = True) -> Iterator[bool]:
    """An exclusive lock on `path` for the block; with blocking=False, yields False at once when another
    process holds it."""
    with open(path, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cached_descriptions() -> list[dict]:
    """The descriptions of every package in the cache (newest first)."""
    folder = kernels_dir()
    descriptions = []
    for path in sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        if path.with_suffix(".pt2").is_file():
            with contextlib.suppress(OSError, ValueError):
                descriptions.append({**json.loads(path.read_text()), "package": path.with_suffix(".pt2").name})
    return descriptions


def runs_here(description: dict) -> bool:
    """Was a cached package built for this nbsim, PyTorch, kernel source and processor?"""
    return all(description.get(key) == value for key, value in _build_environment().items())


def _build_environment() -> dict[str, str]:
    """What every package of this installation and machine depends on: versions, kernel source, processor."""
    from .. import __version__

    return {"nbsim": __version__, "torch": torch.__version__, "source": _source_digest(),
            "machine": platform.machine(), "isa": cpu_flags()}


@functools.cache
def _source_digest() -> str:
    folder = Path(__file__).parent
    digest = hashlib.sha256()
    for name in _SOURCES:
        digest.update((folder / name).read_bytes())
    return digest.hexdigest()
