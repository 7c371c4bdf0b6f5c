"""The `formats` benchmark workload (run by benchmarks/run.py): what writing each file for processing
software costs beside nanoBragg's -intfile. For 1024² and 4096² detectors (the SEED set-up, resolved but not
rendered) and one noise-like count image (Poisson background about the adc, sparse bright spots), each
writer is timed in this process, `REPEATS` times after one untimed write: the SMV -intfile, the -cbffile
miniCBF and the -nxmxfile NXmx file; the median, the file's size and the ratio to the -intfile write are
recorded."""

from __future__ import annotations

import datetime
import statistics
import time
from pathlib import Path

import numpy as np
from workloads import SEED_ARGS

SIZES = (1024, 4096)
QUICK_SIZES = (128, 256)
REPEATS = 5


def _counts(pixels: int) -> np.ndarray:
    generator = np.random.default_rng(0)
    counts = generator.poisson(42.0, (pixels, pixels)).astype(np.uint16)
    spots = generator.integers(0, pixels, (2, pixels * 4))
    counts[spots[0], spots[1]] = generator.integers(1000, 60000, spots.shape[1]).astype(np.uint16)
    return counts


def _median_write(write, path: Path, repeats: int) -> dict:
    """One untimed write (imports, first allocations), then `repeats` timed ones."""
    write(path)
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        write(path)
        times.append(time.perf_counter() - begin)
    return {"median_s": statistics.median(times), "times_s": times, "bytes": path.stat().st_size}


def _time_writers(pixels: int, repeats: int, folder: Path) -> dict:
    from nbsim.cli.products import experiment_record, smv_fields
    from nbsim.io.detector_images import write_mini_cbf, write_nxmx
    from nbsim.io.images import write_smv
    from nbsim.nanobragg import parse
    from nbsim.resolve import resolve

    now = datetime.datetime.now(datetime.timezone.utc)
    config, run = parse([*SEED_ARGS, "-detpixels", str(pixels)])
    setup = resolve(config)
    record = experiment_record(setup, run.seed)
    fields = smv_fields(setup.geometry, setup, float(config.beam.wavelength_A))
    counts = _counts(pixels)
    omega = np.array([record.phi_start_deg])
    writes = {
        "intfile": (lambda path: write_smv(path, counts, fields), "image.img"),
        "cbffile": (lambda path: write_mini_cbf(path, counts, record, now), "image.cbf"),
        "nxmxfile": (lambda path: write_nxmx(path, [counts], omega, record, now, now), "image.nxs"),
    }
    timings = {name: _median_write(write, folder / file, repeats) for name, (write, file) in writes.items()}
    for timing in timings.values():
        timing["vs_intfile"] = timing["median_s"] / timings["intfile"]["median_s"]
    return timings


def run_formats(quick: bool, folder: Path) -> dict:
    repeats = 2 if quick else REPEATS
    return {"repeats": repeats,
            "result": {str(pixels): _time_writers(pixels, repeats, folder) for pixels in (QUICK_SIZES if quick
                                                                                          else SIZES)}}


def formats_verdict(record: dict) -> str:
    return "failed: " + record["error"] if "error" in record else "recorded"


def formats_row(name: str, record: dict) -> str:
    if "error" in record:
        return f"| {name} | failed: {record['error']} |"
    cells = [f"{pixels}²: " + ", ".join(f"{fmt} {t['median_s']:.3f} s ({t['vs_intfile']:.1f}×, "
                                         f"{t['bytes'] / 1e6:.1f} MB)" for fmt, t in timings.items())
             for pixels, timings in record["result"].items()]
    return f"| {name} | " + "; ".join(cells) + " (median writes; × the -intfile write) |"


FORMAT_WORKLOADS = {
    "formats": (run_formats, formats_verdict, formats_row, "recorded only"),
}
