"""Ahead-of-time kernels: a stage variant exported (`torch.export`) and compiled by AOTInductor into a
package of the kernel cache, then opened by PyTorch's C++ runner, so a new process starts the kernel in
a fraction of a second. Inference only.

Inductor keeps intermediate files in its own cache folder (TORCHINDUCTOR_CACHE_DIR, read from the
environment by Inductor itself on every use, and set by it when missing). This library never sets it:
Inductor reads that variable afresh in many private places, so no single setting or function can be
pointed elsewhere for one build, and editing the environment from a library would change every other
user of Inductor in the process. Processes that nbsim starts (`nbsim`'s commands, the kernel builder,
the sweep's jobs) point it into nbsim's cache folder at their start (nbsim.cache.configure_compile_cache).

Opening a package loads its compiled code into the process, and on some machines that crashed the
whole process (SIGSEGV inside PyTorch's loader, docs/benchmarks.md), which no Python code can catch. So a
package is first opened and run once in a short probe process (nbsim.kernel.probe), once per machine and
installation (the verdict is stamped beside it, nbsim.kernel.cache); one that crashes or fails there is
not opened, and its stage runs just in time instead (`verify_package`; NBSIM_VERIFY_PACKAGES=off skips the
probe).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import subprocess
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..devices import dtype_name
from ..errors import signal_name
from .cache import KernelCache, KernelLoads, child_command, locked, runs_here
from .inductor_patches import contracted_options, masked_tails, thread_options, tile_shaped_loops, vectors_per_iteration
from .inputs import COLS, EXAMPLE_SIZES, ROWS, KernelOptions, example_tensors, input_dims
from .stages import ONE_LOOP, Stage, StageVariant, dynamic_shape_config

MAX_PIXELS_PER_SIDE = 1 << 20
MAX_COUNT = 1 << 24
VERIFY_PACKAGES = "NBSIM_VERIFY_PACKAGES"
"""Environment variable: `off` opens packages without probing them first (`verify_package`)."""
PROBE_TIMEOUT_S = 120.0
"""How long a probe process may take (its Python and PyTorch start included: seconds on a busy machine)."""
OPENING, OPENED, RAN = "opening", "opened", "ran"
"""What a probe process prints before opening the package, once it is open, and once it has run."""


class AotStage:
    """Runs one stage variant's package, opened (or built first) on first use, for a renderer whose
    `loads` it counts; where the package cannot be used on this machine, runs `fallback(variant)` instead
    (a callable taking the stage's leading inputs and tensors, such as nbsim.kernel.jit.jit_stage's)."""

    def __init__(self, variant: StageVariant, cache: KernelCache, loads: KernelLoads,
                 fallback: Callable[[StageVariant], Callable]):
        self.variant, self.cache, self.loads, self.fallback = variant, cache, loads, fallback
        self._runner = None
        self._instead: Callable | None = None

    def __call__(self, leading: tuple, tensors):
        flat_leading = tree_flatten(leading)[0]
        flat_tensors = tree_flatten(tensors)[0]
        if self._runner is None and self._instead is None:
            self._runner = load_package(self.cache, self.variant, tensors.origins.dtype, flat_tensors[0].device,
                                        self.loads)
            if self._runner is None:
                self._instead = self.fallback(self.variant)
        if self._instead is not None:
            if not self.variant.writes_out:
                return self._instead(leading, tensors)
            out, *rest = leading
            out.copy_(self._instead(tuple(rest), tensors))
            return None
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
                 loads: KernelLoads) -> PackageRunner | None:
    """The variant's package runner: already open in `cache`, else opened from disk, built first if the
    cache does not hold it (counted in `loads`) and verified first if this machine has not
    (`verify_package`). None where the package cannot be used here, with a warning line in `loads.unusable`."""
    package = cache.package(variant, dtype, device)
    runner = cache.open_packages.get((package, device))
    if runner is not None:
        loads.reused += 1
        loads.ran += 1
        return runner
    built = ensure_package(cache, variant, dtype, device)
    if built:
        loads.built += 1
    failure = verify_package(cache, package, variant, dtype, device)
    if failure is not None:
        loads.unusable.append(f"ahead-of-time kernel {package} ({variant.stage.name} {dtype_name(dtype)} "
                              f"{device.type}): {failure}; this stage runs with torch.compile instead")
        return None
    if not built:
        loads.opened += 1
    loads.ran += 1
    runner = cache.open_packages[package, device] = open_package(package, device)
    return runner


def verification_on() -> bool:
    """Are packages probed before a process opens them (NBSIM_VERIFY_PACKAGES, on unless `off`)?"""
    return os.environ.get(VERIFY_PACKAGES, "on").lower() != "off"


def verify_package(cache: KernelCache, package: Path, variant: StageVariant, dtype: torch.dtype,
                   device: torch.device) -> str | None:
    """None when this process may open `package`: it opened and ran in a probe process on this machine
    and installation (now, or before: the verdict is stamped beside it), or verification is off.
    Otherwise why not (the probe's signal or error). One process probes a package at a time (its lock)."""
    if not verification_on():
        return None
    verdict = cache.verdict(package)
    if verdict is None:
        with locked(package.with_suffix(".lock")):
            verdict = cache.verdict(package) or probe_package(cache, package, variant, dtype, device)
    return None if verdict["usable"] else verdict["failure"]


def probe_package(cache: KernelCache, package: Path, variant: StageVariant, dtype: torch.dtype,
                  device: torch.device) -> dict:
    """Open `package` and run it once in a probe process (nbsim.kernel.probe), and stamp the verdict. A probe
    that stops before it opens the package (a Python that cannot start, a timeout while importing) says
    nothing about the package: its verdict, unusable for now, is not stamped, so the next process probes again."""
    spec = {"package": str(package), "stage": variant.stage.name, "options": dataclasses.asdict(variant.options),
            "writes_out": variant.writes_out, "dtype": dtype_name(dtype), "device": str(device)}
    started = time.perf_counter()
    try:
        probe = subprocess.run(child_command("nbsim.kernel.probe", spec), stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        printed, status = probe.stdout.split(), probe.returncode
        error = (probe.stderr.strip().splitlines() or [""])[-1][:300]
    except subprocess.TimeoutExpired as timeout:
        output = timeout.stdout or b""
        output = output.decode(errors="replace") if isinstance(output, bytes) else output
        printed, status, error = output.split(), None, ""
    except OSError as not_started:
        return {"usable": False, "failure": f"no probe process could start ({not_started})"}
    probe_s = time.perf_counter() - started
    step = "closing it" if RAN in printed else "running it once" if OPENED in printed else "opening it"
    if OPENING not in printed:
        cause = f"timed out after {PROBE_TIMEOUT_S:.0f} s" if status is None else f"{_ending(status)}: {error}"
        return {"usable": False, "failure": f"the probe process stopped before opening it ({cause})"}
    if status == 0 and RAN in printed:
        return cache.record_verdict(package, True, "", probe_s)
    if status is None:
        failure = f"{step} did not finish within {PROBE_TIMEOUT_S:.0f} s in a probe process"
    elif status < 0:
        failure = f"{step} killed a probe process with {_ending(status)}"
    else:
        failure = f"{step} failed in a probe process ({error or _ending(status)})"
    return cache.record_verdict(package, False, failure, probe_s)


def _ending(status: int) -> str:
    """How a process with this return code ended: the signal's name (SIGSEGV) or its exit status."""
    return f"exit status {status}" if status >= 0 else signal_name(-status)


def open_package(package: Path, device: torch.device) -> PackageRunner:
    """The runner of an ahead-of-time package file on `device` (its `run` takes the flat inputs)."""
    device_index = device.index if device.type == "cuda" and device.index is not None else -1
    return torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, device_index)


def open_cached_packages(cache: KernelCache, device: torch.device) -> None:
    """Open, in `cache`, every package it holds for `device` that was built for this installation and,
    unless verification is off, found usable on this machine by a probe (the resident worker does this
    before it forks a command's process). One not probed yet, or that fails to open, is left to the render
    that needs it, which probes it first or reports the error; one found unusable is never opened."""
    for description in cache.descriptions():
        package = cache.kernels / description["package"]
        verdict = cache.verdict(package) if verification_on() else {"usable": True}
        if (description.get("device") == device.type and runs_here(description)
                and (package, device) not in cache.open_packages and verdict is not None and verdict["usable"]):
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


def example_leading(stage: Stage, options: KernelOptions, tensors, rows: int = EXAMPLE_SIZES[ROWS],
                    cols: int = EXAMPLE_SIZES[COLS]) -> tuple:
    """Leading inputs for tracing (or probing) a stage: `rows` and `cols` pixel indices, or what the stage
    before it returns for them (run eagerly)."""
    dtype, device = tensors.origins.dtype, tensors.origins.device
    rows = torch.arange(rows, dtype=dtype, device=device)
    cols = torch.arange(cols, dtype=dtype, device=device)
    if stage.after is None:
        return rows, cols
    return (stage.after.function(rows, cols, tensors, options=options),)


def build_package(variant: StageVariant, dtype: torch.dtype, device: torch.device, package: Path) -> None:
    """Export the variant with every count dynamic and compile it into `package` (written whole or not at all)."""
    from torch._inductor import aoti_compile_and_package

    stage, options = variant.stage, variant.options
    tensors = example_tensors(dtype, device, stage.single_step)
    leading = example_leading(stage, options, tensors)
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
    inductor_options = ((ONE_LOOP if stage.one_loop else stage.inductor_options) + contracted_options()
                        + thread_options())
    with warnings.catch_warnings(), vectors_per_iteration(stage.vectors_for(options, device), dtype), \
            tile_shaped_loops(stage.one_loop), masked_tails():
        # PyTorch's own packaging code trips its LeafSpec deprecation; nothing for a user to act on.
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        aoti_compile_and_package(exported, package_path=str(partial), inductor_configs=dict(inductor_options))
    os.replace(partial, package)
