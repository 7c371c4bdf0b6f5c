"""Configuration validation, the sweep's points, and the parameters each job receives."""

import re
from dataclasses import asdict
from pathlib import Path

import sys

from nbsim import sweep
from nbsim.errors import NbsimError


CONFIG_BASE = (
    Path(workflow.overwrite_configfiles[-1]).resolve().parent
    if workflow.overwrite_configfiles
    else Path(workflow.basedir) / "config"
)
try:
    sweep.validate_config(config, workflow.source_path("../schemas/config.schema.yaml"), CONFIG_BASE)
except NbsimError as error:
    print(f"nbsim: invalid sweep configuration: {error}", file=sys.stderr)
    sys.exit(1)

RESULTS = config["results"]
TIMING = config["timing"]
COMPILE_CACHE = str(Path(config["compile_cache"]).resolve())
C_BINARY = sweep.c_binary_path(config, CONFIG_BASE)
POINTS = {(p.scenario, p.name): p for p in sweep.sweep_points(config)}
REFERENCES = {(p.scenario, p.reference_name): p for p in sweep.reference_points(list(POINTS.values()))}
COMPILED_NBSIM_REFERENCE = not C_BINARY and config["reference"]["compile"]
# One kernel job per (structure, dtype, device): points of any size and value share it.
KERNELS, KERNEL_OF_POINT = sweep.kernel_jobs(config, list(POINTS.values()), COMPILED_NBSIM_REFERENCE, CONFIG_BASE)
AXES = [*sweep.AXES, *sorted(config["sweep"].get("extra") or {})]


wildcard_constraints:
    scenario="|".join(re.escape(s) for s in config["scenarios"]),
    point=r"[A-Za-z0-9._-]+",
    refpoint=r"[A-Za-z0-9._-]+",
    kernel=r"[A-Za-z0-9._-]+",


def point_of(wildcards):
    return POINTS[(wildcards.scenario, wildcards.point)]


def point_job(wildcards):
    """The simulate job's parameters (a plain dict, so a change re-runs exactly the affected points)."""
    point = point_of(wildcards)
    args, overrides = sweep.point_arguments(config, point, CONFIG_BASE)
    return dict(
        scenario=point.scenario,
        point=point.name,
        args=args,
        overrides=overrides,
        dtype=point.dtype,
        device=point.device,
        compile=point.compile,
        warmup=TIMING["warmup"],
        repeats=TIMING["repeats"],
        threads=TIMING["threads"],
        compile_cache=COMPILE_CACHE,
        on_unavailable_device=config["sweep"]["on_unavailable_device"],
        extras=dict(point.extras),
    )


def kernel_job(wildcards):
    return dict(job=asdict(KERNELS[wildcards.kernel]), compile_cache=COMPILE_CACHE)


def kernel_marker(point):
    return f"{RESULTS}/kernels/{KERNEL_OF_POINT[point]}.json"


def point_kernel(wildcards):
    """A compiled CPU point waits for its kernel, built by a parallel `kernel` job."""
    point = point_of(wildcards)
    return [kernel_marker(point)] if point.prebuilds_kernel else []


def reference_kernel(wildcards):
    if not COMPILED_NBSIM_REFERENCE:
        return []
    point = REFERENCES[(wildcards.scenario, wildcards.refpoint)]
    return [kernel_marker(sweep.nbsim_reference_point(point))]


def reference_job(wildcards):
    point = REFERENCES[(wildcards.scenario, wildcards.refpoint)]
    args, overrides = sweep.point_arguments(config, point, CONFIG_BASE)
    return dict(
        args=args,
        overrides=overrides,
        c_binary=C_BINARY,
        compile=config["reference"]["compile"],
        warmup=TIMING["warmup"],
        repeats=TIMING["repeats"],
        threads=TIMING["threads"],
        compile_cache=COMPILE_CACHE,
    )


def reference_store(wildcards):
    point = point_of(wildcards)
    return f"{RESULTS}/{wildcards.scenario}/reference/{point.reference_name}/image.zarr"


def uses_gpu(wildcards):
    return 1 if point_of(wildcards).device.startswith("cuda") else 0


SLURM = config["slurm"]


def slurm_partition(wildcards):
    """GPU points go to slurm.gpu_partition, the rest to slurm.partition ("" = the cluster's default)."""
    if "point" in wildcards.keys() and uses_gpu(wildcards):
        return SLURM["gpu_partition"] or SLURM["partition"] or ""
    return SLURM["partition"] or ""


def scenario_points(scenario):
    return [p for (s, _), p in POINTS.items() if s == scenario]


def point_files(scenario, name):
    return [f"{RESULTS}/{scenario}/points/{p.name}/{name}" for p in scenario_points(scenario)]


def reference_timings(wildcards):
    return {
        p.name: f"{RESULTS}/{wildcards.scenario}/reference/{p.reference_name}/timing.json"
        for p in scenario_points(wildcards.scenario)
    }


def all_outputs():
    outputs = []
    for scenario in config["scenarios"]:
        outputs += [
            f"{RESULTS}/{scenario}/tables/timing.csv",
            f"{RESULTS}/{scenario}/tables/timing.md",
            f"{RESULTS}/{scenario}/tables/correlation.csv",
            f"{RESULTS}/{scenario}/tables/correlation.md",
            f"{RESULTS}/{scenario}/sweep.zarr",
            f"{RESULTS}/{scenario}/plots/speedup.png",
            f"{RESULTS}/{scenario}/plots/warm_time.png",
            f"{RESULTS}/{scenario}/plots/previews.png",
        ]
    return outputs
