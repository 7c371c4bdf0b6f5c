"""The GPU campaign: everything nbsim measures on a lent CUDA machine, in one call of a few minutes.

    bash benchmarks/gpu_campaign.sh [--cpu] [--c-binary PATH] [--out DIR] [--budget-s S] [--only STEP ...]

Steps, in order of what matters most when time runs short (a step that fails is recorded and the next one
runs):

- `environment`: the card, driver, Python, PyTorch, cores (nvidia-smi, torch).
- `sweep`: the seeds' matrix through the Snakemake sweep (256², 1024², 2048², 4096² × float32/float64 ×
  devices cpu and cuda, cold and warm, the CPU timed on the same machine's cores), against the C when
  given, else against nbsim's float64 on the CPU. First its kernel jobs alone, in parallel: the CPU's
  ahead-of-time packages built and probed, and the just-in-time compile warmed wherever the timed jobs will
  compile (every CUDA point, and a CPU point whose package this machine refuses), so that no timed job
  compiles; then the timed jobs, one at a time, the larger half of the sizes first (`--prioritize`), so that
  a sweep cut short still has the headline rows (4096² and 2048², CUDA and CPU). The correlation of each
  CUDA image with the CPU image of the same size and dtype is read from the batches' stores.
- `bench`: `nbsim bench --device cuda` on the seed image at 4096² in float32 (with the C beside it when
  `--c-binary` is given): the headline figure, 4096² float32 warm ≤ 1 ms (its kernel warmed by the sweep).
- `fit`: `fit_still` and `fit_gradient` (benchmarks/fit_workloads.py) on the device.
- `merge`: the merge benchmark on the device where the benchmarks define one (`merge_sad`), at its `--quick`
  size (20 shots of 128², 5 spectrum channels, one cycle; the record says so): its full size does not fit.
- `cpu_fits`: the suite's fit-convergence tests (`CONVERGENCE_TESTS`) on this machine's own processor, CUDA
  hidden: the fits that once stalled on an Intel Xeon (issue 41), run where a lent machine offers another
  processor than the development machine's; the record names the processor.
- `pytest`: `pytest -m cuda` over the test files that hold CUDA tests (passed on the H100 before; the
  sweep's CUDA-against-CPU correlations check the same kernels).

Time: each step may use what is left of `--budget-s` less what the steps after it reserve (`STEP_SHARES`
of the budget each), so a step that overruns cannot take the later steps' time and a step that finishes
early leaves its time to the next; none starts once the budget is spent. A step's command that reaches its
limit is stopped with all its processes (Snakemake's jobs included).

Everything lands under `--out` (default `$OUT`, else results/gpu_campaign): `summary.md` (the tables for
docs/benchmarks.md), `summary.json`, `campaign.log` and `campaign.tar.gz` (every step's log and JSON,
the sweep's tables; not its images). With `--cpu` the same steps run at small sizes on the CPU, so a
machine without a GPU checks everything but the device. A Python package the steps need and the machine
lacks stops the campaign before any step, in one line; `bash benchmarks/gpu_campaign.sh` first installs
what the git-ignored `wheelhouse/` (`make wheelhouse`) holds and the machine lacks.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SEED_ARGS = "-default_F 100 -cell 100 100 100 90 90 90 -lambda 6.2 -N 5 -distance 100"
"""The seeds' benchmark image (benchmarks/workloads.py's SEED_ARGS, as the sweep's scenario string)."""
REQUIRED_MODULES = ("torch", "numpy", "scipy", "yaml", "psutil", "gemmi", "fabio", "h5py", "cfelpyutils",
                    "snakemake", "zarr", "xarray", "pandas", "jsonschema", "matplotlib", "pytest")
"""What the steps import (nbsim's dependencies, its pipeline's, and pytest)."""
DTYPES = ("float32", "float64")
BUDGET_S = 480.0
"""The default time for all steps: with the wheelhouse's install and the archive, one device call of about 8
minutes (docs/benchmarks.md, "The GPU campaign")."""
STEPS = ("environment", "sweep", "bench", "fit", "merge", "cpu_fits", "pytest")
STEP_SHARES = {"environment": 0.02, "sweep": 0.53, "bench": 0.05, "fit": 0.12, "merge": 0.12, "cpu_fits": 0.1,
               "pytest": 0.06}
