"""How much the eager and the compiled kernels' images of one command differ, in float32 and float64.

    .venv/bin/python benchmarks/eager_vs_compiled.py [CASE ...]   (default: seed_bench_256 mosaic_phi triclinic_hkl)

Each case is a golden case of ../shared/golden/cases.txt (or NBSIM_GOLDEN), rendered on the CPU with
`compile off` (eager) and `compile on` (the ahead-of-time kernel, built into the kernel cache,
NBSIM_CACHE_DIR, when missing). Printed per case and dtype: the largest difference over the image's
maximum, how many pixels differ at all, how many differ in the -floatfile (the image as 4-byte floats),
and how many still differ after rounding both images to k mantissa bits (the "coarser precision" a
noise stage could draw from); then the photons of the noise image (nbsim.detector.detector_image, the
case's detector settings with noise seed 1) drawn from each.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import numpy as np
import torch

from nbsim.cache import configure_compile_cache
from nbsim.detector import detector_image, layout_of
from nbsim.nanobragg import config_from_args
from nbsim.render import Renderer
from nbsim.resolve import resolve

GOLDEN = Path(os.environ.get("NBSIM_GOLDEN", Path(__file__).resolve().parents[2] / "shared" / "golden"))
DEFAULT_CASES = ("seed_bench_256", "mosaic_phi", "triclinic_hkl")
KEPT_BITS = (16, 12, 8)


def golden_args(name: str) -> list[str]:
    for line in (GOLDEN / "cases.txt").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return [str(GOLDEN / a) if (GOLDEN / a).is_file() else a for a in line.split(":", 1)[1].split()]
    raise SystemExit(f"no case {name} in {GOLDEN / 'cases.txt'}")


def rounded(image: np.ndarray, bits: int) -> np.ndarray:
    """Each value rounded to `bits` bits of mantissa."""
    mantissa, exponent = np.frexp(image)
    return np.ldexp(np.round(mantissa * 2.0 ** bits) / 2.0 ** bits, exponent)


def main(cases: list[str]) -> None:
    configure_compile_cache()
    kept = ", ".join(map(str, KEPT_BITS))
    print(f"| case | dtype | max abs diff / max | pixels differing | after rounding to {kept} bits "
          "| -floatfile pixels differing | noise photons eager / compiled |")
    print("|---|---|---|---|---|---|---|")
    for name in cases:
        setup = resolve(config_from_args(golden_args(name)))
        for dtype in (torch.float64, torch.float32):
            images = [Renderer(setup, "cpu", dtype, compile=c)().detach().to(torch.float64).numpy()
                      for c in ("off", "on")]
            eager, compiled = images
            relative = float(np.abs(eager - compiled).max() / np.abs(eager).max())
            differing = int(np.count_nonzero(eager != compiled))
            after = [int(np.count_nonzero(rounded(eager, b) != rounded(compiled, b))) for b in KEPT_BITS]
            in_file = int(np.count_nonzero(eager.astype(np.float32) != compiled.astype(np.float32)))
            response = dataclasses.replace(setup.config.response, noise_seed=1)
            photons = [detector_image(torch.from_numpy(image.astype(np.float32)), response,
                                      layout_of(setup)).total_photons for image in images]
            print(f"| {name} | {str(dtype)[6:]} | {relative:.2e} | {differing} of {eager.size} | "
                  f"{' / '.join(map(str, after))} | {in_file} | {photons[0]:.0f} / {photons[1]:.0f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(DEFAULT_CASES))
