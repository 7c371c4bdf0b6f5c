"""Batch sizes from a cost model, for a sweep that gives no `sweep.batch_size` (torch-free at import).

A batch job pays its process's start-up (Python, PyTorch, its kernel: about 2 s) once, then renders its
points one after another. Batches of a few points pay that start-up over and over; one batch of everything
leaves the other cores idle and a killed job loses much. So each (scenario, size) is cut into batches that
an estimate (`point_cost_s`) puts at about TARGET_JOB_S each, and into at least as many batches as jobs run
side by side (`parallel_jobs`), a multiple of it, so every round of jobs fills the cores.

The estimate is deliberately simple: a point's set-up and bookkeeping, a term per pixel (the detector
stage, statistics, compression and the store) and its renders' pixel steps at a rate per device and
kernel. Its constants were measured on the 2-core EPYC that docs/benchmarks.md reports (a 256² dataset
shot of 10 mosaic domains: 18 ms with its detector stage and store); a machine twice as fast or slow makes
jobs twice as short or long, still tens of seconds.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..modes import Compile
from .plan import Point, point_config

if TYPE_CHECKING:
    from .plan import StructureMemo

TARGET_JOB_S = 30.0
"""The estimated length of a batch job: tens of seconds, so its start-up is a few per cent of it."""
POINT_OVERHEAD_S = 0.006
"""Per point, whatever its size: set-up (geometry, lattice, sources), labels and its record."""
PIXEL_OVERHEAD_S = 1.0e-7
"""Per pixel of a point: detector stage, image statistics, compression and the store."""
STEPS_PER_S = {("cpu", True): 1.0e8, ("cpu", False): 1.0e7, ("cuda", True): 2.0e9, ("cuda", False): 5.0e8}
"""Pixel steps per second of one thread (CPU) or one device (CUDA), by (device kind, compiled)."""
FLOAT64_SLOWDOWN = 2.0
"""A float64 render against a float32 one."""
SAMPLES_PER_GROUP = 3
"""Points of a (scenario, size) whose steps are counted: its first, middle and last (values along an axis,
such as -N or -phisteps, change the cost; the costliest sample sizes the group's batches)."""


@dataclass(frozen=True)
class Timing:
    """How a batch job renders each point: renders per point and CPU threads."""

    renders: int
    threads: int


def point_cost_s(pixels: int, steps_per_pixel: int, device: str, compiled: bool, dtype: str,
                 timing: Timing) -> float:
    """The estimated seconds one point takes in its batch job."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    rate = STEPS_PER_S[(kind, compiled)] * (timing.threads if kind == "cpu" else 1)
    render_s = pixels * steps_per_pixel / rate * (FLOAT64_SLOWDOWN if dtype == "float64" else 1.0)
    return POINT_OVERHEAD_S + pixels * PIXEL_OVERHEAD_S + timing.renders * render_s


def batch_sizes(config: dict, points: list[Point], base: Path, memo: StructureMemo, timing: Timing,
                parallel_jobs: int, reference: bool) -> dict[tuple[str, int], int]:
    """Points per batch for each (scenario, size): batches of about TARGET_JOB_S by `point_cost_s` (the
    costliest of the group's dtype, device and compile variants, and of its reference with `reference`), at
    least `parallel_jobs` of them (a multiple of it) where the group has the points."""
    groups: dict[tuple[str, int], list[Point]] = {}
    for point in points:
        groups.setdefault((point.scenario, point.size), []).append(point)
    sizes = {}
    for key, members in groups.items():
        variants = {(p.dtype, p.device, p.compile is not Compile.OFF) for p in members}
        if reference:
            variants.add(("float64", "cpu", bool(config["reference"].get("compile", True))))
        variant = (members[0].dtype, members[0].device, members[0].compile)
        along_axes = [p for p in members if (p.dtype, p.device, p.compile) == variant]
        sizes[key] = _batch_size(len(along_axes), functools.partial(
            _costliest_s, config, along_axes, variants, base, memo, timing), parallel_jobs)
    return sizes


def _costliest_s(config: dict, points: list[Point], variants: set[tuple[str, str, bool]], base: Path,
                 memo: StructureMemo, timing: Timing) -> float:
    """The estimate of the costliest of the points' samples in the costliest variant (its steps per pixel
    import PyTorch unless `memo` knows them)."""
    cost_s = 0.0
    for sample in dict.fromkeys(points[i] for i in _sample_indices(len(points))):
        simulation = point_config(config, sample, base)
        pixels = sum(p.pixels_f * p.pixels_s for p in simulation.detector.panels or (simulation.detector,))
        steps = memo.steps_per_pixel(simulation)
        cost_s = max(cost_s, max(point_cost_s(pixels, steps, device, compiled, dtype, timing)
                                 for dtype, device, compiled in variants))
    return cost_s


def kept_batch_sizes(path: Path, config: dict, planning: bool,
                     sizes: Callable[[], dict[tuple[str, int], int]]) -> dict[tuple[str, int], int]:
    """The batch sizes of the process that plans the jobs (`planning`), which computes them (`sizes`) and
    keeps them in `path` under the configuration's digest, for the processes that plan again inside a job
    (a SLURM job, on a node with another core count): they read them there, so every process names the
    same batches. A job process that finds none (the file gone) computes its own."""
    import hashlib
    import json

    from ..io.atomic import atomic_write_text

    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        kept = {}
    if not planning and digest in kept:
        return {(scenario, int(size)): count for scenario, size, count in kept[digest]}
    planned = sizes()
    if planning:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps({digest: [[s, n, c] for (s, n), c in planned.items()]}))
    return planned


def _sample_indices(count: int) -> list[int]:
    return sorted({round(i * (count - 1) / max(1, SAMPLES_PER_GROUP - 1)) for i in range(SAMPLES_PER_GROUP)})


def _batch_size(count: int, cost_s: Callable[[], float], parallel_jobs: int) -> int:
    """Points per batch for `count` points of `cost_s()` each. One point, or fewer points than jobs run side
    by side, make a batch each whatever they cost: estimated only where it decides (a Snakemake start of a
    sweep of single points imports no PyTorch for it)."""
    if count == 1 or count < parallel_jobs:
        return 1
    batches = max(1, math.ceil(count * cost_s() / TARGET_JOB_S))
    if parallel_jobs > 1:  # whole rounds of jobs side by side
        batches = parallel_jobs * math.ceil(batches / parallel_jobs)
    return max(1, math.ceil(count / min(batches, count)))
