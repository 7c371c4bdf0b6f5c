"""The detector workloads (run by benchmarks/run.py), timed in this process on the SEED image rendered once
(float32, eager) at 4096² (256² with --quick):

* `noise_c`: nanoBragg's noise image (the CLI's -noisefile default): the compiled serial ran1/poidev loop
  alone (`nanobragg_poisson`) and the whole detector stage with default settings (`detector_image`:
  float64 conversion, the loop, ADC offset, clamp). Target: the stage ≤ 1 s at 4096².
* `noise_philox`: the detector stage with the Philox generator, Poisson only and with every effect
  (flicker, calibration, Gaussian PSF, readout noise, beam stop, hot and dead pixels), at 4096² (PyTorch's
  threads) and per 256² image (a dataset's shot, on one thread as a job per core runs it: on small images
  PyTorch's second thread costs more than it gives). Recorded only.

Each figure is the median of `REPEATS` runs after one untimed run (which builds the compiled code into the
cache on first use).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

PIXELS, QUICK_PIXELS, SHOT_PIXELS = 4096, 256, 256
REPEATS = 5
MAX_NOISE_C_S = 1.0


def _seed_image(pixels: int):
    from workloads import SEED_ARGS

    from nbsim.nanobragg import parse
    from nbsim.render import Renderer
    from nbsim.resolve import resolve

    config, run = parse([*SEED_ARGS, "-detpixels", str(pixels), "-seed", "1"])
    setup = resolve(config)
    return Renderer(setup, compile="off")().detach().float(), setup


def _median(function, repeats: int) -> dict:
    """Wall times and this process's CPU times (all its threads): on a shared machine the CPU time shows
    what the wall time would be without the others."""
    function()
    times, cpu_times = [], []
    for _ in range(repeats):
        begin, cpu_begin = time.perf_counter(), time.process_time()
        function()
        times.append(time.perf_counter() - begin)
        cpu_times.append(time.process_time() - cpu_begin)
    return {"median_s": statistics.median(times), "times_s": times, "median_cpu_s": statistics.median(cpu_times),
            "cpu_times_s": cpu_times}


def run_noise_c(quick: bool, folder: Path) -> dict:
    from nbsim.detector import detector_image, layout_of
    from nbsim.detector.native import nanobragg_poisson

    pixels = QUICK_PIXELS if quick else PIXELS
    image, setup = _seed_image(pixels)
    layout = layout_of(setup)
    array = image.numpy()
    roi = (0, pixels - 1, 0, pixels - 1)
    loop = _median(lambda: nanobragg_poisson(array, roi, -1), REPEATS)
    stage = _median(lambda: detector_image(image, setup.config.response, layout), REPEATS)
    result = detector_image(image, setup.config.response, layout)
    return {"result": {"pixels": pixels, "loop": loop, "stage": stage, "total_photons": result.total_photons,
                       "overloads": result.overloads}}


def run_noise_philox(quick: bool, folder: Path) -> dict:
    from dataclasses import replace

    import torch

    from nbsim.detector import detector_image, layout_of

    pixels = QUICK_PIXELS if quick else PIXELS
    image, setup = _seed_image(pixels)
    shot, shot_setup = _seed_image(SHOT_PIXELS)
    poisson = replace(setup.config.response, generator="philox")
    everything = replace(poisson, flicker_fraction=0.02, calibration_fraction=0.03, psf="gaussian",
                         psf_fwhm_um=100.0, readout_noise_adu=3.0, beamstop_radius_mm=2.0,
                         hot_pixel_fraction=1e-4, dead_pixel_fraction=1e-4)
    timings = {}
    threads = torch.get_num_threads()
    for label, response in (("poisson", poisson), ("every_effect", everything)):
        timings[label] = _median(lambda chosen=response: detector_image(image, chosen, layout_of(setup)), REPEATS)
        torch.set_num_threads(1)
        timings[f"{label}_per_{SHOT_PIXELS}_shot_1_thread"] = _median(
            lambda chosen=response: detector_image(shot, chosen, layout_of(shot_setup)), REPEATS)
        torch.set_num_threads(threads)
    return {"result": {"pixels": pixels, **timings}}


def noise_c_verdict(record: dict) -> str:
    if "error" in record:
        return "failed: " + record["error"]
    stage = record["result"]["stage"]["median_s"]
    if record["result"]["pixels"] != PIXELS:
        return "recorded (quick)"
    return f"{'meets' if stage <= MAX_NOISE_C_S else 'misses'} ≤ {MAX_NOISE_C_S:g} s"


def noise_philox_verdict(record: dict) -> str:
    return "failed: " + record["error"] if "error" in record else "recorded"


def noise_c_row(name: str, record: dict) -> str:
    if "error" in record:
        return f"| {name} | failed: {record['error']} |"
    result = record["result"]
    return (f"| {name} | {result['pixels']}²: serial loop {result['loop']['median_s']:.3f} s (CPU "
            f"{result['loop']['median_cpu_s']:.3f} s), whole stage {result['stage']['median_s']:.3f} s (CPU "
            f"{result['stage']['median_cpu_s']:.3f} s; {result['total_photons']:.0f} photons) |")


def noise_philox_row(name: str, record: dict) -> str:
    if "error" in record:
        return f"| {name} | failed: {record['error']} |"
    result = record["result"]
    cells = [f"{label} {timing['median_s']:.3f} s (CPU {timing['median_cpu_s']:.3f} s)"
             for label, timing in result.items() if label != "pixels"]
    return f"| {name} | {result['pixels']}²: " + ", ".join(cells) + " |"


DETECTOR_WORKLOADS = {
    "noise_c": (run_noise_c, noise_c_verdict, noise_c_row, f"the stage ≤ {MAX_NOISE_C_S:g} s at {PIXELS}²"),
    "noise_philox": (run_noise_philox, noise_philox_verdict, noise_philox_row, "recorded only"),
}
