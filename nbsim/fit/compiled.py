"""The fit's compiled kernel: a crystal's photons at a list of pixels and their derivatives, in one fused loop.

When a fit refines only the crystal (orientation, cell, N, scale, background), the detector and the beam
are fixed, and so is every pixel's scattering vector q = (p̂ − î)/λ per sub-pixel and source. A pixel's
Miller indices are then h = R·(C_o·q): R the crystal's real cell vectors (rows, Å; 9 numbers a shot), C_o
each phi step's and mosaic domain's fixed rotation (`oriented_cells` is linear in R). `crystal_sums` gives
Σ over orientations, sub-pixels and sources of w·F²·F_latt² per pixel and, with `gradients`, its
derivatives in R (9 per pixel) and N (3 per pixel) by the lattice factor's own formulas: one pass over
the pixel-steps, where autograd's backward through the step sum walks them some sixty times. Pixels of
many shots go into one call: `shot` says whose R, N and C_o each pixel reads.

Compiled ahead of time (torch.export and AOTInductor, as nbsim.kernel.aot builds the render's stages)
into packages of nbsim's cache folder (`fit/kernels`, keyed by the installation, this module's source and
the variant), each probed in a process of its own before a fit opens it (`python -m nbsim.fit.compiled
probe`); on other devices, torch.compile. Eagerly the same function is slower than the general model's
autograd path, so a fit without the package renders that way (nbsim.fit.model decides).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..cache import cache_dir, configure_compile_cache
from ..devices import resolve_dtype
from ..io.atomic import atomic_write_text
from ..kernel.aot import OPENED, OPENING, PROBE_TIMEOUT_S, RAN, open_package, verification_on
from ..kernel.build import BUILD_NICENESS
from ..kernel.cache import KernelCache, build_environment, locked
from ..kernel.inductor_patches import contracted_options, masked_tails, thread_options
from ..kernel.physics import _gather, _in_table, node_series_limit, sin_pi
from ..kernel.stages import dynamic_shape_config
from ..modes import Compile

LOOKUPS = ("default", "nearest")
"""Structure-factor lookups the kernel has (tricubic interpolation is differentiable in h: not here)."""
EXAMPLE_SIZES = {"pixels": 1024, "substeps": 3, "orientations": 5, "shots": 2}
"""Distinct sizes of at least 2 to trace the kernel with (values irrelevant), as nbsim.kernel.inputs's."""
EXAMPLE_EXTENT = (3, 4, 5)
MAX_COUNT = 1 << 30
FUSED = (("assert_indirect_indexing", False),)
"""The table index is clamped into the table, so Inductor needs no bounds check."""


def cos_pi(x: torch.Tensor) -> torch.Tensor:
    """cos(πx) for |x| ≤ ½, as sin_pi of ½ − |x| (the same polynomial when compiled)."""
    return sin_pi(0.5 - torch.abs(x))


