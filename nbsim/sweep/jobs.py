"""The sweep's job bodies: build a structure's kernels, render and time a batch of points (comparing each
with its reference), render a batch of references. Plain functions the workflow's scripts call.

Timing inside a batch: the process's start-up (interpreter, Snakemake's script preamble, importing torch
and nbsim) is recorded once per batch as `process_startup_s`; then each kernel the batch needs is loaded
by one untimed render of the first point that uses it (`kernel_loads`: seconds and cache state). A
point's `cold_s` is therefore its own first image in a process whose kernel is loaded: setting up its
crystal, beam and detector from its spec's configuration (parsed at planning, not here), and rendering
once. Its warm times follow, as in `nbsim bench`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import platform
import socket
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import NbsimError
from ..io.structure_files import table_provenance
from ..modes import Compile, Mode
from .plan import KernelJob
from .progress import Progress
from .spec import BatchJob
from .store import DETECTOR_IMAGE, BatchStore, job_digest, open_store_array, write_json

if TYPE_CHECKING:
    import torch

    from ..config import SimulationConfig
    from ..kernel.cache import KernelCache
    from ..kernel.stages import StageVariant
    from ..timing import BenchResult

IMAGE_DIMENSIONS = ("point", "slow", "fast")
log = logging.getLogger(__name__)


def package_versions() -> dict[str, str]:
    """Python's and the main packages' versions, recorded with every batch."""
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("nbsim", "torch", "numpy", "xarray", "zarr", "snakemake"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            continue
    return found


def process_startup_s() -> float:
    """Seconds since this process started: its start-up and imports so far."""
    import psutil

    return time.time() - psutil.Process().create_time()


def _use_job_resources(compile_cache: str, threads: int) -> None:
    """A job's shared compile cache (Inductor's cache follows it: nbsim.cache.configure_compile_cache)
    and its CPU threads."""
    from ..cache import configure_compile_cache

    os.environ["NBSIM_CACHE_DIR"] = compile_cache
    os.environ["OMP_NUM_THREADS"] = str(max(1, threads))
    configure_compile_cache()
    torch_threads(threads)


def _job_identity() -> dict[str, Any]:
    from ..cpu import cpu_name

    return {"host": socket.gethostname(), "cpu": cpu_name(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "versions": package_versions()}


def build_kernel(job: KernelJob, threads: int, compile_cache: str, marker: Path) -> dict:
    """Make one structure's compiled kernels ready in the shared cache, so that the timed jobs' first renders
    load them instead of compiling (kernel jobs run before the timed jobs, in parallel and untimed).

    Ahead of time (`job.mode` 'aot'): each package built, or found in the cache, and probed on this machine
    (nbsim.kernel.aot.verify_package). Where this machine refuses a package, the timed jobs will run that
    stage just in time, so this job compiles that path once on example inputs into Inductor's on-disk caches
    (nbsim.kernel.jit.warm_stages, with the timed jobs' thread count). With `threads` of 2 or more that compile
    starts at once in a child process, beside the builds, and is stopped if every package passes its probe;
    with one thread it follows a refusal. Just in time ('jit': a GPU, or NBSIM_COMPILE_MODE=jit): that path
    is warmed. The marker JSON records each stage's path (`aot`, `jit`, or `jit (aot refused)`), its build,
    probe and warm-up seconds and whether the cache held its package. A warm-up that fails is recorded (`warm`:
    'failed: ...') and the job still succeeds: it only spares the timed jobs a compile, which they then do
    themselves. A device this machine lacks is recorded as skipped (its timed jobs report it)."""
    from ..devices import resolve_device, resolve_dtype
    from ..kernel.aot import verification_on
    from ..kernel.cache import JIT_AFTER_REFUSAL, KernelCache
    from ..kernel.stages import Structure

    _use_job_resources(compile_cache, threads)
    record: dict[str, Any] = {**asdict(job), **_job_identity()}
    try:
        device = resolve_device(job.device)
    except NbsimError as error:
        record.update(status="skipped", reason=str(error), stages=[])
        write_json(marker, record)
        return record
    dtype, structure = resolve_dtype(job.dtype), Structure.from_json(job.structure)
    variants = structure.stage_variants()
    cache = KernelCache(compile_cache)
    ahead_of_time = job.mode == Mode.AOT.value
    with tempfile.TemporaryDirectory() as folder:
        output = Path(folder) / "warm.log"
        warming = None
        if ahead_of_time and threads >= 2 and verification_on() and any(
                cache.verdict(cache.package(v, dtype, device)) is None for v in variants):
            from ..kernel.jit import start_warming

            warming = start_warming(structure, dtype, device, job.threads, output)
        try:
            stages = (_built_and_probed(cache, variants, dtype, device) if ahead_of_time
                      else [{"stage": v.stage.name, "path": job.mode} for v in variants])
            to_warm = [index for index, stage in enumerate(stages) if stage["path"] != Mode.AOT.value]
            try:
                record["warm"] = _warm_up(job, variants, dtype, device, stages, to_warm, warming, output)
            except Exception as error:  # a warm-up only spares the timed jobs their compile: they now compile it
                record["warm"] = f"failed: {type(error).__name__}: {error}"
                log.warning("the just-in-time warm-up %s; the timed jobs compile in their first render",
                            record["warm"])
        finally:
            if warming is not None and warming.poll() is None:
                stop_process_tree(warming.pid)
                warming.wait()
    for stage in stages:
        if stage["path"] == JIT_AFTER_REFUSAL:
            log.info("%s: %s", stage["stage"], stage["refused"])
    record.update(status="ok", stages=stages, build_s=sum(s.get("build_s", 0.0) for s in stages),
                  warm_s=sum(s.get("warm_s", 0.0) for s in stages))
    log.info("%s %s %s: %s", job.dtype, job.device, structure.name, ", ".join(
        f"{s['stage']} {s['path']} (build {s.get('build_s', 0):.1f} s, probe {s.get('probe_s', 0):.1f} s, warm-up "
        f"{s.get('warm_s', 0):.1f} s)" for s in stages))
    write_json(marker, record)
    return record


def _warm_up(job: KernelJob, variants: list[StageVariant], dtype: torch.dtype, device: torch.device,
             stages: list[dict[str, Any]], to_warm: list[int], warming: subprocess.Popen | None,
             output: Path) -> str | None:
    """Compile the just-in-time path of the stages `to_warm` (indices of `variants`) into Inductor's on-disk
    caches for the timed jobs' thread count, or wait for the child process `warming` already compiling every
    stage (stopped by the caller where nothing needs it); each warmed stage's seconds go into its record in
    `stages`. How it was warmed (None: nothing to warm)."""
    if warming is not None and not to_warm:
        return "stopped: every package passed its probe"
    if warming is not None:
        seconds = _warmed(warming, output)
        for index in to_warm:
            stages[index]["warm_s"] = seconds[index]
        return "beside the builds, in a child process"
    if not to_warm:
        return None
    from ..kernel.jit import warm_stages

    torch_threads(job.threads)
    warmed = warm_stages([variants[i] for i in to_warm], dtype, device)
    for index, seconds in zip(to_warm, warmed, strict=True):
        stages[index]["warm_s"] = seconds
    return "after the probes" if job.mode == Mode.AOT.value else "in this process"


def _built_and_probed(cache: KernelCache, variants: list[StageVariant], dtype: torch.dtype,
                      device: torch.device) -> list[dict[str, Any]]:
    """Each variant's package built (or found) and probed here: its stage's record, with the path its
    timed renders will take."""
    from ..kernel.aot import ensure_packages, verify_package
    from ..kernel.cache import JIT_AFTER_REFUSAL

    stages = []
    for variant, built, build_s in ensure_packages(cache, variants, dtype, device):
        package = cache.package(variant, dtype, device)
        started = time.perf_counter()
        failure = verify_package(cache, package, variant, dtype, device)
        stages.append({"stage": variant.stage.name, "package": package.name, "cache": "miss" if built else "hit",
                       "build_s": build_s, "probe_s": time.perf_counter() - started,
                       "path": Mode.AOT.value if failure is None else JIT_AFTER_REFUSAL,
                       **({"refused": failure} if failure else {})})
    return stages


def _warmed(warming: subprocess.Popen, output: Path) -> list[float]:
    """The seconds of each variant the warming child process compiled, once it has finished."""
    status = warming.wait()
    lines = output.read_text().strip().splitlines() or ["no output"]
    if status != 0:
        raise NbsimError(f"compiling the just-in-time kernels in a child process failed (exit status {status}): "
                         f"{lines[-1]}")
    return json.loads(lines[-1])


def stop_process_tree(pid: int, grace_s: float = 5.0) -> None:
    """Stop process `pid` and every process under it (compile workers, a Snakemake run's jobs): SIGTERM, then
    SIGKILL to those still running after `grace_s`."""
    import psutil

    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.terminate()
    for member in psutil.wait_procs(family, timeout=grace_s)[1]:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()


def torch_threads(count: int) -> None:
    """Run torch (and the CPU code Inductor compiles now) on `count` threads."""
    import torch

    torch.set_num_threads(max(1, count))


def run_batch(job: BatchJob, store: Path, records_path: Path, reference_store: Path | None = None) -> dict:
    """Render and time a batch's points, one after another, into one store (`nbsim.sweep.store.BatchStore`:
    each point's images and entry written as it finishes, so a rerun after a kill renders only the points
    it lacks) and, once all are done, one records JSON. Point batches compare each image with the same
    point of `reference_store` (if any); reference batches (`job.is_reference`) render in float64 with nbsim
    or run `job.c_binary`."""
    from .. import timing  # noqa: F401  (torch and the renderer: part of the process's start-up)

    startup_s = process_startup_s()
    started = time.perf_counter()
    _use_job_resources(job.compile_cache, job.threads)
    record: dict[str, Any] = {
        "scenario": job.scenario, "batch": job.batch, "kind": "reference" if job.is_reference else "points",
        "dtype": job.dtype, "device": job.device, "compile": job.compile, "warmup": job.warmup,
        "repeats": job.repeats, "every_point": job.every_point, "threads": job.threads,
        "process_startup_s": startup_s, **_job_identity()}
    images = {"image": np.float64 if job.is_reference and not job.c_binary else np.float32,
              **({DETECTOR_IMAGE: np.uint16} if job.detector else {})}
    output = BatchStore(store, job_digest(job.to_dict()), [p.name for p in job.points], job.points[0].image_shape,
                        images, {"scenario": job.scenario, "batch": job.batch})
    entries = output.entries()
    done = sum(entry is not None for entry in entries)
    log.info("%s %s: %d points, %s .. %s; %d already in its store; process start-up %.2f s", job.scenario,
             job.batch, len(job.points), job.points[0].name, job.points[-1].name, done, startup_s)
    if job.is_reference and job.c_binary:
        loads = _c_references(job, output, entries)
    else:
        loads = _nbsim_points(job, output, entries, reference_store)
    output.flush()
    files = [p for p in Path(store).rglob("*") if p.is_file()]
    store_bytes = sum(p.stat().st_size for p in files)
    record.update(status=entries[0]["status"], kernel_loads=loads, points=entries, rendered=len(entries) - done,
                  resumed=done, reference=("c" if job.c_binary else "nbsim-float64-cpu") if job.is_reference else None,
                  store_files=len(files), store_bytes=store_bytes, bytes_per_image=store_bytes / len(entries))
    record.update(wall_s=time.perf_counter() - started, timed_s=sum(p.get("timed_s", 0.0) for p in entries))
    output.finish({"batch": {k: v for k, v in record.items() if k != "points"}})
    write_json(records_path, record)
    loads = [(load["kernel"], round(load["load_s"], 3), load["cache"]) for load in record["kernel_loads"]]
    log.info("%s %s: done in %.2f s (%d points rendered, %d resumed), %.2f s of it timing points; kernel loads "
             "(kernel, seconds of the untimed render that loaded it: set-up, load and one image, cache) %s",
             job.scenario, job.batch, record["wall_s"], record["rendered"], done, record["timed_s"], loads)
    return record


def _nbsim_points(job: BatchJob, output: BatchStore, entries: list[dict | None],
                  reference_store: Path | None) -> list[dict]:
    """Render the points without an entry, writing each (images, then entry) as it finishes."""
    from ..devices import resolve_device, resolve_dtype
    from ..timing import time_nbsim
    from .labels import rendered_labels

    try:
        device = resolve_device(job.device)
    except NbsimError as error:
        if job.on_unavailable_device != "skip":
            raise
        for index, point in enumerate(job.points):
            if entries[index] is None:
                entries[index] = {**point.to_dict(), "index": index, "status": "skipped", "reason": str(error)}
                output.write(index, {}, entries[index])
        return []
    import torch

    dtype = resolve_dtype(job.dtype)
    output_dtype = torch.float64 if job.is_reference else torch.float32
    reference = _reference_images(reference_store) if reference_store else None
    loads: dict[Any, dict] = {}
    progress = Progress(sum(entry is None for entry in entries), f"{job.scenario} {job.batch}")
    for index, point in enumerate(job.points):
        if entries[index] is not None:
            continue
        kernel = point.kernel or "eager"
        if kernel not in loads:
            _, load = time_nbsim(point.config, device, dtype, job.compile, 0, 0)
            loads[kernel] = {"kernel": kernel, "point": point.name, "load_s": load.cold_s,
                             "cache": load.compile_cache}
        timed = job.every_point or index == 0
        begin = time.perf_counter()
        images, result, statistics_, rendered = point_images(point.config, device, dtype, job.compile,
                                                             job.warmup if timed else 0, job.repeats if timed else 0,
                                                             output_dtype, job.detector)
        timed_s = time.perf_counter() - begin
        result.compile_cache = loads[kernel]["cache"]
        for line in result.warnings:
            log.warning("%s: %s", point.name, line)
        entry = {**point.to_dict(), "index": index, "status": "ok", "timing": asdict(result), "timed_s": timed_s,
                 "device_name": result.gpu or result.cpu, "images": sorted(images),
                 "structure_factors": table_provenance(point.config.structure),
                 "labels": {**point.labels, **rendered_labels(point.config), **statistics_}}
        if reference is not None:
            names, stored = reference
            entry["comparison"] = compare_images(rendered, stored[names[point.reference]])
        output.write(index, images, entry)
        entries[index] = entry
        progress.advance()
    return list(loads.values())


def point_images(config: SimulationConfig, device: torch.device, dtype: torch.dtype, compile: Compile, warmup: int,
                 repeats: int, output_dtype: torch.dtype,
                 detector: bool) -> tuple[dict[str, np.ndarray], BenchResult, dict[str, float], np.ndarray]:
    """One point's images, timed: `image` (the noise-free photons, `output_dtype`) and, with `detector`, the
    detector stage's `detector_image` (16-bit ADU, from the image as rendered, on its device and dtype);
    with their statistics (nbsim.sweep.labels.image_statistics; overloads counted by the detector stage) and
    the image as rendered, in its dtype: what a comparison with the reference takes, so that a float64
    point's agreement is its own, not the store's float32 rounding."""
    from ..detector import detector_image, layout_of
    from ..timing import timed_render
    from .labels import image_statistics

    timed = timed_render(config, device, dtype, compile, warmup, repeats)
    host = timed.image.detach().cpu()
    rendered = host.numpy()
    image = host.to(output_dtype).numpy()
    images = {"image": image}
    statistics_ = image_statistics(image)
    if detector:
        read_out = detector_image(timed.image, timed.setup.config.response, layout_of(timed.setup))
        images[DETECTOR_IMAGE] = read_out.adu.cpu().numpy().astype(np.uint16)
        statistics_.update(overloads=read_out.overloads, detector_photons=read_out.total_photons)
    return images, timed.result, statistics_, rendered


def render_record(entry: dict, device: str | None = None) -> dict[str, np.ndarray]:
    """A point's images again from its entry in records.json alone (its configuration, seeds included, and
    its dtype, compile setting and images): bit for bit the stored ones on the same device and dtype."""
    from ..devices import resolve_device, resolve_dtype
    from .spec import PointSpec

    spec = PointSpec.from_dict(entry)
    timing = entry["timing"]
    import torch

    images, *_ = point_images(spec.config, resolve_device(device or timing["device"]),
                              resolve_dtype(timing["dtype"]), Compile.of(timing["compile"]), 0, 0,
                              torch.float32, DETECTOR_IMAGE in entry.get("images", ()))
    return images


def _reference_images(store: Path) -> tuple[dict[str, int], Any]:
    """A reference batch's point names (to index) and its image array, read point by point."""
    names = open_store_array(store, "point")[...]
    return {str(name): i for i, name in enumerate(names)}, open_store_array(store, "image")


