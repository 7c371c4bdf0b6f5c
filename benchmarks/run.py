"""nbsim's benchmark workloads, measured side by side with the nanoBragg C binary on the same machine.

    python benchmarks/run.py [--c-binary PATH] [--only NAME ...] [--repeats N] [--quick] [--out FILE]

Each kernel workload runs `nbsim bench --json` in a fresh process (so peak RSS is that workload's),
which times nbsim's cold and warm renders and, with `--c-binary`, the C's whole process the same way.
The `cli` workload times whole processes: the `nbsim` command (warm compile cache) and the C binary,
alternating, with the same arguments and outputs; `cli_worker` does the same with a running
`nbsim worker` serving the commands (PyTorch already imported, kernels loaded). The `new_values`
workload builds the heavy structure once in an empty kernel cache, then starts a new process for each
other count, HKL table and value, each of which must load the kernel (not build it) and render its first
image in at most a second; `first_image` times the first image of an uncached structure with
`-compile auto` against `off` and `on` (and `auto` once the cache holds it). The script prints tables,
says which targets each figure meets, and writes everything as JSON. The sweep workloads
(`rotation_series`, `collate_10k`) are described in benchmarks/sweep_workloads.py, the dataset workloads
(`dataset_10k`, `dataset_timed`, `dataset_resume`, `dataset_1024`) in benchmarks/dataset_workloads.py,
`cli_answers` in
benchmarks/answers.py, the detector's (`noise_c`, `noise_philox`) in benchmarks/detector_workloads.py,
`panels_4x2048` (shots per second of a 4-panel detector) in benchmarks/panel_workloads.py,
`gradients` in benchmarks/gradient_workloads.py, `fit_gradient`, `fit_still`, `fit_100_stills` and `fit_panels`
(the modules of a JUNGFRAU-like detector refined with 20 stills: 20 minutes on 2 busy cores) in
benchmarks/fit_workloads.py, `merge_sad` (an SAD experiment merged by `nbsim merge`) in
benchmarks/merge_workloads.py.
`--quick` shrinks every detector for a smoke run; its figures are not the targets' figures.

Without `--only`, every workload runs but the hours-long ones (LONG_WORKLOADS: `merge_sad`, 1,000 stills rendered
and merged); `--only merge_sad` runs it at its target's size, and `--quick` without `--only` runs its small smoke
run (20 stills of 128², one cycle: about 3 minutes on 2 cores) with the rest. `--list` prints what would run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import workloads
from anomalous_workloads import ANOMALOUS_WORKLOADS
from answers import ANSWER_WORKLOADS
from dataset_workloads import DATASET_WORKLOADS
from detector_workloads import DETECTOR_WORKLOADS
from dials_workloads import DIALS_WORKLOADS
from fit_workloads import FIT_WORKLOADS
from format_workloads import FORMAT_WORKLOADS
from gradient_workloads import GRADIENT_WORKLOADS
from merge_workloads import MERGE_WORKLOADS
from model_workloads import MODEL_WORKLOADS
from panel_workloads import PANEL_WORKLOADS
from sweep_workloads import SWEEP_WORKLOADS

TABLE_WORKLOADS = {**ANSWER_WORKLOADS, **SWEEP_WORKLOADS, **MODEL_WORKLOADS, **FORMAT_WORKLOADS, **DETECTOR_WORKLOADS,
                   **DATASET_WORKLOADS, **PANEL_WORKLOADS, **GRADIENT_WORKLOADS, **DIALS_WORKLOADS,
                   **FIT_WORKLOADS, **ANOMALOUS_WORKLOADS, **MERGE_WORKLOADS}
"""Workloads reported as one line each: (run(quick, folder), verdict(record), row(name, record), target)."""

REPO = Path(__file__).resolve().parent.parent
SEED_ARGS = list(workloads.SEED_ARGS)
HEAVY_ARGS = list(workloads.HEAVY_ARGS)
SPECTRUM_ARGS = ("-hkl", "{golden}/synthetic_P1.hkl", "-cell", "70", "80", "90", "75", "85", "95",
                 "-misset", "10", "20", "30", "-N", "10", "-distance", "200", "-pixel", "0.1", "-mosaic", "0.3",
                 "-mosaic_dom", "25", "-mosaic_seed", "3", "-oversample", "1",
                 "-spectrumfile", "{benchmarks}/spectrum_100.txt")
"""An XFEL shot: 100 spectrum channels (equal weights, so that the C, given the same sources, renders the
same image) × 25 mosaic domains = 2,500 steps per pixel."""
OUTPUT_ARGS = ["-floatfile", "float.bin", "-intfile", "int.img", "-nonoise", "-nopgm"]
MIN_CORRELATION = 0.99999


@dataclass(frozen=True)
class Workload:
    """One benchmark: nanoBragg arguments, how nbsim runs them, and the target it is held to."""

    name: str
    args: tuple[str, ...]
    detpixels: int
    quick_detpixels: int
    dtype: str = "float32"
    device: str = "cpu"
    min_speedup: float | None = None
    max_peak_rss_mb: float | None = None
    with_c: bool = True
    """Also time the C here (skipped where the C would take minutes and no target needs it)."""


WORKLOADS = (
    Workload("seed_f32", tuple(SEED_ARGS), 4096, 256, min_speedup=50.0),
    Workload("seed_f64", tuple(SEED_ARGS), 4096, 256, dtype="float64", min_speedup=25.0),
    Workload("heavy_f32", tuple(HEAVY_ARGS), 1024, 128, min_speedup=20.0),
    Workload("heavy_4096_rss", tuple(HEAVY_ARGS), 4096, 256, max_peak_rss_mb=2048.0, with_c=False),
    Workload("seed_cuda", tuple(SEED_ARGS), 4096, 256, device="cuda"),
    Workload("spectrum_100", SPECTRUM_ARGS, 1024, 128, min_speedup=25.0),
)
CLI_WORKLOADS = ("cli", "cli_worker")
NEW_VALUES_DETPIXELS = 256
NEW_VALUES_MAX_COLD_S = 1.0
VARIATIONS = {
    "mosaic domains": ["-mosaic_dom", "7"],
    "N": ["-N", "7"],
    "Na Nb Nc": ["-Na", "8", "-Nb", "9", "-Nc", "11"],
    "phi steps": ["-phisteps", "5"],
    "divergence grid": ["-hdivsteps", "5", "-vdivsteps", "4"],
    "oversample": ["-oversample", "3"],
    "automatic oversample": ["-oversample", "0"],
    "another HKL file": ["-hkl", "{other_hkl}"],
    "lambda distance misset": ["-lambda", "1.2", "-distance", "180", "-misset", "5", "15", "25"],
}
"""The `new_values` workload's variations of the heavy arguments: each a new count, table or value."""
FIRST_IMAGE_CASES = (("seed_f32", tuple(SEED_ARGS), 4096, 256), ("heavy_f32", tuple(HEAVY_ARGS), 1024, 128))
FIRST_IMAGE_MARGIN_S = 2.0
FIRST_IMAGE_ROUNDS = 3
COLD_WORKLOADS = ("new_values", "first_image")
LONG_WORKLOADS = {"merge_sad": "1,000 stills of 256² rendered and merged: hours on 2 cores"}
"""Workloads that take hours at their target's size: run only when `--only` names them (`--quick` runs their
smoke runs by default)."""