def lattice_factor_parts(delta: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The square crystal's lattice factor along one axis, s = sin(Nπδ)/sin(πδ) up to its sign (squared
    later), and its derivatives ∂s/∂δ and ∂s/∂N; next to the node its Taylor series and the series'
    derivatives, as nbsim.kernel.physics.sincg_parts gives the value (and autograd those derivatives)."""
    scaled = n * delta
    near = torch.abs(scaled) < node_series_limit(delta.dtype)
    x = math.pi * delta
    x2 = x * x
    n2 = n * n
    bend = n2 - 1.0
    curve = 3.0 * n2 - 7.0
    series = n * (1.0 - bend * x2 / 6.0 + bend * curve * x2 * x2 / 360.0)
    series_delta = math.pi * n * bend * x * (curve * x2 / 90.0 - 1.0 / 3.0)
    series_n = (1.0 - (bend + 2.0 * n2) * x2 / 6.0
                + (bend * curve + 2.0 * n2 * curve + 6.0 * n2 * bend) * x2 * x2 / 360.0)
    reduced = scaled - torch.round(scaled)
    sin_reduced, cos_reduced = sin_pi(reduced), cos_pi(reduced)
    below = torch.where(near, torch.ones_like(delta), sin_pi(delta))
    quotient = sin_reduced / below
    quotient_delta = math.pi * (n * cos_reduced - quotient * cos_pi(delta)) / below
    quotient_n = x * cos_reduced / below
    return (torch.where(near, series, quotient), torch.where(near, series_delta, quotient_delta),
            torch.where(near, series_n, quotient_n))


def crystal_sums(q: torch.Tensor, weight: torch.Tensor, shot: torch.Tensor, real: torch.Tensor, n_cells: torch.Tensor,
                 cells: torch.Tensor, grid: torch.Tensor, grid_min: torch.Tensor, grid_max: torch.Tensor,
                 grid_extent: torch.Tensor, default_F: torch.Tensor, *, lookup: str,
                 gradients: bool) -> tuple[torch.Tensor, ...]:
    """Σ_{o, k} w·F²·F_latt² per pixel (a square crystal), and with `gradients` its derivatives in the pixel's
    shot's real cell vectors R (9, P: ∂/∂R[v, j] at 3v + j) and N (3, P).

    q (3, K, P): scattering vectors (Å⁻¹) of each pixel's K sub-pixel × source steps; weight (K, P): each
    step's weight (the source's, zero where -dmin cuts it); shot (P,) int64: the shot each pixel belongs
    to; real (shots, 9) and n_cells (shots, 3): each shot's R (rows a, b, c) and N; cells (shots, O, 3, 3):
    each shot's orientations C_o, h = R·C_o·q; grid, grid_min, grid_max, grid_extent, default_F: the
    structure-factor table as nbsim.kernel.inputs holds it (one table, `lookup` "nearest"; "default" reads
    default_F only)."""
    if not torch.compiler.is_compiling() and cells.shape[0] == 1:  # eager, one shot: no per-pixel copies
        orientations, real, n_cells = cells[0].unsqueeze(-1).unsqueeze(-1), real[0], n_cells[0]
    else:
        orientations = cells[shot].permute(1, 2, 3, 0).unsqueeze(3)
        real, n_cells = real[shot].T, n_cells[shot].T
    rotated = [orientations[:, k, 0] * q[0] + orientations[:, k, 1] * q[1] + orientations[:, k, 2] * q[2]
               for k in range(3)]
    indices = [real[3 * v] * rotated[0] + real[3 * v + 1] * rotated[1] + real[3 * v + 2] * rotated[2]
               for v in range(3)]
    nodes = [torch.ceil(index - 0.5) for index in indices]
    parts = [lattice_factor_parts(index - node, n_cells[v]) for v, (index, node) in enumerate(zip(indices, nodes,
                                                                                                 strict=True))]
    squares = [part[0] * part[0] for part in parts]
    if lookup == "default":
        f_squared = default_F * default_F
    else:
        cell_factor = _gather(grid, *(_in_table(node, v, grid_min, grid_max) for v, node in enumerate(nodes)),
                              grid_min, grid_extent, torch.zeros((), dtype=torch.int32, device=grid.device))
        f_squared = cell_factor * cell_factor
    weighted = weight * f_squared
    total = (weighted * squares[0] * squares[1] * squares[2]).sum(dim=(0, 1))
    if not gradients:
        return (total,)
    others = (squares[1] * squares[2], squares[0] * squares[2], squares[0] * squares[1])
    twice = [2.0 * weighted * part[0] * other for part, other in zip(parts, others, strict=True)]
    by_index = [twice[v] * parts[v][1] for v in range(3)]
    by_n = torch.stack([(twice[v] * parts[v][2]).sum(dim=(0, 1)) for v in range(3)])
    by_real = torch.stack([(by_index[v] * rotated[j]).sum(dim=(0, 1)) for v in range(3) for j in range(3)])
    return total, by_n, by_real


@dataclass(frozen=True)
class Variant:
    """One compiled kernel: the structure-factor lookup, whether it gives derivatives, the dtype and device."""

    lookup: str
    gradients: bool
    dtype: str
    device: str

    def function(self) -> Callable:
        """crystal_sums with this variant's switches."""
        return functools.partial(crystal_sums, lookup=self.lookup, gradients=self.gradients)