"""Each step's reserve, as a share of the budget: what the steps before it leave it at least (docs/benchmarks.md,
"The GPU campaign", has the estimates for the H100 machine)."""
KERNEL_STEP_SHARE = 0.55
"""The share of the sweep's time its kernel jobs may take (the timed jobs get the rest)."""
CONVERGENCE_TESTS = (
    "tests/test_fit.py::test_the_model_reaches_one_optimum_from_every_start_in_its_basin",
    "tests/test_fit.py::test_fit_refines_n_and_the_geometry_from_starts_across_its_basin_as_the_image_samples_them",
    "tests/test_fit.py::test_nbsim_fit_recovers_a_protein_crystal_from_its_noise_image",
    "tests/test_gradients.py::test_refinement_example_converges")
"""The fits whose convergence depended on the processor (issue 41): the model and `fit` from starts across their
basin (several seeds, dtypes and thread counts), the README's crystal (one sample a pixel) and
docs/examples/refine_geometry.py."""
MERGE_ARGUMENTS = ("--quick", "--no-dials")
"""The merge benchmark's size on every campaign: 20 shots of 128², 5 channels, one cycle, without the DIALS
route (absent on the lent machines); at its full size (1,000 shots) it did not fit the time left."""


@dataclass(frozen=True)
class Plan:
    """Sizes and devices of one campaign: the device's, or the CPU's small stand-in (`--cpu`)."""

    device: str
    sizes: tuple[int, ...]
    bench_size: int
    fit_quick: bool
    repeats: int

    @classmethod
    def of(cls, cpu_only: bool) -> Plan:
        if cpu_only:
            return cls("cpu", (64, 128), 128, True, 3)
        return cls("cuda", (256, 1024, 2048, 4096), 4096, False, 10)

    @property
    def sweep_devices(self) -> list[str]:
        return ["cpu"] if self.device == "cpu" else ["cpu", "cuda"]


@dataclass
class StepRecord:
    """What one step did: its status ('ok', 'failed', 'timed out', 'skipped: ...'), seconds and results."""

    name: str
    status: str = "not run"
    seconds: float = 0.0
    results: dict = field(default_factory=dict)


