"""The dataset benchmark workloads (run by benchmarks/run.py), each config/examples/dataset.yaml run by
Snakemake on 2 cores in an empty folder:

`dataset_10k`: 10,000 shots of 256 x 256 from an empty kernel cache (random orientations, mosaic spread
and wavelength drawn per shot, Poisson noise, labels), the config as a user writes it (no `timing` section,
no `batch_size`: the cost model's batches): wall time, shots per second, files written (the whole run
folder: stores, records, tables, logs, Snakemake's metadata; the kernel cache apart), bytes per shot (batch
stores, collated store) and the fewest photons of a shot. Goal: <= 5 minutes and <= 2,000 files, every
shot with photons.

`dataset_timed`: the same with the `timing` section the schema once required (`warmup: 0, repeats: 1,
threads: 2`; issue 34's slow path, then 100 jobs of 100 shots each rendered twice, about 15 minutes): a
dataset times the repeats on each batch's first shot only, and the cost model sizes its batches.

`dataset_resume`: the same run (the kernel cache dataset_10k filled) killed (SIGKILL to Snakemake and its
jobs, as a SLURM wall time does) once about a third of the shots are in their batch stores, then unlocked
and run again: the rerun must render only the shots the stores lack, and the collated labels must be the
uninterrupted run's (when `dataset_10k` ran first in the same call).

`dataset_1024`: shots per second of 1024 x 1024 shots on the CPU (40 shots, 2 jobs of 20 side by side, the
kernel cache dataset_10k filled).

`--quick`: 200 shots of 64 x 64 (and 8 of 256 x 256 for dataset_1024); not the targets' figures.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
DATASET_CONFIG = REPO / "config" / "examples" / "dataset.yaml"
MAX_WALL_S, MAX_FILES = 300.0, 2000
RESUME_KILL_FRACTION = 1 / 3
_LAST_LABELS: dict[str, str] = {}
"""dataset_10k's labels table, which dataset_resume's must equal."""


def _config(quick: bool, folder: Path, size: int | None = None, count: int | None = None,
            batch_size: int | None = None) -> dict:
    config = yaml.safe_load(DATASET_CONFIG.read_text())
    if quick:
        config["sweep"]["sizes"] = [64]
        config["sweep"]["draws"]["count"] = 200
    if size:
        config["sweep"]["sizes"] = [size]
    if count:
        config["sweep"]["draws"]["count"] = count
    if batch_size:
        config["sweep"]["batch_size"] = batch_size
    # One kernel cache for the three workloads: dataset_10k, run first, starts it empty; the others reuse
    # its kernel (one structure for every size), so their figures are rendering, not building.
    config["results"], config["compile_cache"] = "results", str(folder / "dataset-compile-cache")
    return config


def _command(folder: Path, config: Path) -> list[str]:
    return [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(folder),
            "--configfile", str(config), "--workflow-profile", str(REPO / "workflow" / "profiles" / "default"),
            "--cores", "2"]


def _environment() -> dict[str, str]:
    environment = {**os.environ, "NBSIM_BACKGROUND_BUILD": "off"}
    environment.pop("NBSIM_CACHE_DIR", None)
    return environment


def _prepare(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _tree(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _outcome(folder: Path, config: dict, wall_s: float) -> dict:
    """What a finished run wrote: shots, files, bytes, labels, and per-batch render and resume counts."""
    results = folder / "results"
    scenario = next(iter(config["scenarios"]))
    records = [json.loads(p.read_text()) for p in sorted((results / scenario / "batches").glob("*/records.json"))]
    shots = sum(len(r["points"]) for r in records)
    batch_files, batch_bytes = map(sum, zip(*(_tree(p) for p in (results / scenario / "batches").glob("*/images.zarr")),
                                            strict=True))
    collated_files, collated_bytes = _tree(results / scenario / "sweep.zarr")
    all_files, all_bytes = _tree(folder)
    labels = (results / scenario / "tables" / "labels.csv").read_text()
    return {"shots": shots, "size": config["sweep"]["sizes"][0], "wall_s": wall_s, "shots_per_s": shots / wall_s,
            "files": all_files, "bytes": all_bytes, "batch_store_files": batch_files,
            "batch_bytes_per_shot": batch_bytes / shots, "collated_store_files": collated_files,
            "collated_bytes_per_shot": collated_bytes / shots, "batches": len(records),
            "rendered": sum(r["rendered"] for r in records), "resumed": sum(r["resumed"] for r in records),
            "label_rows": len(labels.splitlines()) - 1, "labels": labels,
            "render_s": sum(p["timed_s"] for r in records for p in r["points"]),
            "batch_sizes": sorted({len(r["points"]) for r in records}),
            "fewest_photons": min(p["labels"]["total_photons"] for r in records for p in r["points"]),
            "warm_timed_shots": sum(bool(p["timing"]["warm_times_s"]) for r in records for p in r["points"]),
            "process_startup_s": [round(r["process_startup_s"], 2) for r in records],
            "load_average_1min": os.getloadavg()[0]}


def _timed_run(work: Path, path: Path) -> tuple[float, str | None]:
    """Run the sweep in `work` once: its wall seconds, and the last line of its error output if it failed."""
    begin = time.perf_counter()
    completed = subprocess.run(_command(work, path), capture_output=True, text=True, env=_environment())
    wall_s = time.perf_counter() - begin
    if completed.returncode != 0:
        return wall_s, (completed.stderr.strip().splitlines() or ["snakemake failed"])[-1]
    return wall_s, None


def _run_sweep(work: Path, config: dict) -> dict:
    """`config` run once in the empty folder `work`: its `_outcome`, or {"error": ...} if Snakemake failed."""
    wall_s, error = _timed_run(work, _prepare(work, config))
    return {"error": error} if error else _outcome(work, config, wall_s)


def run_dataset_10k(quick: bool, folder: Path) -> dict:
    config = _config(quick, folder)
    result = _run_sweep(folder / "dataset_10k", config)
    if "error" in result:
        return result
    _LAST_LABELS["dataset"] = result.pop("labels")
    return {"command": ["snakemake", "--configfile", str(DATASET_CONFIG), "--cores", "2"], "result": result}


def run_dataset_timed(quick: bool, folder: Path) -> dict:
    config = _config(quick, folder)
    config["timing"] = {"warmup": 0, "repeats": 1, "threads": 2}
    result = _run_sweep(folder / "dataset_timed", config)
    if "error" in result:
        return result
    result.pop("labels")
    return {"command": ["snakemake", "--configfile", "dataset.yaml + timing {warmup: 0, repeats: 1, threads: 2}",
                        "--cores", "2"], "result": result}


def dataset_verdict(record: dict) -> str:
    if "error" in record:
        return "failed: " + record["error"]
    result = record["result"]
    met = result["wall_s"] <= MAX_WALL_S and result["files"] <= MAX_FILES and result["fewest_photons"] > 0
    return "met" if met else "NOT met"


def _completed_shots(results: Path) -> int:
    from nbsim.sweep.store import completed_points

    done = 0
    for store in results.glob("*/batches/*/images.zarr"):
        if (store / "done" / "zarr.json").is_file():
            try:
                done += int(completed_points(store).sum())
            except (OSError, ValueError, KeyError):  # a store being created this instant
                continue
    return done


def run_dataset_resume(quick: bool, folder: Path) -> dict:
    """Kill the run (its whole process group) once RESUME_KILL_FRACTION of the shots are stored, rerun it."""
    config = _config(quick, folder)
    work = folder / "dataset_resume"
    path = _prepare(work, config)
    total = config["sweep"]["draws"]["count"]
    begin = time.perf_counter()
    process = subprocess.Popen(_command(work, path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=_environment(), start_new_session=True)
    done = 0
    while process.poll() is None and done < total * RESUME_KILL_FRACTION:
        time.sleep(0.5)
        done = _completed_shots(work / "results")
    if process.poll() is not None:
        return {"error": f"the run ended (status {process.returncode}) before a third of the shots were stored"}
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    killed_at_s = time.perf_counter() - begin
    stored = _completed_shots(work / "results")
    finished = {p.parent.name for p in (work / "results").glob("*/batches/*/records.json")}
    # Snakemake's lock outlives a SIGKILL, as after a wall time: unlock, then run again.
    subprocess.run([*_command(work, path), "--unlock"], capture_output=True, text=True, env=_environment())
    rerun_s, error = _timed_run(work, path)
    if error:
        return {"error": f"rerun: {error}"}
    result = _outcome(work, config, rerun_s)
    labels = result.pop("labels")
    records = [json.loads(p.read_text()) for p in (work / "results").glob("*/batches/*/records.json")
               if p.parent.name not in finished]  # the batches the rerun ran (the others finished before the kill)
    rerun_rendered = sum(r["rendered"] for r in records)
    result.update(killed_at_s=killed_at_s, stored_before_rerun=stored, total_shots=total,
                  batches_finished_before_kill=len(finished), rerun_rendered=rerun_rendered,
                  rerun_renders_only_missing=rerun_rendered == total - stored,
                  labels_equal_uninterrupted=labels == _LAST_LABELS["dataset"] if "dataset" in _LAST_LABELS else None)
    return {"command": ["snakemake", "--configfile", str(DATASET_CONFIG), "(SIGKILL), then again"], "result": result}


def resume_verdict(record: dict) -> str:
    if "error" in record:
        return "failed: " + record["error"]
    result = record["result"]
    met = result["rerun_renders_only_missing"] and result["stored_before_rerun"] > 0 \
        and result["labels_equal_uninterrupted"] is not False and result["shots"] == result["total_shots"]
    return "met" if met else "NOT met"


def run_dataset_1024(quick: bool, folder: Path) -> dict:
    config = _config(False, folder, size=256 if quick else 1024, count=8 if quick else 40,
                     batch_size=4 if quick else 20)
    result = _run_sweep(folder / "dataset_1024", config)
    if "error" in result:
        return result
    result.pop("labels")
    result["render_shots_per_s"] = result["shots"] / result["render_s"] * 2  # two jobs side by side
    return {"command": ["snakemake", "--configfile", "dataset.yaml (sizes [1024], 40 draws)", "--cores", "2"],
            "result": result}


def dataset_rows(name: str, record: dict) -> str:
    if "error" in record:
        return f"| {name} | failed: {record['error']} |"
    r = record["result"]
    text = (f"| {name} | {r['shots']} shots of {r['size']}^2 in {r['wall_s']:.1f} s ({r['shots_per_s']:.2f} shots/s); "
            f"{r['files']} files; {r['batch_bytes_per_shot'] / 1024:.1f} KiB/shot in batch stores, "
            f"{r['collated_bytes_per_shot'] / 1024:.1f} KiB/shot collated; {r['batches']} batches of "
            f"{'/'.join(map(str, r['batch_sizes']))}; fewest photons in a shot {r['fewest_photons']:.3g}; "
            f"load {r['load_average_1min']:.1f}")
    if name == "dataset_resume":
        text += (f"; killed at {r['killed_at_s']:.0f} s with {r['stored_before_rerun']} shots stored, rerun rendered "
                 f"{r['rerun_rendered']} (only the missing: {r['rerun_renders_only_missing']}), labels equal: "
                 f"{r['labels_equal_uninterrupted']}")
    if name == "dataset_1024":
        text += f"; {r['render_shots_per_s']:.2f} shots/s rendering (2 jobs)"
    return text + " |"


DATASET_WORKLOADS = {
    "dataset_10k": (run_dataset_10k, dataset_verdict, dataset_rows,
                    f"10,000 shots of 256^2 from scratch in <= {MAX_WALL_S:g} s, <= {MAX_FILES} files"),
    "dataset_timed": (run_dataset_timed, dataset_verdict, dataset_rows,
                      f"the same with timing {{repeats: 1, threads: 2}}: <= {MAX_WALL_S:g} s, <= {MAX_FILES} files"),
    "dataset_resume": (run_dataset_resume, resume_verdict, dataset_rows,
                       "after a SIGKILL the rerun renders only the missing shots, same labels"),
    "dataset_1024": (run_dataset_1024, lambda record: "failed: " + record["error"] if "error" in record
                     else "measured", dataset_rows, "shots/s at 1024^2 on the CPU"),
}
