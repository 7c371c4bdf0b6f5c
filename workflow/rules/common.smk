"""Configuration validation, the sweep's plan (points, batches, kernel jobs), and the parameters each job
receives: a batch job gets its points' PointSpecs (nbsim.sweep.spec), each parsed once here."""

import os
import re
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

from nbsim.errors import NbsimError
from nbsim.modes import Compile
from nbsim.sweep import batching, plan, validate
from nbsim.sweep.fitting import FitJob, fit_chunks
from nbsim.sweep.merging import MERGE_FILES, MERGE_OUTPUTS, merge_counts, merge_experiments
from nbsim.sweep.spec import BatchJob
from snakemake.exceptions import WorkflowError


CONFIG_BASE = (
    Path(workflow.overwrite_configfiles[-1]).resolve().parent
    if workflow.overwrite_configfiles
    else Path(workflow.basedir) / "config"
)
# Validation, the kernel jobs and every batch's specs build each point once, into this one memo.
BUILDS = plan.PointBuilds()
try:
    # Devices are checked where the jobs are planned, not again inside a job on a cluster node.
    POINTS = validate.validate_config(config, workflow.source_path("../schemas/config.schema.yaml"), CONFIG_BASE,
                                      devices=workflow.is_main_process, builds=BUILDS)
except NbsimError as error:
    print(f"nbsim: invalid sweep configuration: {error}", file=sys.stderr)
    sys.exit(1)

RESULTS = config["results"]
TIMING = config["timing"]
# Timed batches hold the one timing slot; with repeats 0 (a dataset: each point rendered once, nothing
# timed) they run side by side on the cores.
TIMING_SLOT = 1 if TIMING["repeats"] > 0 else 0
COMPILE_CACHE = plan.compile_cache_path(config)
C_BINARY = plan.c_binary_path(config, CONFIG_BASE)
# reference: false (a dataset): no reference renders, no comparison, no correlation tables.
REFERENCE = config["reference"] is not False
COMPILED_NBSIM_REFERENCE = REFERENCE and not C_BINARY and config["reference"]["compile"]


def available_cores():
    """The cores this run may use: --cores, at most this machine's."""
    try:
        return min(int(workflow.cores), os.cpu_count() or 1)
    except (WorkflowError, TypeError):  # no --cores (a cluster run): this machine's
        return os.cpu_count() or 1