def nanobragg_args(workload: Workload, golden: Path, quick: bool) -> list[str]:
    pixels = workload.quick_detpixels if quick else workload.detpixels
    return [arg.format(golden=golden, benchmarks=REPO / "benchmarks") for arg in workload.args] + [
        "-detpixels", str(pixels)]


def run_kernel_workload(workload: Workload, args: list[str], options: argparse.Namespace, folder: Path) -> dict:
    """`nbsim bench` in its own process; returns its JSON result with the command that produced it."""
    json_path = folder / f"{workload.name}.json"
    command = [sys.executable, "-m", "nbsim.cli", "bench", "--device", workload.device, "--dtype", workload.dtype,
               "--repeats", str(1 if workload.max_peak_rss_mb else options.repeats),
               "--warmup", str(0 if workload.max_peak_rss_mb else 1), "--json", str(json_path)]
    if options.c_binary and workload.with_c:
        command += ["--c-binary", options.c_binary]
    command += ["--", *args]
    completed = subprocess.run(command, capture_output=True, text=True, env=_environment(options))
    if completed.returncode != 0:
        return {"command": command, "error": (completed.stderr.strip().splitlines() or ["failed"])[-1]}
    return {"command": command, "result": json.loads(json_path.read_text())}


def run_cli_workload(args: list[str], options: argparse.Namespace, folder: Path, worker: bool) -> dict:
    """Whole processes, alternating nbsim and C: the `nbsim` command after one run that warms its cache
    (and, with `worker`, the worker that serves it)."""
    nbsim_command = [sys.executable, "-m", "nbsim.server.client" if worker else "nbsim.cli", *args, *OUTPUT_ARGS]
    c_command = [options.c_binary, *OUTPUT_ARGS, *args] if options.c_binary else None
    environment = _environment(options) | {"NBSIM_WORKER": "on" if worker else "off"}
    worker_control = [sys.executable, "-m", "nbsim.server.client", "worker"]

    def timed(command: list[str], name: str) -> float:
        workdir = folder / name
        workdir.mkdir(exist_ok=True)
        begin = time.perf_counter()
        completed = subprocess.run(command, cwd=workdir, capture_output=True, text=True, env=environment)
        elapsed = time.perf_counter() - begin
        if completed.returncode != 0:
            raise RuntimeError(f"{command[0]} failed: {(completed.stderr.strip().splitlines() or [''])[-1]}")
        return elapsed

    def worker_status() -> subprocess.CompletedProcess:
        return subprocess.run([*worker_control, "status"], capture_output=True, text=True, env=environment)

    if worker and worker_status().returncode == 0:
        return {"command": nbsim_command, "error": "a worker already serves this cache folder; stop it first"}
    result = {}
    try:
        if worker:
            timed([*worker_control, "start", "--idle-timeout", "600"], "nbsim")
        cold_s = timed(nbsim_command, "nbsim")
        nbsim_times, c_times = [], []
        for _ in range(options.repeats):
            nbsim_times.append(timed(nbsim_command, "nbsim"))
            if c_command:
                c_times.append(timed(c_command, "c"))
        if worker:
            served = re.search(r"(\d+) commands served", worker_status().stdout)
            result["worker_commands_served"] = int(served.group(1)) if served else 0
            if result["worker_commands_served"] != options.repeats + 1:
                raise RuntimeError(f"the worker served {result['worker_commands_served']} of "
                                   f"{options.repeats + 1} commands")
    except RuntimeError as error:
        return {"command": nbsim_command, "error": str(error)}
    finally:
        if worker:
            subprocess.run([*worker_control, "stop"], capture_output=True, env=environment)
    result |= {"first_run_s": cold_s, "nbsim_times_s": nbsim_times, "nbsim_median_s": statistics.median(nbsim_times)}
    if c_times:
        result |= {"c_times_s": c_times, "c_median_s": statistics.median(c_times),
                   "speedup": statistics.median(c_times) / statistics.median(nbsim_times)}
    return {"command": nbsim_command, "c_command": c_command, "result": result}


