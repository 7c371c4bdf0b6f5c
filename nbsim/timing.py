"""The timing harness of `nbsim bench` and the sweep: nbsim cold and warm, and the nanoBragg C binary as
whole processes, side by side (`BenchResult`)."""

from __future__ import annotations

import math
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import __version__
from .beam import build_sources
from .config import SimulationConfig
from .cpu import cpu_name
from .devices import dtype_name
from .errors import NbsimError
from .geometry import build_geometry
from .kernel.cache import KernelLoads
from .modes import Compile, Mode
from .nanobragg import parse
from .nanobragg.flags import WAVELENGTH_FLAGS, absolute_file_arguments
from .nanobragg.presets import expand_detector_model
from .render import Renderer
from .setup import Setup, resolve


@dataclass
class BenchResult:
    """Timings (seconds) of one simulation, with what is needed to compare and reproduce them."""

    cold_s: float
    warm_median_s: float | None
    """None with no repeats (a point rendered once, its cold call)."""
    warm_min_s: float | None
    warm_max_s: float | None
    warm_times_s: list[float]
    repeats: int
    warmup: int
    device: str
    dtype: str
    compile: Compile
    """As requested: "auto", "on" or "off"."""
    mode: str
    """What rendered after the cold call: 'eager', 'jit' or 'aot' (a modes.Mode's value)."""
    pixels: int
    steps: int
    peak_rss_mb: float
    threads: int
    compile_cache: str
    """'hit' (compiled kernel loaded from the cache), 'miss' (compiled now), 'loaded' (already in this
    process's memory) or 'unused' (eager)."""
    torch_version: str
    nbsim_version: str
    cpu: str
    host: str
    slurm_job_id: str | None
    gpu: str | None = None
    c_median_s: float | None = None
    c_times_s: list[float] = field(default_factory=list)
    speedup: float | None = None
    correlation: float | None = None


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux reports kB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_nbsim(config: SimulationConfig, device: torch.device, dtype: torch.dtype, compile: Compile,
               warmup: int, repeats: int,
               output_dtype: torch.dtype = torch.float32) -> tuple[np.ndarray, BenchResult]:
    """Cold call (setup, compile or cache load, first render) then warm renders (none with `repeats` 0);
    returns the image too (as `output_dtype` on the CPU)."""
    timed = timed_render(config, device, dtype, compile, warmup, repeats)
    return timed.image.detach().to("cpu", output_dtype).numpy(), timed.result


@dataclass
class TimedRender:
    """`timed_render`'s set-up, image (on its device, in its dtype) and timings."""

    setup: Setup
    image: torch.Tensor
    result: BenchResult


def timed_render(config: SimulationConfig, device: torch.device, dtype: torch.dtype, compile: Compile,
                 warmup: int, repeats: int) -> TimedRender:
    """`time_nbsim`, keeping the set-up and the image tensor (for a stage after rendering: the detector).

    Warm renders reuse one output buffer, as a caller rendering repeatedly would.
    """
    graphs_before = _inductor_graphs()
    start = time.perf_counter()
    setup = resolve(config)
    renderer = Renderer(setup, device=device, dtype=dtype, compile=compile)
    image = renderer()
    _synchronize(device)
    cold = time.perf_counter() - start
    cache = _cache_state(renderer.mode, renderer.loads, graphs_before, _inductor_graphs())
    buffer = torch.empty_like(image)
    for _ in range(warmup):
        renderer(out=buffer)
    _synchronize(device)
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        renderer(out=buffer)
        _synchronize(device)
        times.append(time.perf_counter() - begin)
    result = BenchResult(
        cold_s=cold, warm_median_s=statistics.median(times) if times else None,
        warm_min_s=min(times, default=None), warm_max_s=max(times, default=None),
        warm_times_s=times, repeats=repeats, warmup=warmup, device=str(device), dtype=dtype_name(dtype),
        compile=compile, mode=renderer.mode.value, pixels=setup.pixel_count, steps=setup.steps,
        peak_rss_mb=peak_rss_mb(),
        threads=torch.get_num_threads(), compile_cache=cache, torch_version=torch.__version__,
        nbsim_version=__version__, cpu=cpu_name(), host=socket.gethostname(),
        slurm_job_id=os.environ.get("SLURM_JOB_ID"),
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None)
    return TimedRender(setup, image, result)