class Campaign:
    """Runs the steps under one time budget, logging every command and its output."""

    def __init__(self, options: argparse.Namespace, plan: Plan, work: Path):
        self.options, self.plan, self.work = options, plan, work
        self.started = time.monotonic()
        self.step_ends = math.inf
        self.log_path = work / "campaign.log"
        self.cache = Path(os.environ.get("NBSIM_CACHE_DIR") or work / "compile-cache")
        """The kernel cache of every step (an NBSIM_CACHE_DIR already set is kept)."""
        self.environment = os.environ | {
            "NBSIM_CACHE_DIR": str(self.cache), "NBSIM_WORKER": "off", "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}

    def remaining_s(self) -> float:
        return self.options.budget_s - (time.monotonic() - self.started)

    def start_step(self, name: str) -> None:
        """Begin step `name`: it may take the time left less the reserves of the selected steps after it."""
        later = STEPS[STEPS.index(name) + 1:]
        reserved_s = sum(STEP_SHARES[step] * self.options.budget_s for step in later if step in self.options.only)
        self.step_ends = time.monotonic() + self.remaining_s() - reserved_s

    def time_left_s(self) -> float:
        """What the current step has left."""
        return min(self.remaining_s(), self.step_ends - time.monotonic())

    def say(self, text: str) -> None:
        line = f"[{time.monotonic() - self.started:6.1f} s] {text}"
        print(line, flush=True)
        with self.log_path.open("a") as log:
            log.write(line + "\n")

    def command(self, argv: list[str], limit_s: float, log_name: str, cwd: Path = REPO,
                environment: dict[str, str] | None = None) -> tuple[str, str]:
        """Run `argv` for at most `limit_s` seconds (and never past the budget), stopped at the limit with every
        process under it (a Snakemake run's jobs), with `environment` on top of the campaign's; its status and
        output."""
        limit_s = max(1.0, min(limit_s, self.time_left_s()))
        self.say(f"$ {' '.join(argv)}  (limit {limit_s:.0f} s)")
        with subprocess.Popen(argv, cwd=cwd, env=self.environment | (environment or {}), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) as process:
            try:
                output, _ = process.communicate(timeout=limit_s)
                status = "ok" if process.returncode == 0 else f"failed (exit {process.returncode})"
            except subprocess.TimeoutExpired:
                status = f"timed out after {limit_s:.0f} s"
                output = _stopped(process)
        (self.work / "logs").mkdir(exist_ok=True)
        (self.work / "logs" / f"{log_name}.log").write_text(output)
        if status != "ok":
            tail = "\n".join(output.strip().splitlines()[-15:])
            self.say(f"{log_name}: {status}; its output ends:\n{tail}")
        return status, output


def _stopped(process: subprocess.Popen) -> str:
    """Stop a command and every process under it (Snakemake's jobs and theirs): SIGTERM, then SIGKILL to what is
    left after 10 s; what it printed."""
    from nbsim.sweep.jobs import stop_process_tree

    stop_process_tree(process.pid, grace_s=10.0)
    return process.communicate()[0] or ""


def missing_modules(names: tuple[str, ...]) -> list[str]:
    """The modules among `names` that this Python cannot import."""
    return [name for name in names if importlib.util.find_spec(name) is None]


def install_wheelhouse(wheelhouse: Path, site: Path) -> list[str]:
    """Install, offline into `site`, each wheel of `wheelhouse` whose distribution this Python lacks;
    the names installed."""
    importlib.invalidate_caches()
    missing = []
    for wheel in sorted(wheelhouse.glob("*.whl")):
        name = wheel.name.split("-")[0]
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(wheel)
    if missing:
        completed = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                                    "--no-compile", "--no-cache-dir", "--disable-pip-version-check", "--target",
                                    str(site), *map(str, missing)], capture_output=True, text=True)
        if completed.returncode != 0:
            reason = (completed.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise WheelhouseError(f"the wheels of {wheelhouse} do not install on Python "
                                  f"{platform.python_version()} ({reason}); rebuild them for it: make wheelhouse "
                                  "DEVICE_PYTHON=<that Python>")
    return [wheel.name.split("-")[0] for wheel in missing]


class WheelhouseError(Exception):
    """Wheels that this Python cannot install (built for another version or platform)."""


def last_json_line(output: str) -> dict | None:
    """The last line of `output` that is a JSON object (how nbsim bench and the fit workloads report)."""
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def step_environment(campaign: Campaign) -> dict:
    import torch

    from nbsim.cpu import cpu_name

    found = {"python": platform.python_version(), "torch": torch.__version__, "cores": os.cpu_count(),
             "cpu": cpu_name(), "cuda_available": torch.cuda.is_available(), "c_binary": campaign.options.c_binary}
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        found |= {"gpu": properties.name, "gpu_memory_gib": round(properties.total_memory / 2**30, 1),
                  "multiprocessors": properties.multi_processor_count, "cuda": torch.version.cuda}
    if shutil.which("nvidia-smi"):
        status, output = campaign.command(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                           "--format=csv,noheader"], 30, "nvidia-smi")
        found["nvidia_smi"] = output.strip() if status == "ok" else status
    return found


def step_bench(campaign: Campaign) -> dict:
    """`nbsim bench` on the device, seed image in float32 (the C beside it when given); the sweep measures both
    dtypes."""
    results, failures = {}, []
    for dtype in ("float32",):
        argv = [sys.executable, "-m", "nbsim.cli", "bench", "--device", campaign.plan.device, "--dtype", dtype,
                "--repeats", str(campaign.plan.repeats), "--warmup", "2"]
        if campaign.options.c_binary:
            argv += ["--c-binary", campaign.options.c_binary]
        argv += ["--", *SEED_ARGS.split(), "-detpixels", str(campaign.plan.bench_size)]
        status, output = campaign.command(argv, math.inf, f"bench-{dtype}")
        record = last_json_line(output) if status == "ok" else None
        if record is None:
            failures.append(f"{dtype}: {status}")
            continue
        results[dtype] = record
        campaign.say(f"bench {dtype} {campaign.plan.bench_size}²: cold {record['cold_s']:.2f} s, warm median "
                     f"{record['warm_median_s'] * 1e3:.3f} ms" + (f", C {record['c_median_s']:.3f} s, speedup "
                     f"{record['speedup']:.0f}x, r {record['correlation']:.9f}" if record.get("speedup") else ""))
    if failures:
        raise StepFailed("; ".join(failures), results)
    return results


class StepFailed(Exception):
    """A step that ran but did not succeed; carries what it measured before it failed."""

    def __init__(self, message: str, results: dict | None = None):
        super().__init__(message)
        self.results = results or {}


