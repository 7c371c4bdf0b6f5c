"""The sweep behind the Snakemake workflow: points, one job's work, comparisons and collated tables.

A *point* is one (scenario, detector size, dtype, device, compile, extra option values) combination;
its *reference point* drops dtype, device and compile. Rules in workflow/ stay thin and call these
functions; they are plain Python so they can be tested and reused without Snakemake.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import platform
import shlex
import shutil
import sys
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import NbsimError
from .kernel.modes import choose_mode

AXES = ("size", "dtype", "device", "compile")


@dataclass(frozen=True)
class Point:
    """One job of the sweep."""

    scenario: str
    size: int
    dtype: str
    device: str
    compile: bool
    extras: tuple[tuple[str, Any], ...] = ()

    @property
    def _extras_suffix(self) -> str:
        return "".join(f"-{_slug(k)}_{_slug(v)}" for k, v in self.extras)

    @property
    def name(self) -> str:
        compiled = "on" if self.compile else "off"
        return f"n{self.size}-{self.dtype}-{self.device}-compile_{compiled}" + self._extras_suffix

    @property
    def reference_name(self) -> str:
        return f"n{self.size}" + self._extras_suffix

    @property
    def prebuilds_kernel(self) -> bool:
        """Points that load ahead-of-time kernels (asked of the renderer's own mode choice) get them from
        a `kernel` job first."""
        return choose_mode(self.compile, self.device.split(":")[0], needs_grad=False) == "aot"


def _slug(value: Any) -> str:
    text = str(value).lstrip("-")
    return "".join(c if c.isalnum() or c in "._" else "_" for c in text)


def _on(value: Any) -> bool:
    """YAML turns a bare `on` into True; accept either spelling."""
    return value is True or str(value).lower() in ("on", "true", "yes", "1")


def sweep_points(config: dict) -> list[Point]:
    """Every point of the sweep: scenarios × sizes × dtypes × devices × compile × extra axes."""
    sweep = config["sweep"]
    extra = sweep.get("extra") or {}
    extra_names = sorted(extra)
    points = []
    for scenario in config["scenarios"]:
        for size, dtype, device, compile_, *values in itertools.product(
                sweep["sizes"], sweep["dtypes"], sweep["devices"], sweep["compile"],
                *(extra[name] for name in extra_names)):
            points.append(Point(scenario, int(size), dtype, device, _on(compile_),
                                tuple(zip(extra_names, values, strict=True))))
    return points


def reference_points(points: list[Point]) -> list[Point]:
    """One reference per (scenario, size, extra values), in a stable order."""
    seen: dict[tuple, Point] = {}
    for point in points:
        seen.setdefault((point.scenario, point.reference_name), point)
    return list(seen.values())


def nbsim_reference_point(point: Point) -> Point:
    """The float64 CPU point whose kernel renders the nbsim reference of `point`."""
    return Point(point.scenario, point.size, "float64", "cpu", True, point.extras)


@dataclass(frozen=True)
class KernelJob:
    """One `kernel` job: the ahead-of-time kernels of one structure, dtype and device."""

    structure: str
    """nbsim.kernel.backends.Structure as JSON."""
    dtype: str
    device: str


def kernel_jobs(config: dict, points: list[Point], compiled_reference: bool,
                base: Path) -> tuple[dict[str, KernelJob], dict[Point, str]]:
    """The kernel jobs of a sweep (by name) and each prebuilding point's kernel job name. Points share a
    job when their structure, dtype and device agree, whatever their sizes and values;
    `compiled_reference` adds the float64 kernels the nbsim references use."""
    candidates = list(points) + ([nbsim_reference_point(p) for p in points] if compiled_reference else [])
    jobs: dict[str, KernelJob] = {}
    names: dict[Point, str] = {}
    for point in candidates:
        if not point.prebuilds_kernel or point in names:
            continue
        args, overrides = point_arguments(config, point, base)
        structure = structure_of(tuple(args), tuple(sorted(overrides.items())))
        name = f"{point.dtype}-{_slug(point.device)}-{structure.name}"
        jobs.setdefault(name, KernelJob(structure.to_json(), point.dtype, point.device))
        names[point] = name
    return jobs, names


@functools.cache
def structure_of(args: tuple[str, ...], overrides: tuple[tuple[str, Any], ...]):
    """The kernel structure (nbsim.kernel.backends.Structure) a point's arguments render with."""
    from .nanobragg_args import parse
    from .simulator import structure_for

    config, _ = parse(list(args))
    if overrides:
        config = config.with_options(**dict(overrides))
    return structure_for(config)


def scenario_args(config: dict, scenario: str, base: Path) -> list[str]:
    """A scenario's nanoBragg arguments, with file values made absolute against the config's folder."""
    from .bench import absolute_file_arguments

    spec = config["scenarios"][scenario]
    args = spec["args"] if isinstance(spec["args"], list) else shlex.split(spec["args"])
    return absolute_file_arguments([str(a) for a in args], base)


def point_arguments(config: dict, point: Point, base: Path) -> tuple[list[str], dict[str, Any]]:
    """nanoBragg arguments of a point (size appended, flag axes appended) and its option overrides."""
    args = scenario_args(config, point.scenario, base) + ["-detpixels", str(point.size)]
    overrides: dict[str, Any] = {}
    for name, value in point.extras:
        if name.startswith("-"):
            args += [name, str(value)]
        else:
            overrides[name] = value
    return args, overrides


def validate_config(config: dict, schema_path: str | Path, base: Path) -> None:
    """Check the config against the JSON schema (filling its defaults), then semantically.

    Raises NbsimError with a one-line reason naming the offending key.
    """
    import yaml

    schema = yaml.safe_load(Path(schema_path).read_text())
    errors = sorted(_validator_with_defaults(schema).iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        error = errors[0]
        where = ".".join(str(p) for p in error.absolute_path) or "top level"
        raise NbsimError(f"{where}: {_short_message(error)}")
    check_config(config, base)


def _validator_with_defaults(schema: dict):
    """A jsonschema validator that also fills in defaults, as snakemake's validate() does."""
    import copy

    import jsonschema

    base = jsonschema.validators.validator_for(schema)
    original = base.VALIDATORS["properties"]

    def properties(validator, properties, instance, subschema):
        if isinstance(instance, dict):
            for name, property_schema in properties.items():
                if "default" in property_schema:
                    instance.setdefault(name, copy.deepcopy(property_schema["default"]))
        yield from original(validator, properties, instance, subschema)

    return jsonschema.validators.extend(base, {"properties": properties})(schema)


def _short_message(error) -> str:
    if error.validator == "additionalProperties":
        extra = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        return f"unknown key(s) {', '.join(map(repr, extra))}"
    if error.validator == "required":
        return error.message.replace("'", "", 0)
    if error.validator in ("type", "enum", "pattern", "minimum", "maximum", "minItems", "minProperties",
                           "uniqueItems", "oneOf", "minLength"):
        shown = json.dumps(error.instance, default=str)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return f"{shown} is not valid here ({error.validator}: {json.dumps(error.validator_value, default=str)[:80]})"
    return error.message.splitlines()[0][:160]


def check_config(config: dict, base: Path) -> None:
    """Semantic checks the schema cannot express; raise NbsimError with a one-line reason."""
    from .config import option_names
    from .nanobragg_args import FLAGS, parse

    sweep = config["sweep"]
    names = option_names()
    for name in sweep.get("extra") or {}:
        if name.startswith("-"):
            if name not in FLAGS:
                raise NbsimError(f"sweep.extra: '{name}' is not a nanoBragg option")
        elif name not in names:
            raise NbsimError(f"sweep.extra: '{name}' is not a simulator option (known: see nbsim.config)")
    for scenario in config["scenarios"]:
        args = scenario_args(config, scenario, base)
        try:
            parse(args + ["-detpixels", str(sweep["sizes"][0])])
        except NbsimError as error:
            raise NbsimError(f"scenario '{scenario}': {error}") from None
    binary = (config.get("reference") or {}).get("c_binary")
    if binary:
        path = Path(c_binary_path(config, base))
        if not path.is_file():
            raise NbsimError(f"reference.c_binary {binary} does not exist")
        if not os.access(path, os.X_OK):
            raise NbsimError(f"reference.c_binary {binary} is not executable")


def c_binary_path(config: dict, base: Path) -> str | None:
    binary = (config.get("reference") or {}).get("c_binary")
    if not binary:
        return None
    return shutil.which(binary) or str((base / binary).resolve())


def package_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("nbsim", "torch", "numpy", "xarray", "zarr", "snakemake"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            continue
    return found


def write_store(path: Path, image: np.ndarray, attributes: dict[str, Any]) -> None:
    """An xarray-readable zarr store with the image and JSON-safe attributes."""
    import xarray as xr

    write_dataset(path, xr.Dataset({"image": (("slow", "fast"), image)}, attrs=_json_safe(attributes)))


def write_dataset(path: Path, dataset) -> None:
    """Write a dataset as zarr next to `path`, then rename it into place: readers never see a partial
    store, and a job killed mid-write leaves only a `.partial-*` folder that nothing reads (and that
    the next write of the same store removes)."""
    path = Path(path)
    for stale in path.parent.glob(path.name + ".partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    partial = path.with_name(path.name + f".partial-{os.getpid()}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Consolidated metadata")
        dataset.to_zarr(partial, mode="w", consolidated=True)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(partial, path)


def read_store(path: Path):
    import xarray as xr

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Consolidated metadata")
        return xr.open_zarr(path, consolidated=True)


def _json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str, allow_nan=True))


def write_json(path: Path, payload: dict) -> None:
    from .io import atomic_write

    atomic_write(path, (json.dumps(_json_safe(payload), indent=1, sort_keys=True) + "\n").encode())


@dataclass
class PointJob:
    """What one simulate job needs (the rule's params)."""

    scenario: str
    point: str
    args: list[str]
    overrides: dict[str, Any]
    dtype: str
    device: str
    compile: bool
    warmup: int
    repeats: int
    threads: int
    compile_cache: str
    on_unavailable_device: str = "fail"
    extras: dict[str, Any] = field(default_factory=dict)


def _use_job_resources(compile_cache: str, threads: int) -> None:
    """A job's shared compile cache (Inductor's cache follows it: nbsim.cache.configure_compile_cache)
    and its CPU threads."""
    import torch

    os.environ["NBSIM_CACHE_DIR"] = compile_cache
    torch.set_num_threads(max(1, threads))


def run_point(job: PointJob, store: Path, timing_path: Path) -> dict:
    """Render and time one point; write its store and timing JSON (or a 'skipped' record)."""
    from .bench import time_nbsim
    from .devices import resolve_device, resolve_dtype

    _use_job_resources(job.compile_cache, job.threads)
    record = {"scenario": job.scenario, "point": job.point, "args": job.args, "overrides": job.overrides,
              "extras": job.extras, "dtype": job.dtype, "device": job.device, "compile": job.compile,
              "versions": package_versions()}
    try:
        device = resolve_device(job.device)
    except NbsimError as error:
        if job.on_unavailable_device != "skip":
            raise
        record.update(status="skipped", reason=str(error))
        write_store(store, np.zeros((0, 0), dtype=np.float32), record)
        write_json(timing_path, record)
        return record
    image, result = time_nbsim(job.args, device, resolve_dtype(job.dtype), job.compile, job.warmup,
                               job.repeats, overrides=job.overrides)
    record.update(status="ok", timing=asdict(result), device_name=result.gpu or result.cpu)
    write_store(store, image, record)
    write_json(timing_path, record)
    return record


def build_kernel(job: KernelJob, threads: int, compile_cache: str, marker: Path) -> dict:
    """Build (or find in the shared cache) the ahead-of-time kernels of one structure; the marker JSON
    records each stage's build time and whether the cache already held it. Kernel jobs run in parallel
    before the timed jobs, which then start warm."""
    import socket

    from .cache import configure_compile_cache
    from .cpu import cpu_name
    from .devices import resolve_device, resolve_dtype
    from .kernel.backends import Structure, ensure_packages

    _use_job_resources(compile_cache, threads)
    configure_compile_cache()
    device, dtype = resolve_device(job.device), resolve_dtype(job.dtype)
    stages = [{"stage": variant.stage.function.__name__, "package": variant.package(dtype, device).name,
               "cache": "miss" if built else "hit", "build_s": seconds}
              for variant, built, seconds in ensure_packages(Structure.from_json(job.structure).stage_variants(),
                                                             dtype, device)]
    record = {**asdict(job), "stages": stages, "build_s": sum(s["build_s"] for s in stages),
              "host": socket.gethostname(), "cpu": cpu_name(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
              "versions": package_versions()}
    write_json(marker, record)
    return record


def run_reference(args: list[str], overrides: dict[str, Any], c_binary: str | None, compile: bool, warmup: int,
                  repeats: int, threads: int, compile_cache: str, store: Path, timing_path: Path) -> dict:
    """The reference image of a (scenario, size, extras) point: the C binary if configured, else
    nbsim in float64 on the CPU (compiled or eager). Timed the same way as the points."""
    import statistics

    import torch

    record: dict[str, Any] = {"args": args, "overrides": overrides, "versions": package_versions()}
    if c_binary:
        from .bench import run_c_reference

        if overrides:
            raise NbsimError(f"simulator options {sorted(overrides)} cannot be passed to the C reference; "
                             "sweep them as nanoBragg flags (names starting with '-') instead")
        os.environ["OMP_NUM_THREADS"] = str(max(1, threads))
        image, times = run_c_reference(c_binary, args, warmup, repeats)
        size = int(args[args.index("-detpixels") + 1])
        image = image.reshape(size, size)
        median_s = statistics.median(times)
        record.update(kind="c", binary=c_binary, threads=threads,
                      timing={"c_median_s": median_s, "c_times_s": times, "warm_median_s": median_s})
    else:
        from .bench import time_nbsim

        _use_job_resources(compile_cache, threads)
        image, result = time_nbsim(args, torch.device("cpu"), torch.float64, compile, warmup, repeats,
                                   overrides=overrides, output_dtype=torch.float64)
        record.update(kind="nbsim-float64-cpu", timing=asdict(result))
    write_store(store, image, record)
    write_json(timing_path, record)
    return record


def compare_images(image: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """Correlation, maximum absolute and relative error, and sum ratio of an image to its reference."""
    from .bench import correlation

    image = image.astype(np.float64)
    reference = reference.astype(np.float64)
    scale = float(np.abs(reference).max()) or 1.0
    difference = np.abs(image - reference)
    return {"correlation": correlation(image, reference), "max_abs_error": float(difference.max()),
            "max_rel_error": float(difference.max()) / scale,
            "sum_ratio": float(image.sum() / reference.sum()) if reference.sum() != 0 else math.nan,
            "finite": bool(np.isfinite(image).all())}


def compare_point(store: Path, reference_store: Path, output: Path) -> dict:
    point = read_store(store)
    if point.attrs.get("status") == "skipped":
        payload = {"status": "skipped", "reason": point.attrs.get("reason")}
    else:
        reference = read_store(reference_store)
        payload = {"status": "ok", **compare_images(point["image"].values, reference["image"].values)}
    write_json(output, payload)
    return payload


def run_logged(log_path: str | Path, work, *args) -> None:
    """Run one job's work with stdout/stderr in its log; a bad input ends it with a one-line reason
    (in the log and on the real stderr) and exit status 1 instead of a traceback."""
    real_stderr = sys.stderr
    with open(log_path, "w") as log:
        sys.stdout = sys.stderr = log
        try:
            work(*args)
        except NbsimError as error:
            message = f"nbsim: error: {error}"
            print(message, file=log)
            print(message, file=real_stderr)
            log.flush()
            sys.exit(1)
        finally:
            sys.stdout, sys.stderr = sys.__stdout__, real_stderr