def _environment(options: argparse.Namespace, cache_dir: Path | None = None) -> dict[str, str]:
    return {**os.environ, "NBSIM_CACHE_DIR": str(cache_dir or options.cache_dir), "NBSIM_BACKGROUND_BUILD": "off"}


def bench_once(args: list[str], compile: str, cache_dir: Path, options: argparse.Namespace, folder: Path,
               name: str) -> dict:
    """One `nbsim bench --repeats 1 --warmup 0` process: its cold render (parse, set-up, kernel load or
    build, first image), the mode that rendered and the kernel cache state, and the process's wall time."""
    json_path = folder / f"{name}.json"
    command = [sys.executable, "-m", "nbsim.cli", "bench", "--compile", compile, "--repeats", "1", "--warmup", "0",
               "--json", str(json_path), "--", *args]
    begin = time.perf_counter()
    completed = subprocess.run(command, capture_output=True, text=True, env=_environment(options, cache_dir))
    process_s = time.perf_counter() - begin
    if completed.returncode != 0:
        raise RuntimeError(f"{name}: {(completed.stderr.strip().splitlines() or ['failed'])[-1]}")
    result = json.loads(json_path.read_text())
    return {"command": command, "cold_s": result["cold_s"], "mode": result["mode"],
            "kernel_cache": result["compile_cache"], "process_s": process_s}