def sweep_config(campaign: Campaign) -> dict:
    """The seeds' matrix as a sweep configuration (config/config.yaml's format)."""
    threads = os.cpu_count() or 1
    return {
        "results": str(campaign.work / "sweep"),
        "compile_cache": str(campaign.cache),
        "scenarios": {"seed": {"description": "The seeds' benchmark", "args": SEED_ARGS}},
        "sweep": {"sizes": list(campaign.plan.sizes), "dtypes": list(DTYPES),
                  "devices": campaign.plan.sweep_devices, "compile": ["on"], "extra": {},
                  "on_unavailable_device": "fail"},
        "timing": {"warmup": 2, "repeats": campaign.plan.repeats, "threads": threads},
        "reference": {"c_binary": campaign.options.c_binary, "compile": campaign.options.c_binary is None},
    }


def step_sweep(campaign: Campaign) -> dict:
    import yaml

    config_path = campaign.work / "sweep-config.yaml"
    config_path.write_text(yaml.safe_dump(sweep_config(campaign), sort_keys=False))
    results = campaign.work / "sweep"
    snakemake = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--workflow-profile",
                 str(REPO / "workflow" / "profiles" / "default"), "--configfile", str(config_path),
                 "--cores", str(os.cpu_count() or 1), "--scheduler", "greedy", "--keep-going"]
    # The kernel jobs first, alone: their builds and compiles would otherwise share the cores with timed jobs.
    # The timed jobs run whatever the kernel step came to (a point whose kernel is not ready compiles it in
    # its own untimed first render), the largest size first, and only as far as the tables (no plots).
    kernels, _ = campaign.command([*snakemake, "--until", "kernel"], KERNEL_STEP_SHARE * campaign.time_left_s(),
                                  "sweep-kernels")
    headline = [str(results / "seed" / "batches" / name / "records.json") for name in headline_batches(campaign.plan)]
    status, _ = campaign.command([*snakemake, str(results / "seed" / "tables" / "timing.csv"), "--prioritize",
                                  *headline], math.inf, "sweep")
    result = {"kernels": kernel_markers(results / "kernels"), "rows": sweep_rows(results / "seed")}
    if status != "ok" or kernels != "ok":
        raise StepFailed(f"snakemake: kernel jobs {kernels}, timed jobs {status}", result)
    return result