def example_inputs(dtype: torch.dtype, device: torch.device, pixels: int = EXAMPLE_SIZES["pixels"]) -> list:
    """Inputs of EXAMPLE_SIZES (table indices in range) to trace or probe the kernel."""
    sizes = EXAMPLE_SIZES
    shots, steps = sizes["shots"], sizes["substeps"]

    def ones(*shape: int) -> torch.Tensor:
        return torch.ones(shape, dtype=dtype, device=device)

    table = math.prod(EXAMPLE_EXTENT)
    return [ones(3, steps, pixels), ones(steps, pixels),
            torch.arange(pixels, device=device) % shots, ones(shots, 9), ones(shots, 3),
            ones(shots, sizes["orientations"], 3, 3), ones(table),
            torch.zeros(3, dtype=dtype, device=device),
            torch.tensor([e - 3 for e in EXAMPLE_EXTENT], dtype=dtype, device=device),
            torch.tensor(EXAMPLE_EXTENT, dtype=torch.int32, device=device), ones()]


def _dynamic_shapes() -> tuple:
    pixels = torch.export.Dim("pixels", min=2, max=MAX_COUNT)
    steps, orientations, shots, table = (torch.export.Dim(name, min=1, max=MAX_COUNT)
                                         for name in ("substeps", "orientations", "shots", "table"))
    return ({1: steps, 2: pixels}, {0: steps, 1: pixels}, {0: pixels}, {0: shots}, {0: shots},
            {0: shots, 1: orientations}, {0: table}, None, None, None, None)


class _Flat(torch.nn.Module):
    def __init__(self, function: Callable):
        super().__init__()
        self.function = function

    def forward(self, *inputs):
        return self.function(*inputs)


def source_digest() -> str:
    """SHA-256 of the code a package is built from: this module's kernel functions and build (the physics it
    imports is in build_environment's digest)."""
    parts = [inspect.getsource(function) for function in (cos_pi, lattice_factor_parts, crystal_sums,
                                                             example_inputs, _dynamic_shapes, build_package)]
    return hashlib.sha256("".join(parts + [repr(FUSED)]).encode()).hexdigest()


def kernel_cache() -> KernelCache:
    """The fit's packages: nbsim's cache folder / fit (apart from the render's, whose build times they
    would skew)."""
    return _cache_in(cache_dir().expanduser().resolve() / "fit")


@functools.cache
def _cache_in(folder: Path) -> KernelCache:
    return KernelCache(folder)


def package_path(variant: Variant) -> Path:
    """Where a variant's package is kept: a digest of the installation, this source and the variant."""
    description = {**build_environment(), "fit_source": source_digest(), **asdict(variant)}
    key = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:32]
    return kernel_cache().kernels / f"crystal-{key}.pt2"


def build_package(variant: Variant, package: Path) -> None:
    """Export the variant with every count dynamic and compile it into `package` (whole or not at all)."""
    from torch._inductor import aoti_compile_and_package

    dtype, device = resolve_dtype(variant.dtype), torch.device(variant.device)
    with dynamic_shape_config():
        exported = torch.export.export(_Flat(variant.function()), tuple(example_inputs(dtype, device)),
                                       dynamic_shapes=(_dynamic_shapes(),), strict=False)
    partial = package.with_name(f"{package.stem}.partial-{os.getpid()}.pt2")
    with warnings.catch_warnings(), masked_tails():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        aoti_compile_and_package(exported, package_path=str(partial),
                                 inductor_configs=dict(FUSED + contracted_options() + thread_options()))
    os.replace(partial, package)