def _c_references(job: BatchJob, output: BatchStore, entries: list[dict | None]) -> list[dict]:
    """Reference images from the C binary (OMP_NUM_THREADS = the job's threads), timed as whole
    processes."""
    from ..reference import run_c_reference

    progress = Progress(sum(entry is None for entry in entries), f"{job.scenario} {job.batch}")
    for index, point in enumerate(job.points):
        if entries[index] is not None:
            continue
        begin = time.perf_counter()
        timed = job.every_point or index == 0
        image, times = run_c_reference(job.c_binary, list(point.argv), job.warmup if timed else 0,
                                       job.repeats if timed else 1)
        median_s = statistics.median(times)
        entries[index] = {**point.to_dict(), "index": index, "status": "ok", "binary": job.c_binary,
                          "timed_s": time.perf_counter() - begin,
                          "timing": {"c_median_s": median_s, "c_times_s": times, "warm_median_s": median_s,
                                     "warm_min_s": min(times), "warm_max_s": max(times)}}
        output.write(index, {"image": image.reshape(point.image_shape)}, entries[index])
        progress.advance()
    return []


def compare_images(image: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """Correlation, maximum absolute and relative error, and sum ratio of an image to its reference."""
    from ..reference import correlation

    image = image.astype(np.float64)
    reference = np.asarray(reference, dtype=np.float64)
    scale = float(np.abs(reference).max()) or 1.0
    difference = np.abs(image - reference)
    return {"correlation": correlation(image, reference), "max_abs_error": float(difference.max()),
            "max_rel_error": float(difference.max()) / scale,
            "sum_ratio": float(image.sum() / reference.sum()) if reference.sum() != 0 else math.nan,
            "finite": bool(np.isfinite(image).all())}