def parallel_jobs():
    """Batch jobs that run at once here: the cores over each job's threads (side by side), or one (timed
    jobs hold the timing slot)."""
    return max(1, available_cores() // TIMING["threads"]) if TIMING_SLOT == 0 else 1


with plan.structure_memo(Path(".snakemake") / "nbsim-structures.json") as memo:
    renders = 1 + (TIMING["warmup"] + TIMING["repeats"] if TIMING["every_point"] else 0)
    BATCH_SIZE = config["sweep"].get("batch_size") or batching.kept_batch_sizes(
        Path(".snakemake") / "nbsim-batch-sizes.json", config, workflow.is_main_process,
        lambda: batching.batch_sizes(config, POINTS, CONFIG_BASE, memo, batching.Timing(renders, TIMING["threads"]),
                                     parallel_jobs(), REFERENCE))
    PLAN = plan.plan_sweep(POINTS, BATCH_SIZE)
    # One kernel job per (structure, dtype, device): points of any size and value share it.
    KERNELS, KERNEL_OF_POINT = plan.kernel_jobs(config, POINTS, COMPILED_NBSIM_REFERENCE, CONFIG_BASE, memo,
                                                BUILDS)
# Two threads a kernel job where the cores give every kernel job two: its package builds then have beside
# them the just-in-time compile that a package refused on this machine needs (nbsim.sweep.jobs.build_kernel).
KERNEL_THREADS = 2 if available_cores() >= 2 * len(KERNELS) else 1
AXES = plan.sweep_axes(config)
# fit: (docs/sweeps.md, "Fitting every shot"): each batch's shots fitted in chunks, one fit job each.
FIT = config.get("fit")
FIT_CHUNKS = (
    {key: dict(fit_chunks(batch, FIT["batch_size"])) for key, batch in PLAN.batches.items()} if FIT else {}
)
# merge: (docs/sweeps.md, "Merging a dataset"): each experiment's inputs for nbsim merge.
MERGE = config.get("merge")
MERGE_EXPERIMENTS = merge_experiments(PLAN) if MERGE else {}
# merge.run: each experiment merged from each of its shot counts, the pipeline's last rule.
MERGE_RUNS = (
    {key: merge_counts(MERGE, len(names)) for key, names in MERGE_EXPERIMENTS.items()}
    if MERGE and MERGE["run"]
    else {}
)
DRAWN_KEYS = sorted((config["sweep"].get("draws") or {}).get("values") or {})


wildcard_constraints:
    scenario="|".join(re.escape(s) for s in config["scenarios"]),
    batch=r"[A-Za-z0-9._-]+",
    kernel=r"[A-Za-z0-9._-]+",
    chunk=r"f[0-9]+",
    experiment=r"[A-Za-z0-9._-]+",


def batch_of(wildcards):
    return PLAN.batches[(wildcards.scenario, wildcards.batch)]


def reference_batch_of(wildcards):
    return PLAN.references[(wildcards.scenario, wildcards.batch)]


def timing_params():
    return dict(warmup=TIMING["warmup"], repeats=TIMING["repeats"], threads=TIMING["threads"],
                every_point=TIMING["every_point"], compile_cache=COMPILE_CACHE)


def batch_job(wildcards):
    """The simulate job's parameters: its points' specs in order and how to time them (plain data, so a
    changed value re-runs exactly the batch holding it)."""
    batch = batch_of(wildcards)
    first = batch.points[0]
    specs = tuple(plan.point_spec(config, p, CONFIG_BASE, KERNEL_OF_POINT, builds=BUILDS) for p in batch.points)
    return BatchJob(scenario=batch.scenario, batch=batch.name, points=specs, dtype=first.dtype, device=first.device,
                    compile=first.compile, on_unavailable_device=config["sweep"]["on_unavailable_device"],
                    detector="detector" in config["sweep"], **timing_params()).to_dict()


def reference_job(wildcards):
    """The reference job's parameters: nbsim in float64 on the CPU (or the C binary) for each point."""
    batch = reference_batch_of(wildcards)
    specs = tuple(plan.point_spec(config, p, CONFIG_BASE, KERNEL_OF_POINT, as_reference=True, builds=BUILDS)
                  for p in batch.points)
    return BatchJob(scenario=batch.scenario, batch=batch.name, points=specs, dtype="float64", device="cpu",
                    compile=Compile.of(config["reference"]["compile"]), c_binary=C_BINARY, is_reference=True,
                    **timing_params()).to_dict()


def kernel_job(wildcards):
    return dict(job=asdict(KERNELS[wildcards.kernel]), compile_cache=COMPILE_CACHE)


def kernel_markers(points):
    return sorted({f"{RESULTS}/kernels/{KERNEL_OF_POINT[p]}.json" for p in points if p in KERNEL_OF_POINT})


def batch_kernels(wildcards):
    """A batch of compiled points waits for its kernels, made ready by parallel `kernel` jobs."""
    return kernel_markers(batch_of(wildcards).points)


def reference_kernels(wildcards):
    if not COMPILED_NBSIM_REFERENCE:
        return []
    return kernel_markers([plan.nbsim_reference_point(p) for p in reference_batch_of(wildcards).points])


def reference_records_of_batch(wildcards):
    """A point batch waits for its reference batch (none with reference: false)."""
    if not REFERENCE:
        return []
    return f"{RESULTS}/{wildcards.scenario}/references/{batch_of(wildcards).reference}/records.json"


def batch_store(wildcards, kind="batches"):
    """A batch's image store: filled point by point and resumed by a rerun, so it is no declared output
    (Snakemake would delete it before the rerun); its records.json, written last, is the output."""
    return f"{RESULTS}/{wildcards.scenario}/{kind}/{wildcards.batch}/images.zarr"


def batch_summary(wildcards):
    """What a batch holds, shown by --dry-run and in the log of a run."""
    points = batch_of(wildcards).points
    return f"{len(points)} points, {points[0].name} .. {points[-1].name}"


def reference_summary(wildcards):
    points = reference_batch_of(wildcards).points
    return f"{len(points)} references, {points[0].reference_name} .. {points[-1].reference_name}"


def uses_gpu(wildcards):
    return 1 if batch_of(wildcards).points[0].device.startswith("cuda") else 0


SLURM = config["slurm"]


def slurm_partition(wildcards):
    """GPU batches go to slurm.gpu_partition, the rest to slurm.partition ("" = the cluster's default)."""
    if "batch" in wildcards.keys() and (wildcards.scenario, wildcards.batch) in PLAN.batches and uses_gpu(wildcards):
        return SLURM["gpu_partition"] or SLURM["partition"] or ""
    return SLURM["partition"] or ""


def batch_files(wildcards, name):
    return [f"{RESULTS}/{wildcards.scenario}/batches/{b.name}/{name}" for b in PLAN.scenario_batches(wildcards.scenario)]


def reference_records(wildcards):
    if not REFERENCE:
        return []
    return [f"{RESULTS}/{wildcards.scenario}/references/{b.name}/records.json"
            for b in PLAN.scenario_references(wildcards.scenario)]


def fit_job(wildcards):
    """The fit job's parameters: its shots' specs (as their batch rendered them) and the `fit:` block."""
    points = FIT_CHUNKS[(wildcards.scenario, wildcards.batch)][wildcards.chunk]
    specs = tuple(plan.point_spec(config, p, CONFIG_BASE, KERNEL_OF_POINT) for p in points)
    return FitJob(scenario=wildcards.scenario, batch=wildcards.batch, chunk=wildcards.chunk, points=specs,
                  settings=FIT, detector="detector" in config["sweep"]).to_dict()


def fit_summary(wildcards):
    points = FIT_CHUNKS[(wildcards.scenario, wildcards.batch)][wildcards.chunk]
    return f"{len(points)} shots, {points[0].name} .. {points[-1].name}"


def fit_files(wildcards):
    """A scenario's fit jobs' outputs (none without a `fit:` section)."""
    return [f"{RESULTS}/{wildcards.scenario}/fits/{batch}/{chunk}.json"
            for (scenario, batch), chunks in FIT_CHUNKS.items() if scenario == wildcards.scenario
            for chunk in chunks]


def merge_files(wildcards):
    """A scenario's merges' JSON (none without a `merge:` section that runs them)."""
    return [f"{RESULTS}/{wildcards.scenario}/merge/{experiment}/shots_{count}/merged.json"
            for (scenario, experiment), counts in MERGE_RUNS.items() if scenario == wildcards.scenario
            for count in counts]


def collate_outputs():
    """Timing tables and the collated store; correlation tables with a reference, labels with draws."""
    outputs = dict(
        timing_csv=report(
            f"{RESULTS}/{{scenario}}/tables/timing.csv",
            caption="../report/timing.rst",
            category="{scenario}",
            subcategory="tables",
        ),
        timing_md=f"{RESULTS}/{{scenario}}/tables/timing.md",
        timing_html=report(
            f"{RESULTS}/{{scenario}}/tables/timing.html",
            caption="../report/timing.rst",
            category="{scenario}",
            subcategory="tables",
        ),
        store=directory(f"{RESULTS}/{{scenario}}/sweep.zarr"),
    )
    if REFERENCE:
        outputs.update(
            correlation_csv=report(
                f"{RESULTS}/{{scenario}}/tables/correlation.csv",
                caption="../report/correlation.rst",
                category="{scenario}",
                subcategory="tables",
            ),
            correlation_md=f"{RESULTS}/{{scenario}}/tables/correlation.md",
            correlation_html=report(
                f"{RESULTS}/{{scenario}}/tables/correlation.html",
                caption="../report/correlation.rst",
                category="{scenario}",
                subcategory="tables",
            ),
        )
    if "draws" in config["sweep"]:
        outputs.update(labels_csv=f"{RESULTS}/{{scenario}}/tables/labels.csv")
    return outputs


def batch_stores(wildcards):
    return [str(Path(p).with_name("images.zarr")) for p in batch_files(wildcards, "records.json")]


def records_by_scenario():
    """Each scenario's batch and reference records, for the front page's summary."""
    by_scenario = {}
    for scenario in config["scenarios"]:
        wildcards = SimpleNamespace(scenario=scenario)
        by_scenario[scenario] = {"records": batch_files(wildcards, "records.json"),
                                 "references": reference_records(wildcards)}
    return by_scenario


def all_records(wildcards):
    return [path for paths in records_by_scenario().values() for path in paths["records"]]


def all_reference_records(wildcards):
    return [path for paths in records_by_scenario().values() for path in paths["references"]]


def all_outputs():
    outputs = [f"{RESULTS}/summary.rst", f"{RESULTS}/summary.csv", f"{RESULTS}/summary.html"]
    for scenario in config["scenarios"]:
        outputs += [
            f"{RESULTS}/{scenario}/tables/timing.csv",
            f"{RESULTS}/{scenario}/tables/timing.md",
            f"{RESULTS}/{scenario}/tables/timing.html",
            *([f"{RESULTS}/{scenario}/tables/correlation.csv", f"{RESULTS}/{scenario}/tables/correlation.md",
               f"{RESULTS}/{scenario}/tables/correlation.html"] if REFERENCE else []),
            *([f"{RESULTS}/{scenario}/tables/labels.csv"] if "draws" in config["sweep"] else []),
            f"{RESULTS}/{scenario}/sweep.zarr",
            f"{RESULTS}/{scenario}/plots/speedup.png",
            f"{RESULTS}/{scenario}/plots/warm_time.png",
            f"{RESULTS}/{scenario}/plots/previews.png",
            *([f"{RESULTS}/{scenario}/tables/fit.csv", f"{RESULTS}/{scenario}/plots/fit_errors.png"] if FIT else []),
            *(f"{RESULTS}/{scenario}/merge/{experiment}/{name}"
              for (owner, experiment) in MERGE_EXPERIMENTS if owner == scenario for name in MERGE_FILES),
            *(f"{RESULTS}/{scenario}/merge/{experiment}/shots_{count}/{name}"
              for (owner, experiment), counts in MERGE_RUNS.items() if owner == scenario
              for count in counts for name in MERGE_OUTPUTS),
            *([f"{RESULTS}/{scenario}/tables/merge.csv"] if MERGE_RUNS else []),
        ]
    return outputs