def ensure_package(variant: Variant) -> tuple[Path, float]:
    """The variant's package, built first unless the cache holds it (one process builds, others wait on its
    lock); the seconds a build took (0 when it was cached), recorded beside it."""
    package = package_path(variant)
    package.parent.mkdir(parents=True, exist_ok=True)
    with locked(package.with_suffix(".lock")):
        if package.is_file():
            return package, 0.0
        started = time.perf_counter()
        build_package(variant, package)
        seconds = time.perf_counter() - started
        atomic_write_text(package.with_suffix(".json"), json.dumps({**asdict(variant), "build_s": round(seconds, 2)}))
        return package, seconds


DEFAULT_BUILD_S = 90.0
"""Seconds a package is taken to build where this machine has built none yet (75 s and 40 s measured for the
float64 derivative and value kernels on the development machine's 2 shared cores)."""
EAGER_S_PER_PIXEL_STEP = 1.5e-5
"""Eager seconds a whole fit spends per pixel-step of its images (fitted pixels × steps at the start's
sampling): some 70 evaluations' worth of 2e-7 s (the search stages' area-averaged pixels at four times the
steps, the final stage, the Hessian's differences), measured on fit_still."""
COMPILED_SPEEDUP = 4.0
"""How much faster the compiled kernel makes a fit (measured on fit_still: 4-5x per evaluation)."""


def build_estimate_s() -> float:
    """Seconds a package is expected to take to build here: the median of this cache's past builds."""
    past = []
    for record in kernel_cache().kernels.glob("crystal-*.json"):
        try:
            past.append(float(json.loads(record.read_text())["build_s"]))
        except (OSError, ValueError, KeyError):
            continue
    return statistics.median(past) if past else DEFAULT_BUILD_S


def kernels_ready(variants: list[Variant], pixel_steps: int) -> bool:
    """Compile "auto": are the variants' kernels at hand for a fit of `pixel_steps`, cached or built now
    because building them first is quicker than fitting eagerly?"""
    missing = [variant for variant in variants if not is_cached(variant)]
    if not missing:
        return True
    eager_s = EAGER_S_PER_PIXEL_STEP * pixel_steps
    if eager_s <= build_estimate_s() * len(missing) + eager_s / COMPILED_SPEEDUP:
        return False
    for variant in missing:
        ensure_package(variant)
    return True


def start_background_build(variants: list[Variant]) -> bool:
    """Build the variants' packages in a detached, niced process for later fits (its output appended to the
    cache's background-build.log), unless the cache holds them; True when one was started."""
    missing = [variant for variant in variants if not is_cached(variant)]
    if not missing:
        return False
    folder = kernel_cache().kernels
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", __name__, "build", json.dumps([asdict(variant) for variant in missing])]
    with open(folder / "background-build.log", "a") as log:
        subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
    return True


