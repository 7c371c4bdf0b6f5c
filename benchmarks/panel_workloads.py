"""The `panels_4x2048` benchmark workload (run by benchmarks/run.py): an XFEL shot on a 4-panel detector, four
2048² panels of 0.1 mm pixels tiling an 8192² mm plane 100 mm from the sample (-panelfile), with 100 sources
(-dispersion 10 in 100 steps: 100 wavelengths) and 25 mosaic domains, 2,500 steps per pixel, float32.
`nbsim bench` times it in its own process (cold, then warm renders of all four panels in one call); the
figure is shots per second, 1 / the warm median. The C cannot render several panels: no C side. `--quick`
renders four 64² panels.

    python benchmarks/run.py --only panels_4x2048 [--quick]
    python benchmarks/panel_workloads.py [--device cuda] [--quick] [--repeats N]   (alone, on any device)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

PANEL_PIXELS = 2048
QUICK_PANEL_PIXELS = 64
PIXEL_MM = 0.1
DISTANCE_MM = 100.0
SHOT_ARGS = ("-default_F", "100", "-cell", "100", "100", "100", "90", "90", "90", "-lambda", "6.2", "-N", "5",
             "-dispersion", "10", "-dispsteps", "100", "-mosaic", "0.5", "-mosaic_dom", "25", "-oversample", "1")


def panel_file(path: Path, pixels: int) -> Path:
    """Four square panels in a 2 x 2 block around the beam (MOSFLM axes: fast along +z, slow along -y)."""
    side_mm = pixels * PIXEL_MM
    panels = [{"name": f"q{row}{col}", "pixels": [pixels, pixels], "pixel_mm": PIXEL_MM, "fdet": [0.0, 0.0, 1.0],
               "sdet": [0.0, -1.0, 0.0], "pix0_mm": [DISTANCE_MM, side_mm * (1 - row), side_mm * (col - 1)]}
              for row in range(2) for col in range(2)]
    path.write_text(yaml.safe_dump({"panels": panels}))
    return path


def run_panels(quick: bool, folder: Path, device: str = "cpu", repeats: int = 1) -> dict:
    pixels = QUICK_PANEL_PIXELS if quick else PANEL_PIXELS
    json_path = folder / "panels_4x2048.json"
    command = [sys.executable, "-m", "nbsim.cli", "bench", "--device", device, "--dtype", "float32",
               "--repeats", str(repeats), "--warmup", "0", "--json", str(json_path), "--",
               *SHOT_ARGS, "-panelfile", str(panel_file(folder / "panels_4x2048.yaml", pixels))]
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        return {"command": command, "error": (completed.stderr.strip().splitlines() or ["failed"])[-1]}
    result = json.loads(json_path.read_text())
    return {"command": command, "panel_pixels": pixels, "result": result,
            "shots_per_s": 1.0 / result["warm_median_s"]}


def panels_verdict(record: dict) -> str:
    return "failed: " + record["error"] if "error" in record else "recorded"


def panels_row(name: str, record: dict) -> str:
    if "error" in record:
        return f"| {name} | failed: {record['error']} |"
    result = record["result"]
    return (f"| {name} | 4 x {record['panel_pixels']}², {result['steps']} steps/pixel, {result['device']} "
            f"({result['threads']} threads): {record['shots_per_s']:.4g} shots/s (warm {result['warm_median_s']:.2f} s"
            f", cold {result['cold_s']:.1f} s, {result['mode']}) |")


PANEL_WORKLOADS = {
    "panels_4x2048": (run_panels, panels_verdict, panels_row, "recorded only"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the panels_4x2048 workload alone")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=1)
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nbsim-panels-") as scratch:
        record = run_panels(options.quick, Path(scratch), options.device, options.repeats)
    print(panels_row("panels_4x2048", record))
    print(json.dumps(record, indent=1))
    return 1 if "error" in record else 0


if __name__ == "__main__":
    sys.exit(main())
