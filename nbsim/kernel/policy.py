"""When compiling pays: the `auto` compile mode, and kernels built in the background for later runs.

`-compile on` always runs the compiled kernel (building it first if needed) and `off` always runs
eagerly. `auto` (the default) runs the compiled kernel when its structure is already compiled. When it
is not, the renderer times the eager kernel on a small probe of the image (at most about a million
pixel-steps, a fraction of a second), extrapolates the eager render time, and compiles first only
when the estimated build time plus the compiled render is shorter than rendering eagerly. Otherwise
it renders eagerly and, for ahead-of-time kernels, starts one detached `nbsim kernels build` process
(niced, one per structure at a time) so that the next run of that structure loads a compiled kernel.
NBSIM_BACKGROUND_BUILD=off turns the background build off.
"""

from __future__ import annotations

import functools
import hashlib
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field

import torch

from ..devices import dtype_name
from .backends import StageVariant, Structure, cached_descriptions, kernels_dir, locked, missing_packages
from .modes import choose_mode

COMPILE_CHOICES = ("auto", "on", "off")
COMPILED_SPEEDUP = 10.0
"""How much faster than eager a compiled render is assumed to be (measured: 15-70× on the CPU)."""
DEFAULT_BUILD_S = {"aot": 40.0, "jit": 20.0}
"""Build time assumed per stage before this machine has built one (aot measured 30-42 s on 2 cores)."""
PROBE_PIXEL_STEPS = 1 << 20


@dataclass
class CompilePlan:
    """How a renderer runs: the mode it uses now and, in `auto` mode, the compiled mode it may switch to
    once the eager probe has been timed."""

    mode: str
    structure: Structure
    dtype: torch.dtype
    device: torch.device
    pending: str | None = None
    missing: list[StageVariant] = field(default_factory=list)
    note: str = ""
    """What `auto` decided and why, for the command line's summary."""

    @functools.cached_property
    def estimated_build_s(self) -> float:
        """Seconds to build what is missing: this machine's past builds when it has any, else a default
        (read from the cache once per plan)."""
        if self.pending == "jit":
            return DEFAULT_BUILD_S["jit"] * len(self.structure.stage_variants())
        past = [d["build_s"] for d in cached_descriptions() if "build_s" in d]
        per_stage = statistics.median(past) if past else DEFAULT_BUILD_S["aot"]
        return per_stage * len(self.missing)

    def compile_pays(self, eager_estimate_s: float) -> bool:
        """Does building, then rendering compiled, beat rendering eagerly?"""
        return eager_estimate_s > self.estimated_build_s + eager_estimate_s / COMPILED_SPEEDUP


def plan_compile(compile: bool | str, device: torch.device, dtype: torch.dtype, needs_grad: bool,
                 structure: Structure) -> CompilePlan:
    """The mode for `compile` (True/"on", False/"off" or "auto"); see the module docstring."""
    choice = {True: "on", False: "off"}.get(compile, compile)
    if choice not in COMPILE_CHOICES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_CHOICES)} (got {compile!r})")
    compiled = choose_mode(True, device.type, needs_grad)
    if choice == "off":
        return CompilePlan("eager", structure, dtype, device)
    if choice == "on":
        return CompilePlan(compiled, structure, dtype, device)
    missing = missing_packages(structure, dtype, device) if compiled == "aot" else []
    if compiled == "aot" and not missing:
        return CompilePlan("aot", structure, dtype, device)
    return CompilePlan("eager", structure, dtype, device, pending=compiled, missing=missing)


def start_background_build(plan: CompilePlan) -> bool:
    """Start building the plan's missing ahead-of-time kernels in a detached process (unless one is
    already building this structure, or NBSIM_BACKGROUND_BUILD=off); True when one was started."""
    if plan.pending != "aot" or not plan.missing or os.environ.get("NBSIM_BACKGROUND_BUILD", "on") == "off":
        return False
    folder = kernels_dir()
    folder.mkdir(parents=True, exist_ok=True)
    structure = plan.structure.to_json()
    dtype = dtype_name(plan.dtype)
    name = hashlib.sha256(f"{structure}{dtype}{plan.device}".encode()).hexdigest()[:16]
    lock = folder / f"build-{name}.lock"
    with locked(lock, blocking=False) as free:
        if not free:
            return False
    command = [sys.executable, "-m", "nbsim.cli", "kernels", "build", "--structure", structure, "--dtype", dtype,
               "--device", str(plan.device), "--lock", str(lock)]
    with open(folder / "background-build.log", "a") as log:
        subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True, env={**os.environ, "NBSIM_CACHE_DIR": str(folder.parent)},
                         preexec_fn=lambda: os.nice(10))
    return True