def headline_batches(plan: Plan) -> list[str]:
    """The batches of the larger half of the sizes (every dtype and device): what the sweep times first."""
    from nbsim.modes import Compile
    from nbsim.sweep.plan import Point, plan_sweep

    sizes = sorted(plan.sizes)[len(plan.sizes) // 2:]
    points = [Point("seed", size, dtype, device, Compile.ON) for size in reversed(sizes) for dtype in DTYPES
              for device in plan.sweep_devices]
    return [batch.name for batch in plan_sweep(points, 1).batches.values()]


def kernel_markers(folder: Path) -> list[dict]:
    """What each kernel job did (nbsim.sweep.jobs.build_kernel's marker): per stage, the path its points take
    and the seconds of its build, probe and warm-up."""
    keys = ("dtype", "device", "mode", "status", "warm", "stages")
    return [{key: marker.get(key) for key in keys} | {"kernel": path.stem}
            for path in sorted(folder.glob("*.json")) for marker in [json.loads(path.read_text())]]


def sweep_rows(scenario: Path) -> list[dict]:
    """One row per point the sweep rendered (read from its batches' records, so that a sweep a job of which
    failed still reports the others): cold and warm, the kernel path it rendered with, its reference's time
    and the speedup, the correlation with the reference and, for a non-CPU point, with the CPU image of the
    same size and dtype."""
    from nbsim.sweep.collate import point_rows

    batches = sorted(scenario.glob("batches/*/records.json"))
    if not batches:
        return []
    rows = point_rows(batches, sorted(scenario.glob("references/*/records.json")))
    against_cpu = device_correlations(scenario, rows)
    keys = ("point", "size", "dtype", "device", "status", "mode", "compile_cache", "cold_s", "warm_median_s",
            "warm_min_s", "warm_max_s", "reference", "reference_median_s", "speedup", "speedup_min", "speedup_max",
            "threads", "correlation")
    table = [{key: row.get(key) for key in keys} | {"correlation_cpu": against_cpu.get(row["point"])} for row in rows]
    return sorted(table, key=lambda row: (int(row["size"]), row["dtype"], row["device"]))


def device_correlations(scenario: Path, rows: list[dict]) -> dict[str, float]:
    """Pearson correlation of each non-CPU point's image with the CPU image of the same size and dtype, by
    point, read from the batches' stores."""
    import numpy as np

    from nbsim.sweep.store import open_store_array

    def image(row: dict) -> np.ndarray:
        store = scenario / "batches" / row["batch"] / "images.zarr"
        return np.asarray(open_store_array(store, "image")[row["index"]], dtype=np.float64).ravel()

    rendered = [row for row in rows if row["status"] == "ok"]
    cpu = {(row["size"], row["dtype"]): row for row in rendered if row["device"] == "cpu"}
    found = {}
    for row in rendered:
        counterpart = cpu.get((row["size"], row["dtype"]))
        if row["device"] != "cpu" and counterpart is not None:
            other, reference = image(row), image(counterpart)
            if np.isfinite(other).all() and np.isfinite(reference).all():
                found[row["point"]] = float(np.corrcoef(other, reference)[0, 1])
    return found


def cuda_test_files() -> list[str]:
    """The test files that hold tests marked `cuda`."""
    return sorted(str(path.relative_to(REPO)) for path in (REPO / "tests").glob("test_*.py")
                  if "mark.cuda" in path.read_text())


def step_pytest(campaign: Campaign) -> dict:
    files = cuda_test_files()
    status, output = campaign.command([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
                                       "-o", "addopts=-ra", *files], math.inf, "pytest-cuda")
    closing = _pytest_summary(output)
    campaign.say(f"pytest -m cuda: {closing}")
    result = {"files": files, "summary": closing}
    if status != "ok":
        raise StepFailed(f"pytest: {status}", result)
    return result


def step_cpu_fits(campaign: Campaign) -> dict:
    """The convergence tests on this machine's processor (CUDA hidden), four at once where pytest-xdist is here."""
    from nbsim.cpu import cpu_name

    parallel = ["-n", "4"] if importlib.util.find_spec("xdist") else []
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra", *parallel,
            *CONVERGENCE_TESTS]
    status, output = campaign.command(argv, math.inf, "cpu-fits", environment={"CUDA_VISIBLE_DEVICES": ""})
    closing = _pytest_summary(output)
    cpu = cpu_name()
    campaign.say(f"convergence tests on {cpu}: {closing}")
    result = {"cpu": cpu, "cores": os.cpu_count(), "tests": list(CONVERGENCE_TESTS), "summary": closing}
    if status != "ok":
        raise StepFailed(f"cpu_fits: {status}", result)
    return result


def _pytest_summary(output: str) -> str:
    """pytest's closing line ("3 passed in 9.1s"), without its rule."""
    return next((line for line in reversed(output.strip().splitlines())
                 if re.search(r"passed|failed|skipped|error", line)), "").strip("= ")


def step_fit(campaign: Campaign) -> dict:
    results, failures = {}, []
    for name in ("fit_still", "fit_gradient"):
        argv = [sys.executable, str(REPO / "benchmarks" / "fit_workloads.py"), name, "--device", campaign.plan.device]
        if campaign.plan.fit_quick:
            argv.append("--quick")
        status, output = campaign.command(argv, math.inf, name)
        record = last_json_line(output) if status == "ok" else None
        if record is None:
            failures.append(f"{name}: {status}")
        else:
            results[name] = record
    if failures:
        raise StepFailed("; ".join(failures), results)
    return results


def step_merge(campaign: Campaign) -> dict:
    script = REPO / "benchmarks" / "merge_workloads.py"
    if not script.is_file():
        raise StepSkipped("no merge benchmark in this checkout (benchmarks/merge_workloads.py)")
    argv = [sys.executable, str(script), "merge_sad", "--device", campaign.plan.device, *MERGE_ARGUMENTS]
    status, output = campaign.command(argv, math.inf, "merge_sad")
    record = last_json_line(output) if status == "ok" else None
    if record is None:
        raise StepFailed(f"merge_sad: {status}")
    return {"merge_sad": record, "arguments": list(MERGE_ARGUMENTS)}


class StepSkipped(Exception):
    """A step with nothing to run here (said why)."""


STEP_FUNCTIONS = {"environment": step_environment, "bench": step_bench, "sweep": step_sweep, "pytest": step_pytest,
                  "fit": step_fit, "merge": step_merge, "cpu_fits": step_cpu_fits}


