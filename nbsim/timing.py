"""The timing harness of `nbsim bench` and the sweep: nbsim cold and warm (`BenchResult`); the nanoBragg C
binary it is compared with runs in nbsim.reference."""

from __future__ import annotations

import os
import resource
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from . import __version__
from .config import SimulationConfig
from .cpu import cpu_name
from .devices import dtype_name
from .kernel.cache import KernelLoads
from .modes import Compile, Mode
from .render import Renderer
from .resolve import Setup, resolve


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
    """What rendered after the cold call: 'eager', 'jit' or 'aot' (a modes.Mode's value), or 'jit (aot
    refused)' where this machine refused the ahead-of-time packages (Renderer.kernel_path)."""
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
    warnings: list[str] = field(default_factory=list)
    """The renderer's one-line warnings (e.g. a package this machine could not open, its stage run just in
    time)."""


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
        compile=compile, mode=renderer.kernel_path, pixels=setup.pixel_count, steps=setup.steps,
        peak_rss_mb=peak_rss_mb(),
        threads=torch.get_num_threads(), compile_cache=cache, torch_version=torch.__version__,
        nbsim_version=__version__, cpu=cpu_name(), host=socket.gethostname(),
        slurm_job_id=os.environ.get("SLURM_JOB_ID"),
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        warnings=list(renderer.warnings))
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
