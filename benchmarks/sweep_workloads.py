"""The sweep's benchmark workloads (run by benchmarks/run.py).

`rotation_series`: config/examples/rotation_series.yaml (1000 frames of 128 x 128, float32 compiled,
float64 compiled nbsim reference) run by Snakemake in an empty folder, so with an empty kernel cache as
in a fresh clone; then run again, which must execute nothing. Reports the wall time, points per second,
and the share of the wall time spent in timed rendering (each point's set-up, cold and warm renders,
summed over the batches, references included).

`collate_10k`: the collation of 10,000 points of 256 x 256 (synthetic batch stores written as the
simulate jobs write them), in its own process, whose peak RSS must stay within 1 GB.

    python benchmarks/sweep_workloads.py collate FOLDER   # the collation process (used by collate_10k)
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
ROTATION_CONFIG = REPO / "config" / "examples" / "rotation_series.yaml"
ROTATION_MAX_WALL_S = 180.0
COLLATE_MAX_RSS_MB = 1024.0
COLLATE_POINTS, COLLATE_BATCH, COLLATE_SIZE = 10_000, 100, 256
QUICK_COLLATE = (200, 20, 64)


def _snakemake(folder: Path, config: Path) -> tuple[float, subprocess.CompletedProcess]:
    command = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(folder),
               "--configfile", str(config), "--workflow-profile", str(REPO / "workflow" / "profiles" / "default"),
               "--cores", "2"]
    environment = {**os.environ, "NBSIM_BACKGROUND_BUILD": "off"}
    environment.pop("NBSIM_CACHE_DIR", None)
    begin = time.perf_counter()
    completed = subprocess.run(command, capture_output=True, text=True, env=environment)
    return time.perf_counter() - begin, completed


def run_rotation_series(quick: bool, folder: Path) -> dict:
    """The example rotation series from scratch, then a no-op rerun. `quick`: 20 eager frames."""
    config = yaml.safe_load(ROTATION_CONFIG.read_text())
    if quick:
        config["sweep"].update(compile=["off"], batch_size=10, extra={"-phi": {"start": 0, "stop": 2, "step": 0.1}})
        config["reference"]["compile"] = False
    work = folder / "rotation"
    work.mkdir()
    config_path = work / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    wall_s, first = _snakemake(work, config_path)
    if first.returncode != 0:
        return {"error": (first.stderr.strip().splitlines() or ["snakemake failed"])[-1]}
    rerun_s, second = _snakemake(work, config_path)
    results = work / config["results"]
    scenario = next(iter(config["scenarios"]))
    tables = results / scenario / "tables"
    rows = {name: len((tables / f"{name}.csv").read_text().splitlines()) - 1 for name in ("timing", "correlation")}
    records = [json.loads(p.read_text()) for p in sorted((results / scenario).glob("*/*/records.json"))]
    points = sum(len(r["points"]) for r in records if r["kind"] == "points")
    timed_s = sum(r["timed_s"] for r in records)
    kernels = [json.loads(p.read_text()) for p in sorted((results / "kernels").glob("*.json"))]
    return {"command": ["snakemake", "--configfile", str(ROTATION_CONFIG), "--cores", "2"], "result": {
        "points": points, "wall_s": wall_s, "points_per_s": points / wall_s, "render_share": timed_s / wall_s,
        "timed_s": timed_s, "batch_wall_s": sum(r["wall_s"] for r in records), "batches": len(records),
        "kernel_build_s": [k["build_s"] for k in kernels], "table_rows": rows, "rerun_s": rerun_s,
        "rerun_executes_nothing": second.returncode == 0 and "Nothing to be done" in second.stdout + second.stderr}}


def rotation_verdict(record: dict) -> str:
    if "error" in record:
        return "failed: " + record["error"]
    result = record["result"]
    met = (result["wall_s"] <= ROTATION_MAX_WALL_S and result["rerun_executes_nothing"]
           and set(result["table_rows"].values()) == {result["points"]})
    return "met" if met else "NOT met"


def write_synthetic_batches(folder: Path, batches: int, per_batch: int, size: int,
                            axis: str) -> tuple[list[Path], dict[str, Path]]:
    """Batch stores and records as the simulate jobs write them (also used by tests/test_sweep.py): point
    k (counted across batches) has `axis` = k and a sparse spot-like image whose maximum is k + 1.
    Returns the records files and the stores by batch name."""
    import numpy as np

    from nbsim.sweep.jobs import IMAGE_DIMENSIONS
    from nbsim.sweep.store import AtomicStore, write_json

    generator = np.random.default_rng(0)
    records, stores = [], {}
    for b in range(batches):
        name = f"n{size}-float32-cpu-compile_on-b{b:04d}"
        entries = []
        with AtomicStore(folder / name / "images.zarr", {}) as store:
            images = store.variable("image", IMAGE_DIMENSIONS, (per_batch, size, size), np.float32,
                                    chunks=(1, size, size))
            for i in range(per_batch):
                k = b * per_batch + i
                image = np.zeros((size, size), np.float32)
                image[generator.integers(0, size, 200), generator.integers(0, size, 200)] = k + 1
                images[i] = image
                entries.append({"name": f"{name}-{i}", "reference": f"r{b}-{i}", "size": size, "index": i,
                                "status": "ok", "axes": {"size": size, "dtype": "float32", "device": "cpu",
                                                         "compile": "on", axis: k},
                                "timing": {"cold_s": 0.01, "warm_median_s": 0.002},
                                "comparison": {"correlation": 1.0}})
            store.commit()
        write_json(folder / name / "records.json", {"scenario": "s", "batch": name, "points": entries})
        records.append(folder / name / "records.json")
        stores[name] = folder / name / "images.zarr"
    return records, stores


def collate_folder(folder: Path) -> dict:
    """Tables and the collated store of every batch under `folder` (the measured process)."""
    from nbsim.sweep.collate import TIMING_COLUMNS, point_rows, write_collated_store, write_table
    from nbsim.sweep.report import TIMING_VIEW, write_reader_tables

    begin = time.perf_counter()
    records = sorted(folder.glob("*/records.json"))
    rows = point_rows(records, [])
    axes = ["size", "dtype", "device", "compile", "misset_seed"]
    write_table(rows, axes, folder / "timing.csv", TIMING_COLUMNS)
    write_reader_tables(rows, axes, TIMING_VIEW, folder / "timing.md", folder / "timing.html", "timing")
    write_collated_store(rows, {p.parent.name: p.parent / "images.zarr" for p in records}, axes,
                         folder / "sweep.zarr")
    return {"points": len(rows), "wall_s": time.perf_counter() - begin,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}


def run_collate_10k(quick: bool, folder: Path) -> dict:
    points, per_batch, size = QUICK_COLLATE if quick else (COLLATE_POINTS, COLLATE_BATCH, COLLATE_SIZE)
    work = folder / "collate"
    begin = time.perf_counter()
    write_synthetic_batches(work, points // per_batch, per_batch, size, "misset_seed")
    written_s = time.perf_counter() - begin
    command = [sys.executable, str(Path(__file__).resolve()), "collate", str(work)]
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        return {"error": (completed.stderr.strip().splitlines() or ["collation failed"])[-1]}
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    image_mb = points * size * size * 4 / 2**20
    return {"command": command, "result": {**result, "size": size, "images_mb": image_mb,
                                           "synthetic_write_s": written_s}}


def collate_verdict(record: dict) -> str:
    if "error" in record:
        return "failed: " + record["error"]
    return "met" if record["result"]["peak_rss_mb"] <= COLLATE_MAX_RSS_MB else "NOT met"


def sweep_rows(name: str, record: dict) -> str:
    if "error" in record:
        return f"| {name} | failed: {record['error']} |"
    result = record["result"]
    if name == "rotation_series":
        return (f"| {name} | {result['points']} points in {result['wall_s']:.1f} s ({result['points_per_s']:.1f} "
                f"points/s), {100 * result['render_share']:.0f} % of it timed rendering; kernels built in "
                f"{', '.join(f'{s:.0f}' for s in result['kernel_build_s'])} s; rerun {result['rerun_s']:.1f} s "
                f"(nothing to do: {result['rerun_executes_nothing']}); table rows {result['table_rows']} |")
    return (f"| {name} | {result['points']} points of {result['size']}^2 ({result['images_mb']:.0f} MB of images) "
            f"collated in {result['wall_s']:.1f} s, peak RSS {result['peak_rss_mb']:.0f} MB |")


SWEEP_WORKLOADS = {
    "rotation_series": (run_rotation_series, rotation_verdict, sweep_rows,
                        f"1000 frames from scratch in <= {ROTATION_MAX_WALL_S:g} s, every row, no-op rerun"),
    "collate_10k": (run_collate_10k, collate_verdict, sweep_rows,
                    f"collation peak RSS <= {COLLATE_MAX_RSS_MB:g} MB"),
}


if __name__ == "__main__":
    if sys.argv[1:2] != ["collate"] or len(sys.argv) != 3:
        sys.exit("usage: sweep_workloads.py collate FOLDER")
    print(json.dumps(collate_folder(Path(sys.argv[2]))))