def run_new_values(options: argparse.Namespace, folder: Path) -> dict:
    """One compiled run of the heavy structure in an empty cache, then a new process per variation (other
    counts, another HKL table, other values): each must load, not build, and render in ≤ 1 s."""
    cache = folder / "new-values-cache"
    other_hkl = folder / "other.hkl"
    other_hkl.write_text("\n".join(f"{h} {k} {l} {50 + 7 * abs(h) + 3 * abs(k) + abs(l)}" for h in range(-12, 13)
                                    for k in range(-9, 10) for l in range(-15, 16)) + "\n")
    pixels = WORKLOADS[2].quick_detpixels if options.quick else NEW_VALUES_DETPIXELS
    base = [arg.format(golden=options.golden) for arg in HEAVY_ARGS] + ["-detpixels", str(pixels)]
    try:
        first = bench_once(base, "on", cache, options, folder, "new-values-first")
        variations = {}
        for label, extra in VARIATIONS.items():
            args = base + [arg.format(other_hkl=other_hkl) for arg in extra]
            variations[label] = bench_once(args, "auto", cache, options, folder, "new-values")
    except RuntimeError as error:
        return {"error": str(error)}
    return {"result": {"first": first, "variations": variations, "detpixels": pixels}}


def run_first_image(options: argparse.Namespace, folder: Path) -> dict:
    """The first image of a structure in a new process, with an empty kernel cache: `auto` against the
    better of eager (`off`) and compile-then-render (`on`), and then `auto` again with the cache filled.
    `auto` and `off` alternate FIRST_IMAGE_ROUNDS times and their median runs are compared, since this
    machine's speed drifts by tens of per cent between processes; `on` builds, so it runs once."""
    cases = {}
    try:
        for name, args, detpixels, quick_detpixels in FIRST_IMAGE_CASES:
            full = [arg.format(golden=options.golden) for arg in args] + [
                "-detpixels", str(quick_detpixels if options.quick else detpixels)]
            rounds = {"auto": [], "off": []}
            for index in range(FIRST_IMAGE_ROUNDS):
                for mode, runs_of_mode in rounds.items():
                    cache = folder / f"first-{name}-{mode}-{index}"
                    runs_of_mode.append(bench_once(full, mode, cache, options, folder, "first"))
            runs = {mode: _median_run(runs_of_mode) for mode, runs_of_mode in rounds.items()}
            runs["on"] = bench_once(full, "on", folder / f"first-{name}-on", options, folder, "first")
            runs["auto_cached"] = bench_once(full, "auto", folder / f"first-{name}-on", options, folder, "first")
            best = min(runs["off"]["cold_s"], runs["on"]["cold_s"])
            cases[name] = {"runs": runs, "rounds": rounds, "best_s": best,
                           "within_margin": runs["auto"]["cold_s"] <= best + FIRST_IMAGE_MARGIN_S}
    except RuntimeError as error:
        return {"error": str(error)}
    return {"result": cases}


