"""Benchmark harness: time nbsim (cold and warm) and, optionally, the nanoBragg C binary, side by side.

`nbsim bench [options] -- <nanoBragg args>` prints a human summary and, as its last stdout line, one
JSON object (`nbsim.timing.BenchResult`); nbsim.timing times the sweep's points the same way.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict

import torch

from ..cache import configure_compile_cache
from ..errors import NbsimError
from ..io.atomic import atomic_write_text
from ..io.images import write_float_image
from ..modes import Compile
from ..nanobragg import config_from_args
from ..reference import correlation, run_c_reference
from ..timing import time_nbsim
from .options import CommandParser
from .products import stacked_panels


def _parser() -> argparse.ArgumentParser:
    parser = CommandParser("bench", takes_flags=True, prog="nbsim bench",
                           description="Time nbsim (and optionally the C nanoBragg).")
    parser.add_argument("--device", default="cpu", help="where to render: cpu or cuda[:N] (default cpu)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"),
                        help="precision of the render (default float32)")
    parser.add_argument("--repeats", type=int, default=5, help="timed warm renders (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed warm renders before them (default 1)")
    parser.add_argument("--compile", default="on", choices=("on", "off", "auto"),
                        help="the compiled kernel (default on: built first if not cached; off: eager)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for nbsim (default: torch's)")
    parser.add_argument("--floatfile", default=None, help="also write nbsim's image (raw float32)")
    parser.add_argument("--c-binary", default=None, help="path of a nanoBragg binary to time the same way")
    parser.add_argument("--json", default=None, help="also write the JSON result to this file")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then nanoBragg arguments")
    return parser


def main(argv: list[str]) -> int:
    """`nbsim bench`: time a command cold and warm (and the C binary, given one); the exit status."""
    from ..devices import resolve_device, resolve_dtype

    options = _parser().parse_args(argv)
    nanobragg_args = options.args[1:] if options.args[:1] == ["--"] else options.args
    if not nanobragg_args:
        raise NbsimError("bench: give the nanoBragg arguments after --")
    if options.repeats < 1 or options.warmup < 0:
        raise NbsimError("bench: --repeats must be at least 1 and --warmup not negative")
    if options.threads:
        torch.set_num_threads(options.threads)
    device = resolve_device(options.device)
    compile_setting = Compile.of(options.compile)
    if compile_setting is not Compile.OFF:
        configure_compile_cache()
    config = config_from_args(nanobragg_args)
    panels = config.detector.panels
    if panels and options.c_binary:
        raise NbsimError("bench: the C renders one panel, not a -panelfile detector; drop --c-binary")
    image, result = time_nbsim(config, device, resolve_dtype(options.dtype), compile_setting, options.warmup,
                               options.repeats)
    if options.floatfile:
        write_float_image(options.floatfile, stacked_panels(image, panels) if panels else image)
    print(f"nbsim {result.device} {result.dtype} compile={options.compile} ({result.mode}, kernel cache "
          f"{result.compile_cache}): cold {result.cold_s:.3f} s, "
          f"warm median {result.warm_median_s:.4f} s (min {result.warm_min_s:.4f}, max {result.warm_max_s:.4f}) "
          f"over {result.repeats} runs, {result.pixels} pixels x {result.steps} steps, "
          f"peak RSS {result.peak_rss_mb:.0f} MB")
    for line in result.warnings:
        print(f"WARNING: {line}")
    if options.c_binary:
        c_image, c_times = run_c_reference(options.c_binary, nanobragg_args, options.warmup, options.repeats)
        result.c_times_s = c_times
        result.c_median_s = statistics.median(c_times)
        result.speedup = result.c_median_s / result.warm_median_s
        result.correlation = correlation(image, c_image.reshape(image.shape)) if c_image.size == image.size \
            else math.nan
        print(f"C {options.c_binary}: median {result.c_median_s:.3f} s (whole process); speedup "
              f"{result.speedup:.1f}x; correlation {result.correlation:.7f}")
    payload = json.dumps(asdict(result))
    if options.json:
        atomic_write_text(options.json, payload + "\n")
    sys.stdout.flush()
    print(payload)
    return 0
