"""Ahead-of-time kernels: a stage variant exported (`torch.export`) and compiled by AOTInductor into a
package of the kernel cache, then opened by PyTorch's C++ runner, so a new process starts the kernel in
a fraction of a second. Inference only.

Inductor keeps intermediate files in its own cache folder (TORCHINDUCTOR_CACHE_DIR, read from the
environment by Inductor itself on every use, and set by it when missing). This library never sets it:
Inductor reads that variable afresh in many private places, so no single setting or function can be
pointed elsewhere for one build, and editing the environment from a library would change every other
user of Inductor in the process. Processes that nbsim starts (`nbsim`'s commands, the kernel builder,
the sweep's jobs) point it into nbsim's cache folder at their start (nbsim.cache.configure_compile_cache).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .cache import KernelCache, KernelLoads, locked, runs_here
from .inductor_patches import contracted_options, masked_tails, tile_shaped_loops, vectors_per_iteration
from .inputs import COLS, EXAMPLE_SIZES, ROWS, KernelOptions, example_tensors, input_dims
from .stages import ONE_LOOP, Stage, StageVariant, dynamic_shape_config

MAX_PIXELS_PER_SIDE = 1 << 20
MAX_COUNT = 1 << 24


class AotStage:
    """Runs one stage variant's package, opened (or built first) on first use, for a renderer whose
    `loads` it counts."""

    def __init__(self, variant: StageVariant, cache: KernelCache, loads: KernelLoads):
        self.variant, self.cache, self.loads = variant, cache, loads
        self._runner = None

    def __call__(self, leading: tuple, tensors):
        flat_leading = tree_flatten(leading)[0]
        flat_tensors = tree_flatten(tensors)[0]
        if self._runner is None:
            self._runner = load_package(self.cache, self.variant, tensors.origins.dtype, flat_tensors[0].device,
                                        self.loads)
        outputs = self._runner.run([*flat_leading, *flat_tensors])
        if self.variant.writes_out:
            return None
        output = self.variant.stage.output
        return output(*outputs) if output is not None else outputs[0]


class PackageRunner(Protocol):
    """An opened ahead-of-time package (PyTorch's AOTIModelPackageLoader)."""

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The package's outputs for its flattened inputs."""


def load_package(cache: KernelCache, variant: StageVariant, dtype: torch.dtype, device: torch.device,
                 loads: KernelLoads) -> PackageRunner:
    """The variant's package runner: already open in `cache`, else opened from disk, built first if the
    cache does not hold it (counted in `loads`)."""
    package = cache.package(variant, dtype, device)
    runner = cache.open_packages.get((package, device))
    if runner is not None:
        loads.reused += 1
        return runner
    if ensure_package(cache, variant, dtype, device):
        loads.built += 1
    else:
        loads.opened += 1
    runner = cache.open_packages[package, device] = open_package(package, device)
    return runner


def open_package(package: Path, device: torch.device) -> PackageRunner:
    """The runner of an ahead-of-time package file on `device` (its `run` takes the flat inputs)."""
    device_index = device.index if device.type == "cuda" and device.index is not None else -1
    return torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, device_index)


def open_cached_packages(cache: KernelCache, device: torch.device) -> None:
    """Open, in `cache`, every package it holds for `device` that was built for this installation (the
    resident worker does this before it forks a command's process). One that fails to open is left to
    the render that needs it, which reports the error."""
    for description in cache.descriptions():
        package = cache.kernels / description["package"]
        if (description.get("device") == device.type and runs_here(description)
                and (package, device) not in cache.open_packages):
            with contextlib.suppress(RuntimeError):
                cache.open_packages[package, device] = open_package(package, device)


def ensure_package(cache: KernelCache, variant: StageVariant, dtype: torch.dtype, device: torch.device) -> bool:
    """Build the variant's package unless the cache holds it (one process builds, others wait on its
    lock); True when this call built it."""
    package = cache.package(variant, dtype, device)
    package.parent.mkdir(parents=True, exist_ok=True)
    with locked(package.with_suffix(".lock")):
        if package.is_file():
            return False
        started = time.perf_counter()
        build_package(variant, dtype, device, package)
        cache.builds += 1
        cache.record_build(variant, dtype, device, time.perf_counter() - started, time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        return True


def ensure_packages(cache: KernelCache, variants: list[StageVariant], dtype: torch.dtype,
                    device: torch.device) -> Iterator[tuple[StageVariant, bool, float]]:
    """ensure_package for each variant in turn: (variant, whether it was built now, seconds taken)."""
    for variant in variants:
        started = time.perf_counter()
        built = ensure_package(cache, variant, dtype, device)
        yield variant, built, time.perf_counter() - started


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
    """The stage function writing its value into `out` (what a package that writes out runs)."""
    out.copy_(function(*arguments, **keywords))


def _example_leading(stage: Stage, options: KernelOptions, tensors) -> tuple:
    """Leading inputs of EXAMPLE_SIZES for tracing a stage: rows and columns, or what the stage before
    it returns for them (run eagerly)."""
    dtype, device = tensors.origins.dtype, tensors.origins.device
    rows = torch.arange(EXAMPLE_SIZES[ROWS], dtype=dtype, device=device)
    cols = torch.arange(EXAMPLE_SIZES[COLS], dtype=dtype, device=device)
    if stage.after is None:
        return rows, cols
    return (stage.after.function(rows, cols, tensors, options=options),)


def build_package(variant: StageVariant, dtype: torch.dtype, device: torch.device, package: Path) -> None:
    """Export the variant with every count dynamic and compile it into `package` (written whole or not at all)."""
    from torch._inductor import aoti_compile_and_package

    stage, options = variant.stage, variant.options
    tensors = example_tensors(dtype, device, stage.single_step)
    leading = _example_leading(stage, options, tensors)
    dims = stage.leading_dims(options)
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
    with dynamic_shape_config():
        exported = torch.export.export(module, (*flat_leading, *flat_tensors), dynamic_shapes=(dynamic,),
                                       strict=False)
    partial = package.with_name(f"{package.stem}.partial-{os.getpid()}.pt2")
    inductor_options = (ONE_LOOP if stage.one_loop else stage.inductor_options) + contracted_options()
    with warnings.catch_warnings(), vectors_per_iteration(stage.vectors_for(options, device), dtype), \
            tile_shaped_loops(stage.one_loop), masked_tails():
        # PyTorch's own packaging code trips its LeafSpec deprecation; nothing for a user to act on.
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        aoti_compile_and_package(exported, package_path=str(partial), inductor_configs=dict(inductor_options))
    os.replace(partial, package)