def _median_run(runs: list[dict]) -> dict:
    """The run with the median first render (of an odd number of runs)."""
    return sorted(runs, key=lambda run: run["cold_s"])[len(runs) // 2]


def cold_verdict(name: str, record: dict) -> str:
    if "error" in record:
        return "failed: " + record["error"]
    if name == "new_values":
        runs = record["result"]["variations"].values()
        met = all(r["kernel_cache"] == "hit" and r["cold_s"] <= NEW_VALUES_MAX_COLD_S for r in runs)
    else:
        met = all(case["within_margin"] for case in record["result"].values())
    return "met" if met else "NOT met"


def cold_rows(name: str, record: dict) -> list[str]:
    """Table rows of a cold workload: one per variation or first-image run."""
    if "error" in record:
        return [f"| {name} | - | - | - | - | failed: {record['error']} |"]
    rows = []
    if name == "new_values":
        first = record["result"]["first"]
        rows.append(f"| {name} | first run (builds) | {first['cold_s']:.2f} | {first['mode']} | "
                    f"{first['kernel_cache']} | {first['process_s']:.2f} |")
        for label, run in record["result"]["variations"].items():
            rows.append(f"| {name} | {label} | {run['cold_s']:.3f} | {run['mode']} | {run['kernel_cache']} | "
                        f"{run['process_s']:.2f} |")
        return rows
    for case, data in record["result"].items():
        for mode, run in data["runs"].items():
            label = f"{case} -compile {mode}" + (f" (median of {FIRST_IMAGE_ROUNDS})" if mode in data["rounds"] else "")
            rows.append(f"| {name} | {label} | {run['cold_s']:.2f} | {run['mode']} | "
                        f"{run['kernel_cache']} | {run['process_s']:.2f} |")
    return rows


def verdict(workload: Workload | None, record: dict) -> str:
    """Which target the figure meets ('met', 'NOT met') or why it was not measured; no workload: a CLI one."""
    if "error" in record:
        return "failed: " + record["error"]
    result = record["result"]
    if workload is None:
        return "n/a (no C binary)" if "speedup" not in result else (
            "met" if result["speedup"] >= 1.0 else "NOT met")
    checks = []
    if workload.min_speedup is not None:
        if result.get("speedup") is None:
            return "n/a (no C binary)"
        checks.append(result["speedup"] >= workload.min_speedup and result["correlation"] >= MIN_CORRELATION)
    if workload.max_peak_rss_mb is not None:
        checks.append(result["peak_rss_mb"] <= workload.max_peak_rss_mb)
    return ("met" if all(checks) else "NOT met") if checks else "recorded"


def target_text(workload: Workload | None) -> str:
    if workload is None:
        return "no slower than C (whole process)"
    if workload.min_speedup is not None:
        return f">= {workload.min_speedup:g}x C, corr >= {MIN_CORRELATION}"
    if workload.max_peak_rss_mb is not None:
        return f"peak RSS <= {workload.max_peak_rss_mb:g} MB"
    return "record (<= 1 ms on an H100)"


def table_row(name: str, record: dict, verdict_text: str, target: str) -> str:
    result = record.get("result", {})
    if name in CLI_WORKLOADS:
        nbsim_s, c_s = result.get("nbsim_median_s"), result.get("c_median_s")
        rss, corr = None, None
    else:
        nbsim_s, c_s = result.get("warm_median_s"), result.get("c_median_s")
        rss, corr = result.get("peak_rss_mb"), result.get("correlation")
    speedup = result.get("speedup")

    def show(value, pattern: str) -> str:
        return pattern.format(value) if value is not None else "-"

    return (f"| {name} | {show(nbsim_s, '{:.4f}')} | {show(c_s, '{:.3f}')} | {show(speedup, '{:.1f}x')} | "
            f"{show(corr, '{:.7f}')} | {show(rss, '{:.0f}')} | {target} | {verdict_text} |")


def main(argv: list[str] | None = None) -> int:
    names = [w.name for w in WORKLOADS] + list(CLI_WORKLOADS) + list(COLD_WORKLOADS) + list(TABLE_WORKLOADS)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Without --only every workload runs but the hours-long ones ("
                                            + ", ".join(LONG_WORKLOADS) + "): name one in --only to run it; "
                                            "--quick runs its smoke run with the rest.")
    parser.add_argument("--c-binary", default=os.environ.get("NBSIM_C_BINARY"),
                        help="nanoBragg binary to compare with (default: $NBSIM_C_BINARY)")
    parser.add_argument("--golden", type=Path, default=REPO.parent / "shared" / "golden",
                        help="folder holding synthetic_P1.hkl (default: ../shared/golden)")
    long = ", ".join(f"{name} ({why})" for name, why in LONG_WORKLOADS.items())
    parser.add_argument("--only", nargs="+", choices=names,
                        help=f"workloads to run (default: all but the hours-long {long}, which --quick runs small)")
    parser.add_argument("--repeats", type=int, default=5, help="warm repeats (and C runs) per workload")
    parser.add_argument("--quick", action="store_true", help="small detectors: a smoke run, not the targets")
    parser.add_argument("--list", action="store_true", help="print the workloads these options run, and stop")
    parser.add_argument("--cache-dir", type=Path, default=REPO / "results" / "benchmarks" / "compile-cache")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "benchmarks" / "benchmarks.json")
    options = parser.parse_args(argv)
    if options.only is None:
        options.only = [name for name in names if options.quick or name not in LONG_WORKLOADS]
    if options.list:
        print("\n".join(options.only))
        return 0
    if options.repeats < 1:
        parser.error("--repeats must be at least 1")
    if options.c_binary and not os.access(options.c_binary, os.X_OK):
        parser.error(f"C binary {options.c_binary} is missing or not executable")
    if any(name.startswith(("heavy", "spectrum")) or name in COLD_WORKLOADS for name in options.only) \
            and not (options.golden / "synthetic_P1.hkl").is_file():
        parser.error(f"heavy workloads need {options.golden / 'synthetic_P1.hkl'}")

    import torch

    rows, records = [], {}
    with tempfile.TemporaryDirectory(prefix="nbsim-bench-") as scratch:
        for workload in WORKLOADS:
            if workload.name not in options.only:
                continue
            if workload.device == "cuda" and not torch.cuda.is_available():
                records[workload.name] = {"skipped": "no CUDA device on this machine"}
                rows.append(table_row(workload.name, {}, "skipped: no CUDA", target_text(workload)))
                continue
            args = nanobragg_args(workload, options.golden, options.quick)
            print(f"running {workload.name} ...", file=sys.stderr, flush=True)
            record = run_kernel_workload(workload, args, options, Path(scratch))
            record["verdict"] = verdict(workload, record)
            records[workload.name] = record
            rows.append(table_row(workload.name, record, record["verdict"], target_text(workload)))
        for name in CLI_WORKLOADS:
            if name not in options.only:
                continue
            print(f"running {name} ...", file=sys.stderr, flush=True)
            args = nanobragg_args(WORKLOADS[0], options.golden, options.quick)
            record = run_cli_workload(args, options, Path(scratch), worker=name == "cli_worker")
            record["verdict"] = verdict(None, record)
            records[name] = record
            rows.append(table_row(name, record, record["verdict"], target_text(None)))
        cold_table = []
        for name in COLD_WORKLOADS:
            if name not in options.only:
                continue
            print(f"running {name} ...", file=sys.stderr, flush=True)
            record = (run_new_values if name == "new_values" else run_first_image)(options, Path(scratch))
            record["verdict"] = cold_verdict(name, record)
            records[name] = record
            cold_table += cold_rows(name, record)
        line_table = []
        for name, (run, judge, row, target) in TABLE_WORKLOADS.items():
            if name not in options.only:
                continue
            print(f"running {name} ...", file=sys.stderr, flush=True)
            record = run(options.quick, Path(scratch))
            record["verdict"] = judge(record)
            records[name] = record
            line_table.append(row(name, record) + f" {target} | {record['verdict']} |")
    header = ["| workload | nbsim warm s | C s | speedup | correlation | peak RSS MB | target | verdict |",
              "|---|---|---|---|---|---|---|---|"]
    print("\n".join(header + rows))
    if cold_table:
        print("\n| workload | run | first render s | mode | kernel cache | process s |\n|---|---|---|---|---|---|")
        print("\n".join(cold_table))
        for name in COLD_WORKLOADS:
            if name in records:
                target = (f"each variation loads the kernel and renders in <= {NEW_VALUES_MAX_COLD_S:g} s"
                          if name == "new_values" else
                          f"auto <= better of off and on + {FIRST_IMAGE_MARGIN_S:g} s")
                print(f"{name}: {target}: {records[name]['verdict']}")
    if line_table:
        print("\n| workload | measured | target | verdict |\n|---|---|---|---|")
        print("\n".join(line_table))
    summary = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": options.quick, "repeats": options.repeats,
        "c_binary": options.c_binary, "machine": {"platform": platform.platform(), "cores": os.cpu_count(),
                                                  "python": platform.python_version(), "torch": torch.__version__},
        "workloads": {w.name: asdict(w) for w in WORKLOADS}, "results": records,
    }
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {options.out}")
    return 1 if any("error" in record for record in records.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
