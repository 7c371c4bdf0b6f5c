"""Building a structure's ahead-of-time kernels in a process of their own, for later runs.

    python -m nbsim.kernel.build --cache DIR --structure JSON --dtype float32 --device cpu [--lock PATH]

builds (or finds) every package of the structure in the kernel cache under DIR, at a lower priority
(the process nices itself), and, with --lock, only while it holds that lock (none at all when another
builder holds it). `start_background_build` starts it detached, one per structure at a time; nothing in
the library calls it on its own: `nbsim`'s render command does after an `auto` render left kernels
unbuilt, and Python callers may (`nbsim.simulate(..., background_build=True)`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import torch

from ..devices import dtype_name
from .cache import KernelCache, locked
from .stages import StageVariant, Structure

BUILD_NICENESS = 10
MODULE = "nbsim.kernel.build"


def start_background_build(cache: KernelCache, structure: Structure, dtype: torch.dtype,
                           device: torch.device) -> bool:
    """Start building the structure's packages in a detached, niced process (its output appended to
    `cache.kernels`/background-build.log) unless one is already building it; True when one was started."""
    cache.kernels.mkdir(parents=True, exist_ok=True)
    lock = cache.structure_lock(structure, dtype, device)
    with locked(lock, blocking=False) as free:
        if not free:
            return False
    command = [sys.executable, "-m", MODULE, "--cache", str(cache.folder), "--structure", structure.to_json(),
               "--dtype", dtype_name(dtype), "--device", str(device), "--lock", str(lock)]
    with open(cache.kernels / "background-build.log", "a") as log:
        subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
    return True


def build_line(variant: StageVariant, dtype: torch.dtype, device: torch.device, built: bool, seconds: float) -> str:
    """One line of a build's report: the stage, dtype, device, options, and built or found cached."""
    options = " ".join(f"{k}={v}" for k, v in variant.options.non_default().items()) or "(default options)"
    return (f"  {variant.stage.name} {dtype_name(dtype)} {device.type} {options}: "
            f"{f'built in {seconds:.1f} s' if built else 'cached'}")


def main(argv: list[str] | None = None) -> int:
    """The builder process (see the module docstring)."""
    from ..cache import configure_compile_cache
    from ..devices import resolve_device, resolve_dtype
    from .aot import ensure_packages

    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    parser.add_argument("--cache", required=True, type=Path, help="the nbsim cache folder (NBSIM_CACHE_DIR)")
    parser.add_argument("--structure", required=True, type=Structure.from_json, help="Structure.to_json()")
    parser.add_argument("--dtype", required=True, choices=("float32", "float64"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lock", type=Path, help="build only while holding this lock")
    options = parser.parse_args(argv)
    os.nice(BUILD_NICENESS)
    configure_compile_cache(options.cache)
    cache = KernelCache(options.cache)
    dtype, device = resolve_dtype(options.dtype), resolve_device(options.device)
    with locked(options.lock, blocking=False) if options.lock else contextlib.nullcontext(True) as free:
        if not free:
            return 0
        for variant, built, seconds in ensure_packages(cache, options.structure.stage_variants(), dtype, device):
            print(build_line(variant, dtype, device, built, seconds), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