def run_step(campaign: Campaign, name: str) -> StepRecord:
    record = StepRecord(name)
    if campaign.remaining_s() < 5:
        record.status = "skipped: the time budget is spent"
        campaign.say(f"{name}: {record.status}")
        return record
    campaign.start_step(name)
    campaign.say(f"== {name} (may take {campaign.time_left_s():.0f} s)")
    begin = time.monotonic()
    try:
        record.results = STEP_FUNCTIONS[name](campaign)
        record.status = "ok"
    except StepSkipped as skipped:
        record.status = f"skipped: {skipped}"
    except StepFailed as failed:
        record.status, record.results = f"failed: {failed}", failed.results
    except Exception as error:  # a step's own bug must not cost the steps after it
        record.status = f"failed: {type(error).__name__}: {error}"
    record.seconds = time.monotonic() - begin
    campaign.say(f"{name}: {record.status} ({record.seconds:.0f} s)")
    return record


def _number(value, pattern: str) -> str:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return "-"
    return pattern.format(number) if math.isfinite(number) else "-"


def summary_markdown(environment: dict, records: dict[str, StepRecord], options: argparse.Namespace) -> str:
    """The campaign's tables as docs/benchmarks.md shows them."""
    card = environment.get("gpu") or "no GPU (CPU only)"
    lines = [f"# GPU campaign: {card}", "",
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; Python {environment.get('python')}, PyTorch "
             f"{environment.get('torch')}, {environment.get('cores')} cores ({environment.get('cpu')}); "
             f"nvidia-smi: {environment.get('nvidia_smi', 'n/a')}; C: "
             f"{'given' if options.c_binary else 'not given (references are nbsim float64 on the CPU)'}.", "",
             "| step | status | s |", "|---|---|---|"]
    lines += [f"| {name} | {record.status} | {record.seconds:.0f} |" for name, record in records.items()]
    bench = records.get("bench")
    if bench and bench.results:
        lines += ["", "`nbsim bench` on the seed image:", "",
                  "| dtype | device | pixels | cold s | warm median ms (min–max) | C s | speedup | r vs C |",
                  "|---|---|---|---|---|---|---|---|"]
        for dtype, result in bench.results.items():
            lines.append(
                f"| {dtype} | {result['device']} | {result['pixels']} | {result['cold_s']:.2f} | "
                f"{result['warm_median_s'] * 1e3:.3f} ({result['warm_min_s'] * 1e3:.3f}–"
                f"{result['warm_max_s'] * 1e3:.3f}) | {_number(result.get('c_median_s'), '{:.3f}')} | "
                f"{_number(result.get('speedup'), '{:.0f}x')} | "
                f"{_number(result.get('correlation'), '{:.10f}')} |")
    sweep = records.get("sweep")
    if sweep and sweep.results.get("kernels"):
        lines += ["", "The sweep's kernel jobs (before the timed jobs, in parallel; per stage: the path its points "
                      "take, and seconds):", "", "| kernel job | stage | path | build s | probe s | warm-up s |",
                  "|---|---|---|---|---|---|"]
        for job in sweep.results["kernels"]:
            lines += [f"| {job['kernel']} | {stage['stage']} | {stage['path']} | "
                      + " | ".join(_number(stage.get(key), "{:.1f}") for key in ("build_s", "probe_s", "warm_s")) + " |"
                      for stage in job.get("stages") or []]
    if sweep and sweep.results.get("rows"):
        reference = sweep.results["rows"][0].get("reference") or "-"
        lines += ["", f"The sweep (seed scenario; reference `{reference}`; kernel: the path each point rendered with "
                      "and its first render's cache state; speedup = reference median / warm median, its range from "
                      "the extremes of both):", "",
                  "| size | dtype | device | kernel | cold s | warm median s (min–max) | reference s | "
                  "speedup (range) | r vs reference | r vs CPU |", "|---|---|---|---|---|---|---|---|---|---|"]
        for row in sweep.results["rows"]:
            lines.append(
                f"| {row['size']}² | {row['dtype']} | {row['device']} | {row.get('mode') or '-'} "
                f"({row.get('compile_cache') or '-'}) | {_number(row['cold_s'], '{:.2f}')} | "
                f"{_number(row['warm_median_s'], '{:.5f}')} ({_number(row['warm_min_s'], '{:.5f}')}–"
                f"{_number(row['warm_max_s'], '{:.5f}')}) | {_number(row['reference_median_s'], '{:.3f}')} | "
                f"{_number(row['speedup'], '{:.1f}')}x ({_number(row['speedup_min'], '{:.1f}')}–"
                f"{_number(row['speedup_max'], '{:.1f}')}) | {_number(row['correlation'], '{:.10f}')} | "
                f"{_number(row['correlation_cpu'], '{:.10f}')} |")
    fit = records.get("fit")
    if fit and fit.results:
        lines += ["", "Fitting (benchmarks/fit_workloads.py):", "", "```json",
                  json.dumps(fit.results, indent=1), "```"]
    merge = records.get("merge")
    if merge and merge.results:
        lines += ["", "Merging:", "", "```json", json.dumps(merge.results, indent=1), "```"]
    fits = records.get("cpu_fits")
    if fits and fits.results:
        lines += ["", f"The fit-convergence tests on the machine's processor ({fits.results['cpu']}, "
                      f"{fits.results['cores']} cores): {fits.results['summary']}."]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu_campaign", description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the same steps at small sizes on the CPU (no GPU needed)")
    parser.add_argument("--c-binary", default=os.environ.get("NBSIM_C_BINARY"),
                        help="a nanoBragg binary to compare with (default: $NBSIM_C_BINARY)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "results" / "gpu_campaign"))
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help=f"seconds for all steps together (default {BUDGET_S:.0f})")
    parser.add_argument("--only", nargs="+", choices=STEPS, default=list(STEPS), help="steps to run")
    parser.add_argument("--wheelhouse", type=Path, default=REPO / "wheelhouse",
                        help="wheels to install offline where this Python lacks them (default: wheelhouse/)")
    return parser


