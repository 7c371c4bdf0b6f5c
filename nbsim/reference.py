"""The nanoBragg C binary as a reference: run it on an nbsim command line (its arguments translated where
the C lacks a flag) and compare its image with nbsim's. Used by `nbsim bench` and the sweep's reference
batches; it sits above the physical model because a -spectrumfile becomes a -sourcefile of the model's
sources."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from .config import SimulationConfig
from .errors import NbsimError
from .model.beam import build_sources
from .model.geometry import build_geometry
from .nanobragg import parse
from .nanobragg.flags import SAMPLING_FLAG, WAVELENGTH_FLAGS, absolute_file_arguments
from .nanobragg.presets import expand_detector_model
from .resolve import advised_sampling_flags


def run_c_reference(binary: str, argv: list[str], warmup: int, repeats: int,
                    timeout_s: float = 3600.0) -> tuple[np.ndarray, list[float]]:
    """Run the C binary (argument list, no shell) in a clean folder; whole-process wall times and image."""
    path = shutil.which(binary) or binary
    if not Path(path).is_file():
        raise NbsimError(f"C reference binary {binary} not found")
    if not os.access(path, os.X_OK):
        raise NbsimError(f"C reference binary {binary} is not executable")
    argv = absolute_file_arguments(argv, Path.cwd())
    times = []
    with tempfile.TemporaryDirectory(prefix="nbsim-c-") as folder:
        floatfile = Path(folder) / "c_float.bin"
        # Output flags go first: nanoBragg's substring matching lets a trailing flag such as
        # -misset_seed consume the tokens after it.
        sourcefile = Path(folder) / "c_sources.txt"
        command = [path, "-floatfile", str(floatfile), "-nonoise", "-nopgm", "-intfile",
                   str(Path(folder) / "c_int.img"), *c_arguments(argv, sourcefile)]
        for run in range(warmup + repeats):
            for stale in Path(folder).iterdir():
                if stale != sourcefile:
                    stale.unlink()
            begin = time.perf_counter()
            try:
                completed = subprocess.run(command, cwd=folder, capture_output=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise NbsimError(f"C reference {binary} did not finish within {timeout_s:g} s") from None
            elapsed = time.perf_counter() - begin
            if completed.returncode != 0:
                tail = completed.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
                raise NbsimError(f"C reference {binary} failed with status {completed.returncode}: {tail[0]}")
            if run >= warmup:
                times.append(elapsed)
        if not floatfile.is_file():
            raise NbsimError(f"C reference {binary} wrote no float image")
        image = np.fromfile(floatfile, dtype=np.float32)
    return image, times


def c_arguments(argv: list[str], sourcefile: Path) -> list[str]:
    """nanoBragg's arguments for an nbsim command line. The C has no -spectrumfile: it becomes a -sourcefile
    (written to `sourcefile`) of the same sources (moved as -spectrum_shift and -spectrum_stretch say), every
    divergence direction times every channel, which the C weighs equally, and the nominal -lambda. The C's
    image then equals nbsim's for equal weights. A -detector_model becomes its flags (the C renders its module
    gaps, which nbsim leaves out), and `-sampling advised` the -phisteps and -mosaic_dom it sets."""
    argv = expand_detector_model(argv)
    if SAMPLING_FLAG not in argv and "-spectrumfile" not in argv:
        return argv
    config = parse(argv)[0]
    argv = _explicit_sampling(argv, config)
    if "-spectrumfile" not in argv:
        return argv
    geometry = build_geometry(config.detector)
    sources = build_sources(config.beam, geometry.beam, geometry.polar, geometry.vertical)
    sourcefile.write_text("".join(f"{x!r} {y!r} {z!r} 1 {wavelength * 1e-10!r}\n" for (x, y, z), wavelength
                                  in zip(sources.positions_m.tolist(), sources.wavelength_A.tolist(), strict=True)))
    spectrum_flags = ("-spectrumfile", "-spectrum_shift", "-spectrum_stretch")
    at = [i for i, arg in enumerate(argv) if arg in spectrum_flags]
    rest = [arg for i, arg in enumerate(argv) if i not in at and i - 1 not in at]
    given = any(flag in argv for flag in WAVELENGTH_FLAGS)
    nominal = [] if given else ["-lambda", repr(float(config.beam.wavelength_A))]
    return [*rest, *nominal, "-sourcefile", str(sourcefile)]


def _explicit_sampling(argv: list[str], config: SimulationConfig) -> list[str]:
    """`argv` (parsed as `config`) without -sampling (the C has none) and with the counts `-sampling advised`
    sets as flags."""
    if SAMPLING_FLAG not in argv:
        return argv
    at = [i for i, arg in enumerate(argv) if arg == SAMPLING_FLAG]
    rest = [arg for i, arg in enumerate(argv) if i not in at and i - 1 not in at]
    return [*rest, *advised_sampling_flags(config)[1]]


def correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson correlation of two images (1 for two equal constant images, NaN for other constant ones)."""
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    if a.std() == 0 or b.std() == 0:
        return 1.0 if np.array_equal(a, b) else math.nan
    return float(np.corrcoef(a, b)[0, 1])
