"""When compiling pays: the `auto` compile mode.

`Compile.ON` always runs the compiled kernel (building it first if needed) and `Compile.OFF` always runs
eagerly. `Compile.AUTO` (the default) runs the compiled kernel when its structure is already compiled.
When it is not, the plan is pending: the renderer times the eager kernel on a small probe of the image
(at most PROBE_PIXEL_STEPS pixel-steps, a fraction of a second), extrapolates the eager render time, and
`CompilePlan.decide` compiles first only when the estimated build time plus the compiled render is
shorter than rendering eagerly. Otherwise the render is eager and the decision lists the ahead-of-time
packages left unbuilt; building them for a later run (nbsim.kernel.build) is the caller's choice.

With gradients (any kernel input requiring grad) the render is eager in every mode, and the decision's
note says so: nbsim keeps no compiled backward (ahead-of-time packages are forward-only), and building
one just in time takes minutes per structure and then runs no faster than eager (docs/kernels.md has the
measurements). NBSIM_COMPILE_MODE=jit still compiles it, to measure it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from ..modes import Compile, Mode, choose_mode, compiled_gradients_forced
from .cache import KernelCache
from .stages import StageVariant, Structure

COMPILED_SPEEDUP = 10.0
"""How much faster than eager a compiled render is assumed to be (measured: 15-70× on the CPU)."""
DEFAULT_BUILD_S = {Mode.AOT: 40.0, Mode.JIT: 20.0}
"""Build time assumed per stage before this machine has built one (aot measured 30-42 s on 2 cores)."""
PROBE_PIXEL_STEPS = 1 << 20
GRADIENT_NOTE = ("gradients: eager render (a compiled backward is not offered: building it takes minutes and it "
                 "runs no faster than eager; see docs/kernels.md)")


@dataclass(frozen=True)
class CompileDecision:
    """The mode a renderer runs in, why (`note`, empty unless `auto` had to choose), and the
    ahead-of-time packages its structure lacks and that were not built (a later run may want them)."""

    mode: Mode
    note: str = ""
    unbuilt: tuple[StageVariant, ...] = ()


@dataclass(frozen=True)
class CompilePlan:
    """What a renderer's compile setting comes to before any render: the mode, or (`pending`, in `auto`
    mode with nothing cached) the compiled mode it may switch to once an eager probe is timed."""

    mode: Mode
    structure: Structure
    dtype: torch.dtype
    device: torch.device
    pending: Mode | None = None
    missing: tuple[StageVariant, ...] = ()
    estimated_build_s: float = 0.0
    """Seconds to build what is missing: this machine's past builds per stage when it has any, else a default."""
    note: str = ""
    """Why the mode is what it is, when that is not what the setting alone says."""

    def compile_pays(self, eager_estimate_s: float) -> bool:
        """Does building, then rendering compiled, beat rendering eagerly?"""
        return eager_estimate_s > self.estimated_build_s + eager_estimate_s / COMPILED_SPEEDUP

    def decide(self, eager_estimate_s: float | None = None) -> CompileDecision:
        """The mode to render in: the plan's own unless it is pending, else compiled when that pays
        given `eager_estimate_s` (the eager render's estimated seconds)."""
        if self.pending is None:
            return CompileDecision(self.mode, self.note)
        if eager_estimate_s is None:
            raise ValueError("a pending compile plan needs the eager render's estimated time")
        if self.compile_pays(eager_estimate_s):
            return CompileDecision(self.pending, f"compiling the kernel first (about {self.estimated_build_s:.0f} s) "
                                                 f"is quicker than an eager render (about {eager_estimate_s:.0f} s)")
        return CompileDecision(Mode.EAGER, f"kernel not compiled yet: eager render (about {eager_estimate_s:.1f} s) "
                                           f"is quicker than compiling first (about {self.estimated_build_s:.0f} s)",
                               unbuilt=self.missing)


def plan_compile(compile: Compile, device: torch.device, dtype: torch.dtype, needs_grad: bool,
                 structure: Structure, cache: KernelCache) -> CompilePlan:
    """The plan for `compile`; see the module docstring."""
    if not isinstance(compile, Compile):
        raise TypeError(f"plan_compile takes a Compile (Compile.of turns {compile!r} into one)")
    compiled = choose_mode(Compile.ON, device.type, needs_grad)
    if compile is Compile.OFF:
        return CompilePlan(Mode.EAGER, structure, dtype, device)
    if needs_grad and not compiled_gradients_forced():
        return CompilePlan(Mode.EAGER, structure, dtype, device, note=GRADIENT_NOTE)
    if compile is Compile.ON:
        return CompilePlan(compiled, structure, dtype, device)
    if compiled is Mode.JIT:
        estimate_s = DEFAULT_BUILD_S[Mode.JIT] * len(structure.stage_variants())
        return CompilePlan(Mode.EAGER, structure, dtype, device, pending=Mode.JIT, estimated_build_s=estimate_s)
    missing = tuple(cache.missing(structure, dtype, device))
    if not missing:
        return CompilePlan(Mode.AOT, structure, dtype, device)
    past = cache.past_build_times_s()
    per_stage_s = statistics.median(past) if past else DEFAULT_BUILD_S[Mode.AOT]
    return CompilePlan(Mode.EAGER, structure, dtype, device, pending=Mode.AOT, missing=missing,
                       estimated_build_s=per_stage_s * len(missing))