def _inductor_graphs() -> tuple[int, int]:
    """(loaded from Inductor's cache, compiled) graphs so far in this process (the jit path's count)."""
    if "torch._dynamo" not in sys.modules:
        return 0, 0
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_hit"]), int(counters["inductor"]["fxgraph_cache_miss"])


def _cache_state(mode: Mode, loads: KernelLoads, graphs_before: tuple[int, int], graphs_after: tuple[int, int]) -> str:
    """'unused', 'miss', 'hit' or 'loaded' (BenchResult.compile_cache) for the cold call."""
    if mode is Mode.EAGER:
        return "unused"
    if loads.built or graphs_after[1] > graphs_before[1]:
        return "miss"
    return "hit" if loads.opened or graphs_after[0] > graphs_before[0] else "loaded"


def run_c_reference(binary: str, argv: list[str], warmup: int, repeats: int,
                    timeout_s: float = 3600.0) -> tuple[np.ndarray, list[float]]:
    """Run the C binary (argument list, no shell) in a clean folder; whole-process wall times and image."""
    path = shutil.which(binary) or binary
    if not Path(path).is_file():
        raise NbsimError(f"C reference binary {binary} not found")
    if not os.access(path, os.X_OK):
        raise NbsimError(f"C reference binary {binary} is not executable")
    argv = absolute_file_arguments(argv, Path.cwd())
    times = []
    with tempfile.TemporaryDirectory(prefix="nbsim-c-") as folder:
        floatfile = Path(folder) / "c_float.bin"
        # Output flags go first: nanoBragg's substring matching lets a trailing flag such as
        # -misset_seed consume the tokens after it.
        sourcefile = Path(folder) / "c_sources.txt"
        command = [path, "-floatfile", str(floatfile), "-nonoise", "-nopgm", "-intfile",
                   str(Path(folder) / "c_int.img"), *c_arguments(argv, sourcefile)]
        for run in range(warmup + repeats):
            for stale in Path(folder).iterdir():
                if stale != sourcefile:
                    stale.unlink()
            begin = time.perf_counter()
            try:
                completed = subprocess.run(command, cwd=folder, capture_output=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise NbsimError(f"C reference {binary} did not finish within {timeout_s:g} s") from None
            elapsed = time.perf_counter() - begin
            if completed.returncode != 0:
                tail = completed.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
                raise NbsimError(f"C reference {binary} failed with status {completed.returncode}: {tail[0]}")
            if run >= warmup:
                times.append(elapsed)
        if not floatfile.is_file():
            raise NbsimError(f"C reference {binary} wrote no float image")
        image = np.fromfile(floatfile, dtype=np.float32)
    return image, times


def c_arguments(argv: list[str], sourcefile: Path) -> list[str]:
    """nanoBragg's arguments for an nbsim command line. The C has no -spectrumfile: it becomes a -sourcefile
    (written to `sourcefile`) of the same sources, every divergence direction times every channel, which
    the C weighs equally, and the nominal -lambda. The C's image then equals nbsim's for equal weights. A
    -detector_model becomes its flags (the C renders its module gaps, which nbsim leaves out)."""
    argv = expand_detector_model(argv)
    if "-spectrumfile" not in argv:
        return argv
    config = parse(argv)[0]
    geometry = build_geometry(config.detector)
    sources = build_sources(config.beam, geometry.beam, geometry.polar, geometry.vertical)
    sourcefile.write_text("".join(f"{x!r} {y!r} {z!r} 1 {wavelength * 1e-10!r}\n" for (x, y, z), wavelength
                                  in zip(sources.positions_m.tolist(), sources.wavelength_A.tolist(), strict=True)))
    index = argv.index("-spectrumfile")
    rest = argv[:index] + argv[index + 2:]
    given = any(flag in argv for flag in WAVELENGTH_FLAGS)
    nominal = [] if given else ["-lambda", repr(float(config.beam.wavelength_A))]
    return [*rest, *nominal, "-sourcefile", str(sourcefile)]


def correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson correlation of two images (1 for two equal constant images, NaN for other constant ones)."""
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    if a.std() == 0 or b.std() == 0:
        return 1.0 if np.array_equal(a, b) else math.nan
    return float(np.corrcoef(a, b)[0, 1])
