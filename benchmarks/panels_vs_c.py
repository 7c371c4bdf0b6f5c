"""Each panel of a tilted, shifted multi-panel detector against the nanoBragg C rendering that panel alone.

    python benchmarks/panels_vs_c.py --c-binary PATH [--out FILE]

nbsim renders the three panels below in one call (-panelfile, float64); for each panel the C is run with
that panel's -fdet_vector, -sdet_vector, -odet_vector, -beam_vector and its place as -Xbeam/-Ybeam/-distance
along the beam (nbsim.model.geometry.single_panel_flags; the C recomputes pix0 from them under either pivot). The
script prints and writes, per panel, the correlation and the largest relative difference over the C's
non-zero pixels (the C writes float32), and checks them against correlation >= 0.999999 and max relative <= 1e-5
(docs/formats.md records a run). CI has no C binary: tests/test_panels.py checks the same panels against
nbsim's own single-panel renders of those flags.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import yaml

from nbsim.model.geometry import panel_geometries, single_panel_flags
from nbsim.nanobragg import parse
from nbsim.render import Renderer
from nbsim.resolve import resolve

CRYSTAL = ["-cell", "60", "70", "80", "90", "95", "90", "-default_F", "100", "-N", "4", "-lambda", "1.1",
           "-misset", "10", "20", "5", "-oversample", "2", "-mosaic", "0.3", "-mosaic_domains", "3",
           "-beam_vector", "0.999", "0.03", "-0.02"]
MIN_CORRELATION = 0.999999
MAX_RELATIVE = 1e-5


def _rotated(vector, turns) -> list[float]:
    v = np.array(vector, dtype=float)
    for axis, angle_deg in turns:
        k, a = np.array(axis, dtype=float), math.radians(angle_deg)
        v = v * math.cos(a) + np.cross(k, v) * math.sin(a) + k * (k @ v) * (1 - math.cos(a))
    return v.tolist()


def panels() -> list[dict]:
    """A flat panel, one tilted about y then z, one rolled about x then y; different sizes and pixels."""
    tilt, roll = [((0, 1, 0), 25), ((0, 0, 1), -10)], [((1, 0, 0), 30), ((0, 1, 0), -8)]
    return [
        {"name": "flat", "pixels": [160, 128], "pixel_mm": 0.1, "fdet": [0, 0, 1], "sdet": [0, -1, 0],
         "pix0_mm": [80.0, 6.4, -8.0]},
        {"name": "tilted", "pixels": [192, 96], "pixel_mm": 0.12, "fdet": _rotated((0, 0, 1), tilt),
         "sdet": _rotated((0, -1, 0), tilt), "pix0_mm": [75.0, 24.0, 9.0]},
        {"name": "rolled", "pixels": [96, 144], "pixel_mm": 0.09, "fdet": _rotated((0, 0, -1), roll),
         "sdet": _rotated((0, 1, 0), roll), "odet": _rotated((1, 0, 0), roll), "pix0_mm": [78.0, -20.0, 10.0]},
    ]


def compare(c_binary: str, folder: Path) -> dict:
    panel_file = folder / "panels.yaml"
    panel_file.write_text(yaml.safe_dump({"panels": panels()}))
    config, _ = parse(CRYSTAL + ["-panelfile", str(panel_file)])
    image = Renderer(resolve(config), dtype=torch.float64, compile="off")().numpy()
    results = {}
    for index, (panel, geometry) in enumerate(zip(config.detector.panels, panel_geometries(config.detector),
                                                  strict=True)):
        flags = single_panel_flags(geometry)
        c_float = folder / f"{panel.name}.bin"
        command = [c_binary, *CRYSTAL, *flags, "-floatfile", str(c_float), "-intfile", str(folder / "i.img"),
                   "-nonoise", "-nopgm"]
        subprocess.run(command, check=True, capture_output=True, cwd=folder)
        c_image = np.fromfile(c_float, dtype=np.float32).astype(np.float64)
        ours = image[index, :geometry.pixels_s, :geometry.pixels_f].reshape(-1)
        lit = c_image > 0
        relative = float((np.abs(ours[lit] - c_image[lit]) / c_image[lit]).max())
        correlation = float(np.corrcoef(ours, c_image)[0, 1])
        results[panel.name] = {
            "correlation": correlation, "max_relative": relative, "pixels": int(ours.size),
            "c_flags": flags, "passed": correlation >= MIN_CORRELATION and relative <= MAX_RELATIVE}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--c-binary", required=True)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nbsim-panels-") as scratch:
        results = compare(options.c_binary, Path(scratch))
    print("| panel | pixels | correlation | max relative | passed |\n|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['pixels']} | {r['correlation']:.9f} | {r['max_relative']:.2e} | {r['passed']} |")
    if options.out:
        options.out.write_text(json.dumps(results, indent=1))
    return 0 if all(r["passed"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
