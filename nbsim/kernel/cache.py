"""The on-disk kernel cache (`KernelCache`): where ahead-of-time packages live, their keys and
descriptions, which of them run on this installation and machine, the locks that let one process build
a package while others wait, what a cache object has loaded and built, and the command of the child
processes that probe a package or warm the just-in-time path (`child_command`).

A package's key is the SHA-256 of its description: the build environment (nbsim and PyTorch versions,
the digest of every source file a compiled kernel's code comes from, the machine and its instruction
set) and the stage variant's identity (stage, the options it reads, whether it writes into the image,
dtype, device). It never holds a count, a shape or a value.

Beside each package, a probe stamp per machine and installation (`probe_environment`) records whether the
package opened and ran in a probe process there (nbsim.kernel.aot.verify_package): a package that crashes
PyTorch's loader on one machine is then opened on no other process of that machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import platform
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..cache import cache_dir
from ..cpu import cpu_flags
from ..devices import dtype_name
from ..io.atomic import atomic_write_text
from ..modes import Mode
from .stages import StageVariant, Structure

JIT_AFTER_REFUSAL = "jit (aot refused)"
AOT_AND_JIT_AFTER_REFUSAL = "aot+jit (aot refused)"
"""Kernel paths (`KernelLoads.path`) of ahead-of-time renders whose packages this machine refused, all or some."""
CHILD_CODE = ("import sys, importlib; del sys.path[0]; sys.path.append(sys.argv.pop(1)); "
              "sys.exit(importlib.import_module(sys.argv.pop(1)).main())")
"""The program of a child process that runs `main()` of one of this nbsim's modules (the folder holding
this nbsim goes last on its path, and the working folder, which may hold another clone named nbsim,
comes off it)."""


KERNEL_SOURCES = ("physics.py", "inputs.py", "stages.py", "aot.py", "inductor_patches.py",
                  "../model/structure_factors.py")
"""Every file whose code an ahead-of-time package is built from (relative to nbsim/kernel)."""


@dataclass
class KernelLoads:
    """How the compiled kernels a renderer ran were obtained: packages opened from the disk cache,
    built now, or already open in this process."""

    opened: int = 0
    built: int = 0
    reused: int = 0
    unusable: list[str] = field(default_factory=list)
    """A warning line for each package that cannot be used on this machine (its stage ran just in time)."""
    ran: int = 0
    """Stages that ran from an ahead-of-time package (opened, built or already open)."""

    def path(self, mode: Mode) -> str:
        """What ran for a renderer in `mode`: the mode's value, except where this machine refused packages
        of an ahead-of-time render, whose stages then ran just in time: `JIT_AFTER_REFUSAL`, or
        `AOT_AND_JIT_AFTER_REFUSAL` where other stages ran from packages."""
        if mode is not Mode.AOT or not self.unusable:
            return mode.value
        return AOT_AND_JIT_AFTER_REFUSAL if self.ran else JIT_AFTER_REFUSAL


class KernelCache:
    """The packages in `folder`/kernels (`folder` is NBSIM_CACHE_DIR's role), with the packages this
    object has opened kept in memory; `builds` counts the packages it built (whoever asked)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.kernels = self.folder / "kernels"
        self.builds = 0
        """Packages this process built into the cache."""
        self.open_packages: dict[tuple[Path, torch.device], object] = {}
        """Package runners opened from this cache, by package path and device."""

    @staticmethod
    def default() -> KernelCache:
        """The cache in NBSIM_CACHE_DIR (else ~/.cache/nbsim): one object per folder and process, so a
        package opened by one renderer stays open for the next."""
        return _cache_in(cache_dir().expanduser().resolve())

    def __repr__(self) -> str:
        return f"KernelCache({str(self.folder)!r})"

    def description(self, variant: StageVariant, dtype: torch.dtype, device: torch.device) -> dict:
        """Everything the variant's compiled code depends on, and nothing else: its cache key's content."""
        return {**build_environment(), **variant.identity(dtype, device)}

    def key(self, variant: StageVariant, dtype: torch.dtype, device: torch.device) -> str:
        """The package's file name stem: a digest of what the kernel depends on (`description`)."""
        text = json.dumps(self.description(variant, dtype, device), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def package(self, variant: StageVariant, dtype: torch.dtype, device: torch.device) -> Path:
        """Where the package of a stage variant, dtype and device is kept."""
        return self.kernels / f"{self.key(variant, dtype, device)}.pt2"

    def missing(self, structure: Structure, dtype: torch.dtype, device: torch.device) -> list[StageVariant]:
        """The ahead-of-time packages of a structure that the cache does not hold yet."""
        return [v for v in structure.stage_variants() if not self.package(v, dtype, device).is_file()]

    def record_build(self, variant: StageVariant, dtype: torch.dtype, device: torch.device, build_s: float,
                     built: str) -> None:
        """Write the description of a package just built (with its build time and date) beside it."""
        description = {**self.description(variant, dtype, device), "build_s": round(build_s, 2), "built": built}
        atomic_write_text(self.package(variant, dtype, device).with_suffix(".json"), json.dumps(description, indent=1))

    def probe_stamp(self, package: Path) -> Path:
        """Where the verdict of `package`'s probe on this machine and installation is kept: beside it, named
        by a digest of probe_environment(), so that machines sharing a cache folder keep one each."""
        digest = hashlib.sha256(json.dumps(probe_environment(), sort_keys=True).encode()).hexdigest()[:16]
        return package.with_name(f"{package.stem}.{digest}.probe.json")

    def verdict(self, package: Path) -> dict | None:
        """The verdict of `package`'s probe here ("usable", and "failure": why not), or None when no probe
        on this machine and installation has given one."""
        try:
            stamp = json.loads(self.probe_stamp(package).read_text())
        except (OSError, ValueError):
            return None
        return stamp if all(stamp.get(key) == value for key, value in probe_environment().items()) else None

    def record_verdict(self, package: Path, usable: bool, failure: str, probe_s: float) -> dict:
        """Stamp `package` as usable here or not (with why not, and the probe's seconds); the verdict."""
        verdict = {**probe_environment(), "usable": usable, "failure": failure, "probe_s": round(probe_s, 2),
                   "probed": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        atomic_write_text(self.probe_stamp(package), json.dumps(verdict, indent=1))
        return verdict

    def descriptions(self) -> list[dict]:
        """The descriptions of every package in the cache (newest first)."""
        descriptions = []
        for path in sorted(self.kernels.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True):
            if path.with_suffix(".pt2").is_file():
                with contextlib.suppress(OSError, ValueError):
                    descriptions.append({**json.loads(path.read_text()), "package": path.with_suffix(".pt2").name})
        return descriptions

    def past_build_times_s(self) -> list[float]:
        """Seconds each cached package took to build."""
        return [d["build_s"] for d in self.descriptions() if "build_s" in d]

    def structure_lock(self, structure: Structure, dtype: torch.dtype, device: torch.device) -> Path:
        """The lock file a builder of a whole structure holds (so that one builds it at a time)."""
        name = hashlib.sha256(f"{structure.to_json()}{dtype_name(dtype)}{device}".encode())
        return self.kernels / f"build-{name.hexdigest()[:16]}.lock"


def child_command(module: str, spec: dict) -> list[str]:
    """The command of a child process that runs `module`'s main() with `spec` (JSON) as its argument."""
    return [sys.executable, "-c", CHILD_CODE, str(Path(__file__).resolve().parents[2]), module, json.dumps(spec)]


@functools.cache
def _cache_in(folder: Path) -> KernelCache:
    return KernelCache(folder)


def runs_here(description: dict) -> bool:
    """Was a cached package built for this nbsim, PyTorch, kernel source and processor?"""
    return all(description.get(key) == value for key, value in build_environment().items())


def build_environment() -> dict[str, str]:
    """What every package of this installation and machine depends on: versions, kernel source, processor."""
    from .. import __version__

    return {"nbsim": __version__, "torch": torch.__version__, "source": source_digest(),
            "machine": platform.machine(), "isa": cpu_flags()}


def probe_environment() -> dict[str, str]:
    """What a probe's verdict on a package holds for: the build environment, the host and Python (a
    package that opens on one machine crashed PyTorch's loader on others with the same processor
    extensions, docs/benchmarks.md)."""
    return {**build_environment(), "host": platform.node(), "python": platform.python_version()}


@functools.cache
def source_digest() -> str:
    """SHA-256 of KERNEL_SOURCES."""
    folder = Path(__file__).parent
    digest = hashlib.sha256()
    for name in KERNEL_SOURCES:
        digest.update((folder / name).read_bytes())
    return digest.hexdigest()


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