def probe(variant: Variant, package: Path) -> str | None:
    """None when this process may open `package` (it opened and ran in a probe process on this machine and
    installation, now or before, or verification is off: NBSIM_VERIFY_PACKAGES); else why not."""
    if not verification_on():
        return None
    cache = kernel_cache()
    with locked(package.with_suffix(".lock")):
        verdict = cache.verdict(package)
        if verdict is None:
            started = time.perf_counter()
            spec = json.dumps({"package": str(package), **asdict(variant)})
            try:
                run = subprocess.run([sys.executable, "-m", __name__, "probe", spec], stdin=subprocess.DEVNULL,
                                     capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
                printed, error = run.stdout.split(), (run.stderr.strip().splitlines() or [""])[-1][:300]
                usable, status = run.returncode == 0 and RAN in printed, run.returncode
            except subprocess.TimeoutExpired:
                printed, error, usable, status = [], f"timed out after {PROBE_TIMEOUT_S:.0f} s", False, None
            if OPENING not in printed:  # it never reached the package: no verdict on it
                return f"the probe process stopped before opening it ({error or status})"
            failure = "" if usable else f"{'running' if OPENED in printed else 'opening'} it failed in a probe " \
                                        f"process ({error or f'status {status}'})"
            verdict = cache.record_verdict(package, usable, failure, time.perf_counter() - started)
    return None if verdict["usable"] else verdict["failure"]


class CrystalKernel:
    """A variant of crystal_sums, called on its tensors: compiled (pixels padded to two), or eager (`compiled`
    False: the function itself, which a caller gives one shot at a time)."""

    def __init__(self, variant: Variant, runner: Callable | None = None):
        self.variant = variant
        self.compiled = runner is not None
        self._runner = runner

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._runner is None:
            return self.variant.function()(*inputs)
        pixels = inputs[0].shape[-1]
        if pixels < 2:
            inputs = tuple(_twice(x) if i < 3 else x for i, x in enumerate(inputs))
        outputs = self._runner([x.contiguous() for x in inputs])  # a package reads its inputs as contiguous
        return tuple(output[..., :pixels] for output in outputs)


def _twice(x: torch.Tensor) -> torch.Tensor:
    """A one-pixel input repeated along its last (pixel) axis: compiled kernels take two pixels at least."""
    return x.repeat(*([1] * (x.dim() - 1)), 2)


_OPEN: dict[Variant, CrystalKernel | None] = {}


def compiled_kernel(variant: Variant, build: bool) -> CrystalKernel | None:
    """The variant's compiled kernel: on the CPU its package (opened once per process; built first when
    `build`, else None unless the cache holds it; None too where a probe found it unusable here), elsewhere
    torch.compile of crystal_sums."""
    if variant in _OPEN:
        return _OPEN[variant]
    if variant.device != "cpu":
        compiled = torch.compile(variant.function(), dynamic=True, options=dict(FUSED))
        kernel = CrystalKernel(variant, lambda inputs: compiled(*inputs))
    else:
        package = package_path(variant)
        if not package.is_file() and not build:
            return None
        package, _ = ensure_package(variant)
        if probe(variant, package) is not None:
            _OPEN[variant] = None
            return None
        runner = open_package(package, torch.device(variant.device))
        kernel = CrystalKernel(variant, runner.run)
    _OPEN[variant] = kernel
    return kernel


def crystal_kernel(variant: Variant, compile: Compile) -> CrystalKernel:
    """The kernel a fit renders with: compiled where `compile` allows and the package is at hand (built first
    under Compile.ON), else crystal_sums eagerly."""
    kernel = None if compile is Compile.OFF else compiled_kernel(variant, build=compile is Compile.ON)
    return kernel or CrystalKernel(variant)


def is_cached(variant: Variant) -> bool:
    """Does the cache hold the variant's package (or is it compiled just in time on this device)?"""
    return variant.device != "cpu" or package_path(variant).is_file()


def main(argv: list[str] | None = None) -> int:
    """`python -m nbsim.fit.compiled probe SPEC` (open the package SPEC names and run it once: see `probe`) or
    `build SPECS` (build the variants of a JSON list: start_background_build's process)."""
    command, spec = (sys.argv[1:] if argv is None else argv)[:2]
    fields = json.loads(spec)
    if command == "build":
        os.nice(BUILD_NICENESS)
        configure_compile_cache()
        for entry in fields:
            ensure_package(Variant(**entry))
        return 0
    variant = Variant(fields["lookup"], fields["gradients"], fields["dtype"], fields["device"])
    device = torch.device(variant.device)
    inputs = example_inputs(resolve_dtype(variant.dtype), device, pixels=16)
    print(OPENING, flush=True)
    runner = open_package(Path(fields["package"]), device)
    print(OPENED, flush=True)
    runner.run(inputs)
    print(RAN, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