def main(argv: list[str] | None = None) -> int:
    options = _parser().parse_args(argv)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # the sweep's tables are read with nbsim's own code, installed or not
    if options.c_binary and not os.access(options.c_binary, os.X_OK):
        print(f"gpu_campaign: the C binary {options.c_binary} is missing or not executable", file=sys.stderr)
        return 2
    if options.wheelhouse.is_dir():
        # One folder per Python version: the wheels are built for one.
        site = Path(tempfile.gettempdir()) / f"nbsim-wheelhouse-py{sys.version_info.major}{sys.version_info.minor}"
        sys.path.insert(0, str(site))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH", "")]))
        try:
            installed = install_wheelhouse(options.wheelhouse, site)
        except WheelhouseError as error:
            print(f"gpu_campaign: {error}; nothing was run", file=sys.stderr)
            return 2
        if installed:
            print(f"gpu_campaign: installed from {options.wheelhouse}: {', '.join(installed)}", flush=True)
    missing = missing_modules(REQUIRED_MODULES)
    if missing:
        print(f"gpu_campaign: this Python ({sys.executable}) lacks {', '.join(missing)}: build the wheelhouse "
              "(make wheelhouse) or install them; nothing was run", file=sys.stderr)
        return 2
    import torch

    if not options.cpu and not torch.cuda.is_available():
        print("gpu_campaign: no CUDA device here (torch.cuda.is_available() is false); --cpu runs the campaign on "
              "the CPU", file=sys.stderr)
        return 2
    options.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="nbsim-campaign-"))
    campaign = Campaign(options, Plan.of(options.cpu), work)
    campaign.say(f"GPU campaign ({'CPU stand-in' if options.cpu else 'CUDA'}) in {work}, results to {options.out}, "
                 f"budget {options.budget_s:.0f} s")
    records = {name: run_step(campaign, name) for name in STEPS if name in options.only}
    environment = records["environment"].results if "environment" in records else step_environment(campaign)
    summary = summary_markdown(environment, records, options)
    (work / "summary.md").write_text(summary)
    (work / "summary.json").write_text(json.dumps(
        {"environment": environment, "steps": {name: asdict(record) for name, record in records.items()}},
        indent=1) + "\n")
    with tarfile.open(work / "campaign.tar.gz", "w:gz") as archive:
        for path in sorted(work.rglob("*")):
            relative = path.relative_to(work)
            if path.is_file() and path.suffix != ".gz" and not any(
                    part.endswith(".zarr") or part == "compile-cache" for part in relative.parts):
                archive.add(path, arcname=str(relative))
    for name in ("summary.md", "summary.json", "campaign.log", "campaign.tar.gz"):
        shutil.copy(work / name, options.out / name)
    print(summary)
    failed = [name for name, record in records.items() if record.status.startswith("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
